"""What the commands share: configuration flags named after the paper's symbols, --json, terminal tables."""

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
from collections.abc import Iterator

import torch
from tabulate import tabulate

from switchbench.core.versions import NO_BF16_DOT, interpreted_bf16_dot, triton_interpreter_problem
from switchbench.models import family as registry
from switchbench.models.config import (
    MOA_GATINGS,
    POSITIONS,
    ModelConfig,
    changeable_fields,
    unread,
    unread_error,
    with_changes,
)
from switchbench.models.presets import from_name
from switchbench.ops import tuned as tuning
from switchbench.ops.attention import choice as attention_choice
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.ops.expert_matmul import op as expert_matmul_op
from switchbench.ops.expert_matmul.choice import CHOICES, ENV_IMPL, FALLBACK_RULE
from switchbench.ops.expert_matmul.op import (
    ENV_ROUTING,
    ROUTING_CHOICES,
    routing_choice,
    routing_method,
    routing_selected,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CHOICES = {"pos": POSITIONS, "moa_gating": MOA_GATINGS}


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


# What each configuration flag sets, in the paper's terms (a family option's help is its field's metadata "help")
FIELD_HELP = {
    "model": "the family: its attention (SwitchAll: its MLP too); dense is transformer's other name",
    "pos": "positions: Transformer-XL's relative term, or rotary",
    "d_model": "residual width",
    "n_layers": "layers",
    "n_heads": "H: attention matrices per token (MoA: its active heads)",
    "d_head": "width of a head",
    "d_ff": "hidden width of the dense MLP",
    "n_experts": "E: experts per head (SwitchHead) or in the pool (MoA)",
    "k": "experts each head picks per token and side (SwitchHead)",
    "experts": "which projections are mixtures of experts, letters of qkvo (SwitchHead; e.g. vo)",
    "shared_selection": "one router per head serves both sides (SwitchHead)",
    "T": "chunk length: tokens computed per step",
    "context_blocks": "cached past chunks attended to: C = 1 + context_blocks",
    "vocab": "vocabulary size",
    "causal": "causal attention (off: ListOps classification)",
    "xl_bias_and_scale": "Transformer-XL's extras under XL positions: global biases and a learned logit scale "
    "(dense, GQA, MoH), a learned temperature (MoA); SwitchHead and SwitchAll have none",
    "dropout": "dropout of the embedding, residual branches, MLP hidden layer and before the output layer",
    "entropy_reg": "router entropy regulariser (SwitchHead)",
    "expert_dropout": "expert dropout (SwitchHead)",
    "moa_gating": "MoA's gate over its experts",
    "moa_cv_coef": "MoA's importance CV^2 loss weight",
    "moa_switch_coef": "MoA's switch balance loss weight",
    "moa_z_coef": "MoA's router z-loss weight",
    "mlp_experts": "N_E: experts of the sigma-MoE MLP (SwitchAll)",
    "mlp_expert_size": "G: width of a sigma-MoE expert (SwitchAll)",
    "mlp_k": "K: active sigma-MoE experts per token (SwitchAll)",
    "mlp_entropy_reg": "sigma-MoE router entropy regulariser (SwitchAll)",
    "mlp_expert_dropout": "sigma-MoE expert dropout (SwitchAll)",
}


def _field_help(field: dataclasses.Field) -> str:
    if field.name in FIELD_HELP:
        return FIELD_HELP[field.name]
    owners = [f.name for f in registry.families() if field.name in {o.name for o in f.option_fields()}]
    return f"{field.metadata.get('help', 'an option')} ({', '.join(owners)})"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """A positional PRESET, one flag per ModelConfig field (named after its symbol) and one per option of a
    registered family (``--n-kv-heads``), each overriding the preset."""
    parser.add_argument(
        "preset",
        nargs="?",
        help="a preset, or NAME:field=value,... (see `switchbench presets`; default: the 47M dense Transformer-XL)",
    )
    group = parser.add_argument_group("configuration (each default: the preset's)")
    choices = _CHOICES | {"model": registry.names()}
    for field in changeable_fields():
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool"):
            group.add_argument(
                flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_field_help(field),
            )
        else:
            kind = {"int": int, "float": float, "str": str}.get(field.type, field.type)
            kind = registry.as_name if field.name == "model" else kind
            among = choices.get(field.name) or field.metadata.get("choices")
            metavar = "|".join(among) if among else field.name.upper()
            group.add_argument(
                flag, dest=field.name, type=kind, choices=among, metavar=metavar, help=_field_help(field)
            )


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset (or the default) with the flags given; a family option given to a family without it is an
    error that names the family."""
    base = from_name(args.preset) if args.preset else ModelConfig()
    given = {f.name: getattr(args, f.name) for f in changeable_fields() if getattr(args, f.name) is not None}
    try:
        cfg = with_changes(base, given)
    except ValueError as error:
        if args.preset:
            raise
        # `params --model moa` said "n_heads must be in [1, 5]; got 10", a value the user never gave
        raise ValueError(
            f"{error} (without --preset, what no flag sets is the default configuration's: name a --preset of "
            "the family, or set that field)"
        ) from None
    ignored = unread(cfg, given)
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        raise unread_error(cfg, ignored, flags)
    return cfg


def config_label(preset: str | None, cfg: ModelConfig) -> str:
    """How a table names the configuration ``cfg`` the flags made of ``preset``: a changed preset no longer is it."""
    if not preset:
        return "custom"
    return preset if cfg == from_name(preset) else f"{preset}, changed by flags"


def describe(cfg: ModelConfig) -> str:
    heads = f"{cfg.n_heads}x{cfg.d_head}"
    return f"{cfg.model} ({cfg.pos}), d_model {cfg.d_model}, {cfg.n_layers} layers, heads {heads}"


def device_from_args(choice: str | None) -> str:
    """The device asked for, or CUDA when present; asking for CUDA without it is a usage error."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    return choice or ("cuda" if torch.cuda.is_available() else "cpu")


def add_kernel_choices(parser: argparse.ArgumentParser) -> None:
    """``--expert-matmul auto|torch|triton|grouped_mm|all_experts``, ``--attention auto|explicit|sdpa|flex|triton`` and
    ``--routing auto|sort|count|triton``: what every expert matmul and every softmax attention of the command runs
    on, and how every router ranks its experts and groups its slots. The command line puts them in force around
    the command's run; record them with :func:`kernel_metadata`."""
    flags = (
        ("--expert-matmul", CHOICES, ENV_IMPL, "the expert-matmul implementation",
         f"the measured fastest for this GPU and shape, else {FALLBACK_RULE}"),
        ("--attention", attention_choice.CHOICES, attention_choice.ENV, "the softmax attention kernel of every model",
         attention_choice.AUTO_RULE),
        ("--routing", ROUTING_CHOICES, ENV_ROUTING,
         "how routers group their slots by expert: a stable sort, or a count over few experts, which also ranks up "
         "to 8 experts without torch's top-k, in elementwise kernels (count) or Triton's (triton)",
         "the method kernel-tune measured fastest on this GPU, else the sort"),
    )  # fmt: skip
    for flag, choices, env, what, auto in flags:
        parser.add_argument(
            flag,
            choices=choices,
            default=os.environ.get(env) or "auto",
            help=f"{what} (default: ${env} if set, else auto: {auto})",
        )


def at_least(bounds: dict[str, tuple[int | None, int]]) -> None:
    """A ValueError naming the first flag whose value (None: not given) is below its lowest: {flag: (value, lowest)}."""
    for flag, (value, lowest) in bounds.items():
        if value is not None and value < lowest:
            raise ValueError(f"{flag} must be >= {lowest}; got {value}")


def first_repeated(values: list):
    """The first of ``values`` given more than once, else None."""
    return next((v for v in values if values.count(v) > 1), None)


class Distinct(argparse.Action):
    """A list flag whose values must differ: one named twice would be measured twice, its rows repeated."""

    def __call__(self, parser, namespace, values, option_string=None):
        if (repeated := first_repeated(values)) is not None:
            parser.error(f"{option_string}: {repeated} is named twice: each is measured once")
        setattr(namespace, self.dest, values)


@contextlib.contextmanager
def kernels_in_force(args: argparse.Namespace) -> Iterator[None]:
    """Run the block with the command's ``--expert-matmul``, ``--attention`` and ``--routing`` in force (when it has
    the flags), after checking that they and their environment variables name kernels this machine can run."""
    device = getattr(args, "device", None)
    check_expert_matmul(os.environ.get(ENV_IMPL), ENV_IMPL, device)
    choice = getattr(args, "expert_matmul", None)
    check_expert_matmul(choice, "--expert-matmul", device)
    attention = getattr(args, "attention", None)
    check_attention(attention, device)
    routing = getattr(args, "routing", None)
    check_routing(routing, device)
    check_bf16_dots(args, choice, attention)
    with (
        expert_matmul_choice.selected(choice),
        attention_choice.selected(attention),
        routing_selected(routing),
    ):
        yield


def check_bf16_dots(args: argparse.Namespace, expert_matmul: str | None, attention: str | None) -> None:
    """A ValueError where the command would multiply bf16 matrices in Triton's interpreter (a CPU run's ``--dtype
    bf16`` with Triton's attention or expert matmul, named or from the environment), which returns them wrong."""
    dtype = getattr(args, "dtype", None)
    if not isinstance(dtype, str) or not interpreted_bf16_dot(
        device_from_args(getattr(args, "device", None)), dtype
    ):
        return
    # what is in force: a command's flag (whose default is its variable), else the variable
    for flag, env, named in (
        ("--expert-matmul", ENV_IMPL, expert_matmul),
        ("--attention", attention_choice.ENV, attention),
    ):
        named = named or os.environ.get(env)
        if named == "triton":
            where = env if named == os.environ.get(env) else flag
            raise ValueError(f"{_named(where, named)} {NO_BF16_DOT}")


def check_attention(choice: str | None, device: str | None) -> None:
    """``--attention`` (None: the command has no such flag) names a kernel the command's device can run; else a
    ValueError. Every command that takes the flag may train, so a kernel without a CPU backward needs CUDA."""
    if choice is None:
        return
    from_env = os.environ.get(attention_choice.ENV)
    attention_choice.check(from_env or "auto", attention_choice.ENV)
    # the flag's default is the environment's choice: a refusal names where the choice came from
    named = _named(attention_choice.ENV if choice == from_env else "--attention", choice)
    if choice in attention_choice.NEEDS_CUDA and device_from_args(device) != "cuda":
        why = attention_choice.NEEDS_CUDA[choice]
        raise ValueError(f"{named} needs a CUDA device: {why} (use sdpa or explicit there)")
    if choice in attention_choice.NEEDS_TRITON and (reason := _triton_unavailable(device_from_args(device))):
        raise ValueError(f"{named} {reason}")


def check_routing(choice: str | None, device: str | None) -> None:
    """``--routing`` (None: the command has no such flag) and ``SWITCHBENCH_ROUTING`` name a routing the command's
    device can run; else a ValueError. The Triton kernels need CUDA, or Triton's interpreter."""
    routing_choice()  # the environment's choice checked, whatever the flag
    for where, named in ((ENV_ROUTING, os.environ.get(ENV_ROUTING)), ("--routing", choice)):
        if named == "triton":
            reason = _triton_unavailable(device_from_args(device))
            if reason:
                raise ValueError(f"{_named(where, 'triton')} {reason}")


def _named(where: str, choice: str) -> str:
    """A choice as the user made it: ``--flag VALUE`` on the command line, ``VARIABLE=VALUE`` in the environment."""
    return f"{where} {choice}" if where.startswith("--") else f"{where}={choice}"


def _triton_unavailable(device: str) -> str | None:
    """Why Triton's kernels cannot run on ``device`` here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "needs triton, which is not installed"
    if device == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA device, or TRITON_INTERPRET=1 (Triton's slow interpreter)"
    return triton_interpreter_problem()


def check_expert_matmul(choice: str | None, where: str, device: str | None) -> None:
    """``choice`` (None: nothing chosen) names an implementation the command's device can run; else a ValueError."""
    if not choice:
        return
    if choice not in CHOICES:
        raise ValueError(f"{_named(where, choice)}: must be one of {', '.join(CHOICES)}")
    reason = None if choice == "auto" else expert_matmul_op.unavailable(choice)
    if reason:
        raise ValueError(f"{_named(where, choice)}: {reason}")
    if choice == "triton" and (reason := _triton_unavailable(device_from_args(device))):
        raise ValueError(f"{_named(where, choice)} {reason}")


def kernel_metadata(expert_matmul: str, device: str) -> dict:
    """What a run records of its kernels. The expert matmul: the choice, what each shape bucket resolved to so far
    under it (its implementation and why: named, measured fastest, or auto's fallback), and the rule auto falls
    back on. Attention: the choice in force, what each kind of call resolved to so far, and auto's rule. Routing's
    choice and method, and the Triton configurations timed and chosen so far."""
    resolved = expert_matmul_choice.resolutions()
    return {
        "expert_matmul": expert_matmul,
        "expert_matmul_resolved": {key: dataclasses.asdict(r) for key, r in resolved.items()},
        "expert_matmul_auto_entries": expert_matmul_choice.measured_entries(torch.device(device)),
        "expert_matmul_fallback": FALLBACK_RULE,
        "attention": attention_choice.choice(),
        "attention_resolved": attention_choice.resolutions(),
        "attention_auto_rule": attention_choice.AUTO_RULE,
        "routing": routing_choice(),  # --routing: how slots were grouped by expert
        # the method it ran as on the run's device (auto: the one measured fastest on this GPU, else the sort)
        "routing_resolved": routing_method(torch.device(device).type),
        # Triton configurations this process timed and chose, by kernel and shape (none where a table, a pin or the
        # interpreter decided): what kernel-tune would keep
        "triton_configs_measured": {
            f"{kernel} | {key}": label for (kernel, key), label in tuning.chosen().items()
        },
    }


def describe_kernels(metadata: dict) -> str:
    """One line for a run's heading: ``expert matmul auto -> torch (fallback: ...) for 2 shapes; attention auto ->
    explicit (cpu | position bias); routing auto -> sort``."""
    counts = collections.Counter(
        (r["impl"], r["reason"]) for r in metadata["expert_matmul_resolved"].values()
    )
    why = {
        "named": "named",
        "measured": "auto: measured fastest",
        "fallback": f"auto fell back, no measured entry: {FALLBACK_RULE}",
    }
    ran = "; ".join(f"{impl} ({why[r]}) for {n} shape(s)" for (impl, r), n in sorted(counts.items()))
    line = f"expert matmul {metadata['expert_matmul']}" + (f" -> {ran}" if ran else "")
    if "attention" not in metadata:  # a run recorded before the attention choice existed
        return line
    attention = ", ".join(
        f"{backend} ({call})" for call, backend in sorted(metadata["attention_resolved"].items())
    )
    line = f"{line}; attention {metadata['attention']}" + (f" -> {attention}" if attention else "")
    if "routing_resolved" not in metadata:  # a run recorded before the routing was resolved by measurement
        return line
    return f"{line}; routing {metadata['routing']} -> {metadata['routing_resolved']}"


def format_table(rows: list[dict]) -> str:
    """A plain-text table: numbers right-aligned, integers with thousands separators."""
    cells = [
        {k: f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v for k, v in r.items()}
        for r in rows
    ]
    return tabulate(cells, headers="keys", disable_numparse=True, colalign=_alignment(rows))


def _alignment(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    numeric = {k: all(isinstance(r.get(k, 0), int | float) for r in rows) for k in keys}
    return ["right" if numeric[k] else "left" for k in keys]


def emit(payload, as_json: bool, table: list[dict] | None = None) -> None:
    """``payload`` as JSON, or ``table`` (default: the payload's rows) as a terminal table."""
    print(json.dumps(payload, indent=2) if as_json else format_table(payload if table is None else table))


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
