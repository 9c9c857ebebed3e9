"""Named expert-matmul cases and the float64 reference every implementation is checked against.

One registry, read by all: each family declares the cases its layers run (``Family.expert_matmuls``), kernel-bench
and kernel-tune time those at the presets' sizes, and the tests try the small named ones below, each routed in a
pattern that stresses the kernels (empty experts, one expert taking every slot, k = E). The reference is the
definition, one slot at a time: out[n, s // (S / S_out)] += scores[n, e] * x[n, s // (S / S_in)] @ W[e] with
e = indices[n, s].
"""

from dataclasses import dataclass

import torch
from torch import Tensor

ROUTINGS = ("random", "two-experts", "one-expert", "all-experts")


@dataclass(frozen=True)
class Case:
    """One expert matmul's shape as ``switchbench::expert_matmul`` takes it."""

    name: str
    tokens: int  # N
    in_groups: int  # S_in
    slots: int  # S
    out_groups: int  # S_out
    experts_per_group: int  # experts a slot chooses from (its head's E, or the whole pool)
    groups: int  # routers (heads) over a flat axis of groups x experts_per_group experts
    d_in: int
    d_out: int
    gated: bool
    routing: str = (
        "random"  # how the tests route it (ROUTINGS); the benchmarks draw k distinct experts per group
    )
    # projections its router drives: they share one routing (top-k and grouping), made once a step
    shared_by: int = 1

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"case {self.name}: routing must be one of {', '.join(ROUTINGS)}")
        if self.shared_by < 1:
            raise ValueError(f"case {self.name}: shared_by must be >= 1; got {self.shared_by}")

    @property
    def n_experts(self) -> int:
        return self.groups * self.experts_per_group

    @property
    def macs(self) -> int:
        """Useful multiply-accumulates of the forward pass."""
        return self.tokens * self.slots * self.d_in * self.d_out

    @property
    def projection_shape(self) -> tuple[int, int, int]:
        """(M, K, N) of the dense projection of the same useful MACs, reading each input row and writing each output
        row once, as a dense model's projections do: with one input group a token's row times every slot's weight
        side by side ([N, d_in] @ [d_in, S d_out], as dense's V), with one output group every slot's row side by
        side times the weights stacked ([N, S d_in] @ [S d_in, d_out], as dense's O). The op's own shape, the
        slots' rows one by one ([N S, d_in] @ [d_in, d_out]), reads a 262M token's row 8 times for 112 outputs
        each: memory-bound, slower than any dense model runs its projections."""
        if self.in_groups <= self.out_groups:
            return self.tokens * self.in_groups, self.d_in, self.slots // self.in_groups * self.d_out
        return self.tokens * self.out_groups, self.slots // self.out_groups * self.d_in, self.d_out


def _small(name, tokens, in_groups, slots, out_groups, experts, d_in, d_out, routing="random") -> Case:
    return Case(name, tokens, in_groups, slots, out_groups, experts, 1, d_in, d_out, True, routing)


# The tests' cases: widths off the Triton interpreter's 16-wide blocks and off the grouped GEMM's 16-byte rows.
CASES = {
    case.name: case
    for case in (
        _small("switchhead-v", 9, 1, 6, 3, 4, 37, 19),  # 3 heads x k=2, per-head output
        _small("switchhead-o", 7, 3, 6, 1, 5, 19, 23),  # per-head input, summed over heads and choices
        _small("sigma-moe-up", 11, 1, 3, 3, 6, 17, 18),
        _small("sigma-moe-down", 11, 3, 3, 1, 6, 18, 17),
        _small("moa-q", 8, 1, 2, 2, 5, 20, 33),
        _small("single-token", 1, 1, 2, 1, 3, 5, 7),
        _small("empty-experts", 6, 1, 2, 1, 8, 16, 16, "two-experts"),
        _small("one-expert-takes-all", 13, 1, 1, 1, 4, 21, 9, "one-expert"),
        _small("k-equals-E", 5, 1, 4, 1, 4, 9, 17, "all-experts"),
        _small("k-1", 10, 2, 2, 2, 3, 33, 5),
    )
}


def indices(case: Case, gen: torch.Generator) -> Tensor:
    """[N, S] expert indices in the case's routing pattern: uniform; only experts 0 and 2 (the others get no
    slot); every slot to the last expert; or k = E, each token using every expert once in its own order."""
    n, slots, experts = case.tokens, case.slots, case.n_experts
    if case.routing == "random":
        return torch.randint(0, experts, (n, slots), generator=gen)
    if case.routing == "two-experts":
        return torch.tensor([0, 2])[torch.randint(0, 2, (n, slots), generator=gen)]
    if case.routing == "one-expert":
        return torch.full((n, slots), experts - 1)
    if slots != experts:
        raise ValueError(f"case {case.name}: all-experts routing needs k = E")
    return torch.stack([torch.randperm(experts, generator=gen) for _ in range(n)])


def float64_inputs(case: Case, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Seeded float64 inputs of ``case``: x, weight, indices, scores and the output's gradient."""
    gen = torch.Generator().manual_seed(seed)
    routed = indices(case, gen)
    x = torch.randn(case.tokens, case.in_groups, case.d_in, generator=gen, dtype=torch.float64)
    weight = torch.randn(case.n_experts, case.d_in, case.d_out, generator=gen, dtype=torch.float64)
    scores = torch.rand(case.tokens, case.n_experts, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(case.tokens, case.out_groups, case.d_out, generator=gen, dtype=torch.float64)
    return x, weight, routed, scores, grad_out


def reference(x: Tensor, weight: Tensor, indices: Tensor, scores: Tensor | None, s_out: int) -> Tensor:
    """The definition, one slot at a time, in x's dtype; differentiable, so its gradients are references too."""
    n_tokens, s_in = x.shape[:2]
    slots = indices.shape[1]
    rows = []
    for n in range(n_tokens):
        groups = [x.new_zeros(weight.shape[2]) for _ in range(s_out)]
        for s in range(slots):
            e = int(indices[n, s])
            term = x[n, s // (slots // s_in)] @ weight[e]
            if scores is not None:
                term = scores[n, e] * term
            groups[s // (slots // s_out)] = groups[s // (slots // s_out)] + term
        rows.append(torch.stack(groups))
    return torch.stack(rows)
