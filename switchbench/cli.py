"""The ``switchbench`` command line: it only collects the commands, each declared beside what it runs."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from switchbench import main_job
from switchbench.analysis import analyze, train
from switchbench.bench import gate, kernels, params, scaling, speed, tables
from switchbench.bench.command import DTYPES, check_expert_matmul_env, format_table, slug
from switchbench.bench.published import WALLCLOCK
from switchbench.bench.results import read_csv, save_run, writable_file, writable_folder
from switchbench.models.presets import PRESETS
from switchbench.reports import report

COMMANDS = (params, tables, scaling, kernels, train, analyze, report, main_job)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_expert_matmul_env()
        return args.run(args) or 0
    except ValueError as error:
        print(f"switchbench {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # files are written whole or not at all: nothing to clean up
        print(f"switchbench {args.command}: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    _register_speed(commands)
    _register_check(commands)
    return parser


def _register_speed(commands) -> None:
    speed = commands.add_parser("speed", help="wall-clock and peak memory, interleaved, ratios to dense")
    speed.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    speed.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")
    speed.add_argument(
        "--batch", type=int, help="sequences per step, over all processes (default 64 GPU, 2 CPU)"
    )
    speed.add_argument(
        "--groups", nargs="+", help="preset groups (default: 47M and 262M on a GPU, tiny on CPU)"
    )
    speed.add_argument("--presets", nargs="+", help="one custom group: the first is the baseline")
    speed.add_argument("--scopes", nargs="+", choices=["model", "layer"], default=["model", "layer"])
    speed.add_argument("--rounds", type=int, default=20, help="timed rounds (after warm-up)")
    speed.add_argument("--warmup", type=int, default=3)
    speed.add_argument("--quick", action="store_true", help="the CI gate: 47M attention layers on the CPU")
    speed.add_argument("--out", default="results/speed", help="results go to OUT/<device>/")
    speed.add_argument("--json", action="store_true", help="print JSON instead of a table")
    speed.set_defaults(run=run_speed)


def _register_check(commands) -> None:
    check = commands.add_parser("check", help="exit 1 when a run's ratios are worse than the baseline's")
    check.add_argument("run_file", metavar="RUN", help="a speed run's JSON, or a folder (its newest run)")
    check.add_argument("--baseline", required=True, help="e.g. results/baselines/cpu.json")
    check.add_argument("--write", action="store_true", help="write RUN's ratios as the new baseline instead")
    check.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check.set_defaults(run=run_check)


def run_speed(args) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    writable_folder(Path(args.out))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    batch = args.batch if args.batch is not None else 4 if args.quick else 64 if device == "cuda" else 2
    if batch < world or batch % world:
        raise ValueError(f"batch must be a positive multiple of the {world} processes; got {batch}")
    if args.rounds < 1 or args.warmup < 0:
        raise ValueError("rounds must be >= 1 and warmup >= 0")
    if args.quick:
        groups, scopes = {"gate": speed.GATE_LAYERS}, ("layer",)
    elif args.presets:
        unknown = [p for p in args.presets if p not in PRESETS]
        if unknown:
            raise ValueError(f"unknown presets: {', '.join(unknown)}")
        groups, scopes = {"custom": tuple(args.presets)}, tuple(args.scopes)
    else:
        names = args.groups or (speed.GPU_GROUPS if device == "cuda" else speed.CPU_GROUPS)
        unknown = [g for g in names if g not in speed.GROUPS]
        if unknown:
            raise ValueError(f"unknown groups {', '.join(unknown)}; known: {', '.join(speed.GROUPS)}")
        groups, scopes = {g: speed.GROUPS[g] for g in names}, tuple(args.scopes)
    dtype = speed.DTYPES[dtype_name]
    rows = speed.run(groups, scopes, device, dtype, batch // world, args.rounds, args.warmup, ddp=world > 1)
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank != 0:
        return
    metadata = speed.describe(rows, device, dtype_name, batch=batch, processes=world, rounds=args.rounds,
                              warmup=args.warmup, groups={g: list(p) for g, p in groups.items()})  # fmt: skip
    peak = metadata["matmul_peak_tflops"]
    folder = Path(args.out) / slug(metadata["device"])
    path = save_run(folder, f"{dtype_name}-b{batch}" + ("-quick" if args.quick else ""), metadata, rows)
    if args.json:
        print(json.dumps({"metadata": metadata, "rows": rows, "saved": str(path)}, indent=2))
        return
    print(f"{metadata['device']}, {dtype_name}, batch {batch}, {world} process(es); ratios are medians of paired "
          f"ratios over {args.rounds} interleaved rounds; matmul peak {peak:.3g} TFLOP/s (measured)")  # fmt: skip
    print(format_table([_speed_row(r) for r in rows if r["scope"] != "count"]))
    print("\nPaper Table 5 (whole training steps):")
    print(format_table(_published_wallclock()))
    print(f"saved {path}")


def _speed_row(r: dict) -> dict:
    memory = r.get("memory_bytes")
    return {
        "group": r["group"],
        "preset": r["preset"],
        "scope": r["scope"],
        "what": r["what"],
        "ms": f"{r['ms']:.2f}" if "ms" in r else r["status"],
        "rel. time": f"{r['ratio_time']:.2f}" if "ratio_time" in r else "",
        "memory": "" if memory is None else f"{memory / 2**20:,.1f} MiB",
        "rel. memory": f"{r['ratio_memory']:.2f}" if "ratio_memory" in r else "",
        "TFLOP/s": f"{r['tflops']:.3g}" if "tflops" in r else "",
        "of peak": f"{100 * r['fraction_of_matmul_peak']:.0f}%" if "fraction_of_matmul_peak" in r else "",
    }


def _published_wallclock() -> list[dict]:
    return [
        {"size": r["size"], "model": r["model"], "heads": r["n_heads_active"], "ms/iter": r["ms_per_iter"],
         "rel. time": r["rel_time"], "GPU memory": f"{r['gpu_mem_gb']}G", "rel. memory": r["rel_mem"],
         "GPUs": f"{r['n_gpus']}x {r['gpu']}"}
        for r in read_csv(WALLCLOCK).to_dict("records")
    ]  # fmt: skip


def run_check(args) -> int:
    if args.write:
        writable_file(Path(args.baseline), "--baseline")
    run = gate.load_run(Path(args.run_file))
    if args.write:
        print(f"wrote {gate.write_baseline(run, Path(args.baseline))}")
        return 0
    baseline = gate.load_baseline(Path(args.baseline))
    problems = gate.check(run, baseline)
    if args.json:
        print(
            json.dumps(
                {"baseline": args.baseline, "checked": len(baseline["ratios"]), "problems": problems},
                indent=2,
            )
        )
        return 1 if problems else 0
    for line in problems:
        print(f"REGRESSION {line}")
    print(f"{len(baseline['ratios'])} ratios checked against {args.baseline}: "
          f"{'FAIL' if problems else 'ok'}")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
