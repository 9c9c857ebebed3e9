"""What the commands share: configuration flags named after the paper's symbols, --json, terminal tables."""

import argparse
import dataclasses
import importlib.util
import json
import os

import torch
from tabulate import tabulate

from switchbench.models.config import MOA_GATINGS, MODELS, POSITIONS, ModelConfig
from switchbench.models.expert_matmul import ENV_IMPL, IMPLS
from switchbench.models.presets import from_name

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CHOICES = {"model": MODELS, "pos": POSITIONS, "moa_gating": MOA_GATINGS}


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """A positional PRESET and one flag per ModelConfig field (named after its symbol) that overrides it."""
    parser.add_argument("preset", nargs="?", help="a preset name (see `switchbench presets`)")
    group = parser.add_argument_group("configuration (overrides the preset)")
    for field in dataclasses.fields(ModelConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool"):
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "str": str}.get(field.type, field.type)
            choices = _CHOICES.get(field.name)
            metavar = "|".join(choices) if choices else field.name.upper()
            group.add_argument(flag, dest=field.name, type=kind, choices=choices, metavar=metavar)


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    base = from_name(args.preset) if args.preset else ModelConfig()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)}
    return base.replace(**{name: value for name, value in changes.items() if value is not None})


def describe(cfg: ModelConfig) -> str:
    heads = f"{cfg.n_heads}x{cfg.d_head}"
    return f"{cfg.model} ({cfg.pos}), d_model {cfg.d_model}, {cfg.n_layers} layers, heads {heads}"


def device_from_args(choice: str | None) -> str:
    """The device asked for, or CUDA when present; asking for CUDA without it is a usage error."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    return choice or ("cuda" if torch.cuda.is_available() else "cpu")


def check_expert_matmul_env() -> None:
    """``SWITCHBENCH_EXPERT_MATMUL``, when set, names an implementation this machine can run."""
    choice = os.environ.get(ENV_IMPL)
    if not choice:
        return
    if choice not in IMPLS:
        raise ValueError(f"{ENV_IMPL}={choice}: must be one of {', '.join(IMPLS)}")
    if choice == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"{ENV_IMPL}=triton: triton is not installed")
    if choice == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{ENV_IMPL}=triton needs a CUDA device, or TRITON_INTERPRET=1 (Triton's slow interpreter)"
        )


def format_table(rows: list[dict]) -> str:
    """A plain-text table: numbers right-aligned, integers with thousands separators."""
    cells = [{k: f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v for k, v in r.items()}
             for r in rows]  # fmt: skip
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
