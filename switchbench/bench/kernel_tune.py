"""``switchbench kernel-tune``: autotune the expert-matmul kernels at the presets' shapes on this GPU and keep the
choices as package data, so later runs on a GPU of the same name skip autotuning (a first SwitchHead training
step on a fresh H100 took 55 s, all of it autotuning)."""

import datetime
import json
from pathlib import Path

import torch

from .command import DTYPES, device_from_args
from .kernels import SIZES, cases, make_inputs, outputs
from .results import replace_atomically, writable_file

# The package's table (switchbench.models reads it as package data; tuned_configs.json there).
TABLE = Path(__file__).parents[1] / "models" / "data" / "tuned_configs.json"
# Batches whose shape buckets a training step meets: the paper's 64 on one GPU, 8 on each of eight, and between.
BATCHES = (8, 16, 32, 64)


def tune(sizes: list[str], batches: list[int], dtype: torch.dtype) -> dict[str, dict[str, str]]:
    """The autotuner's choice per kernel and shape key, after a forward and backward of every case."""
    from switchbench.models import expert_matmul_triton  # triton is optional: only GPU machines have it

    for size in sizes:
        for batch in batches:
            for case in cases(size, batch):
                outputs(case, make_inputs(case, "cuda", dtype), "triton")
    table: dict[str, dict[str, str]] = {}
    for (kernel, key), label in sorted(expert_matmul_triton.chosen().items()):
        table.setdefault(kernel, {})[key] = label
    return table


def merged(existing: dict, gpu: str, configs: dict) -> dict:
    """``existing`` with this GPU's table replaced by ``configs`` (other GPUs' tables kept)."""
    import triton  # optional: only GPU machines have it

    table = {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "written": datetime.date.today().isoformat(),
        "configs": configs,
    }
    others = [t for t in existing.get("tables", []) if t["device"] != gpu]
    return existing | {"tables": [*others, table]}


def register(commands) -> None:
    parser = commands.add_parser(
        "kernel-tune", help="autotune the Triton kernels on this GPU; keep the choices"
    )
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument(
        "--out", type=Path, default=TABLE, help="the table to update (default: the package's)"
    )
    parser.set_defaults(run=_run)


def _run(args) -> int:
    if device_from_args(None) != "cuda":
        raise ValueError("kernel-tune autotunes on a CUDA GPU; there is none here")
    if any(b < 1 for b in args.batches):
        raise ValueError(f"batches must be >= 1; got {args.batches}")
    out = writable_file(args.out)
    existing = json.loads(out.read_text()) if out.exists() else {}
    gpu = torch.cuda.get_device_name()
    configs = tune(args.sizes, args.batches, DTYPES[args.dtype])
    replace_atomically(
        out, lambda tmp: tmp.write_text(json.dumps(merged(existing, gpu, configs), indent=2) + "\n")
    )
    print(f"{sum(map(len, configs.values()))} tuned configurations for {gpu} written to {out}")
    return 0
