"""ListOps (Nangia & Bowman 2018): nested prefix expressions over digits, the answer a digit. Generated offline,
deterministically from a seed.

Operators: MAX, MIN, MED (the lower median: the middle of the sorted arguments, the left one of the two middles
for an even count) and SM (sum modulo 10). Example: ``[MAX 2 9 [MIN 4 7 ] 0 ]`` -> 9.
"""

import functools
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

OPERATORS = {
    "[MAX": max,
    "[MIN": min,
    "[MED": statistics.median_low,
    "[SM": lambda args: sum(args) % 10,
}
PAD = "<pad>"
VOCAB = (PAD, *OPERATORS, "]", *map(str, range(10)))
TOKEN_ID = {token: i for i, token in enumerate(VOCAB)}
N_CLASSES = 10


@dataclass(frozen=True)
class ListOpsConfig:
    max_depth: int = 3  # nesting of operators; 1 is a flat expression
    max_args: int = 4  # arguments per operator, at least 2
    max_length: int = 64  # tokens; longer draws are rejected
    nest_probability: float = 0.3  # chance that an argument is itself an expression

    def __post_init__(self):
        if self.max_depth < 1 or self.max_args < 2 or self.max_length < 4:
            raise ValueError("listops needs max_depth >= 1, max_args >= 2 and max_length >= 4")
        if not 0 <= self.nest_probability <= 1:
            raise ValueError(f"nest_probability must be in [0, 1]; got {self.nest_probability}")


def _expression(rng: random.Random, depth: int, cfg: ListOpsConfig) -> tuple[list[str], int]:
    op = rng.choice(list(OPERATORS))
    tokens, values = [op], []
    for _ in range(rng.randint(2, cfg.max_args)):
        if depth < cfg.max_depth and rng.random() < cfg.nest_probability:
            sub, value = _expression(rng, depth + 1, cfg)
        else:
            value = rng.randint(0, 9)
            sub = [str(value)]
        tokens += sub
        values.append(value)
    return [*tokens, "]"], OPERATORS[op](values)


def generate(n: int, seed: int, cfg: ListOpsConfig = ListOpsConfig()) -> list[tuple[list[str], int]]:
    """``n`` (tokens, answer) pairs, the same for the same seed and configuration."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        tokens, answer = _expression(rng, 1, cfg)
        if len(tokens) <= cfg.max_length:
            out.append((tokens, answer))
    return out


# Training steps that share one pool of examples (drawn once, grouped by length into full batches).
POOL_STEPS = 100


def length_batch(
    batch: int, step: int, seed: int, cfg: ListOpsConfig = ListOpsConfig(), held_out: frozenset = frozenset()
) -> list:
    """The ``step``-th training batch: ``batch`` examples of one length, so a step computes on real tokens only
    (padded to 64, a batch did 2.7x the work for the same accuracy per step). The same for the same seed and step,
    so training resumes exactly. Steps come in pools of POOL_STEPS: a pool's examples are drawn once and cut by
    length into full batches, taken in a seeded order; a length's share of the batches is its share of the draws,
    less the incomplete batch each length leaves. An expression in ``held_out`` (the validation set's token tuples)
    is drawn again: flat expressions are few, and without this all 347 flat ones of a 1,000-example validation set
    were trained on, 382 of its expressions in all by step 41,500."""
    return _pool(batch, step // POOL_STEPS, seed, cfg, held_out)[step % POOL_STEPS]


@functools.lru_cache(maxsize=2)
def _pool(batch: int, pool: int, seed: int, cfg: ListOpsConfig, held_out: frozenset) -> tuple:
    rng, by_length, full = random.Random(f"{seed}/{pool}"), defaultdict(list), []
    while len(full) < POOL_STEPS:
        tokens, answer = _expression(rng, 1, cfg)
        if len(tokens) <= cfg.max_length and tuple(tokens) not in held_out:
            bucket = by_length[len(tokens)]
            bucket.append((tokens, answer))
            if len(bucket) == batch:
                full.append(tuple(bucket))
                by_length[len(tokens)] = []
    rng.shuffle(full)
    return tuple(full)


def by_length(examples: list) -> dict[int, list[int]]:
    """The indices of ``examples`` grouped by length: each group runs without padding."""
    groups = defaultdict(list)
    for i, (tokens, _) in enumerate(examples):
        groups[len(tokens)].append(i)
    return dict(sorted(groups.items()))


def operator(tokens: list[str]) -> str:
    """The outer operator of an expression, as the per-operator accuracy names it: MAX, MIN, MED or SM."""
    return tokens[0].removeprefix("[")


def depth(tokens: list[str]) -> int:
    """How deeply the expression nests its operators: 1 for a flat one."""
    level = deepest = 0
    for token in tokens:
        level += token.startswith("[")
        level -= token == "]"
        deepest = max(deepest, level)
    return deepest


def encode(examples: list[tuple[list[str], int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n, length] padded at the end with PAD, and answers [n]."""
    ids = torch.full((len(examples), length), TOKEN_ID[PAD], dtype=torch.long)
    for i, (tokens, _) in enumerate(examples):
        ids[i, : len(tokens)] = torch.tensor([TOKEN_ID[t] for t in tokens])
    return ids, torch.tensor([answer for _, answer in examples])


def tokenize(text: str) -> list[str]:
    """'[MAX 2 [MIN 3 4 ] ]' -> its tokens; ValueError on anything outside the vocabulary, or tokens that are not
    one expression (none at all is left to the caller)."""
    tokens = text.split()
    unknown = sorted({t for t in tokens if t not in TOKEN_ID or t == PAD})
    if unknown:
        raise ValueError(f"not ListOps tokens: {' '.join(unknown)}")
    if tokens:
        try:
            evaluate(tokens)
        except ValueError as error:
            raise ValueError(f"not one ListOps expression: {error}") from None
    return tokens


def evaluate(tokens: list[str]) -> int:
    """The value of one whole expression; ValueError where the tokens are not one (a bracket closing nothing or
    left open, an operator without arguments, a token outside every bracket or after the end). A stack, not
    recursion: an input may nest as deep as the model is long."""
    open_: list[tuple[str, list[int]]] = []  # each open operator and its arguments' values so far
    result = None
    for i, token in enumerate(tokens, 1):
        if result is not None:
            raise ValueError(f"token {i} ({token}) comes after the expression's end")
        if token in OPERATORS:
            open_.append((token, []))
        elif not open_:
            raise ValueError(f"token {i} ({token}) is outside every bracket")
        elif token == "]":
            op, values = open_.pop()
            if not values:
                raise ValueError(f"token {i} closes {op} before any argument")
            value = OPERATORS[op](values)
            if open_:
                open_[-1][1].append(value)
            else:
                result = value
        else:
            open_[-1][1].append(int(token))
    if open_:
        raise ValueError(f"{len(open_)} bracket{'s' if len(open_) > 1 else ''} left open")
    return result
