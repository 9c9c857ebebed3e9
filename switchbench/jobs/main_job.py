"""``switchbench all``: the main job, a declared sequence of steps over the embedded default.

Tables and the cost sweep, speed and decode on this device, the ListOps analysis pair and a byte-level text pair
trained and analysed, the report.
A quick run writes to folders of its own (``results-quick/``, ``runs-quick/``, ignored by git), so it never
replaces the committed results with shorter runs; a full run refreshes ``results/``.
"""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from switchbench.analysis.analyze import analyze
from switchbench.bench.command import (
    DTYPES,
    add_json,
    add_kernel_choices,
    device_from_args,
    kernel_metadata,
    slug,
)
from switchbench.bench.cost import scaling, tables
from switchbench.bench.cost.measure import total_memory
from switchbench.bench.inference import decode
from switchbench.bench.timing import speed
from switchbench.bench.timing.timer import cpu_threads, intra_op_threads
from switchbench.core.environment import commit
from switchbench.core.results import save_run, writable_folder
from switchbench.reports.report import replaceable, report_environment, write_report
from switchbench.train import checkpoint
from switchbench.train.run import TrainConfig, default_preset, run_name, train

# The analysis pair, then a dense model of another seed: the scale for how alike two attention patterns can be.
RUNS = (("dense", 0), ("switchhead", 0), ("dense", 1))
# Beside it a byte-level text pair, whose token preferences anyone can read (spaces, punctuation, capitals, line
# ends); the folder of each task's analysis under results/analysis/.
TASKS = {"listops": RUNS, "lm": (("dense", 0), ("switchhead", 0))}
FOLDERS = {"listops": "listops", "lm": "text"}


@dataclass(frozen=True)
class Step:
    """A step of the main job; ``run(args, results folder, runs folder)`` returns what the JSON log keeps.
    ``args.provenance`` (quick or not, training steps, the commit when the job started) goes into the metadata
    of every file the step writes."""

    name: str
    run: Callable[[argparse.Namespace, Path, Path], object]


def _tables(args, results: Path, runs: Path) -> list[str]:
    return [str(p) for p in tables.write_tables(results / "tables", tables.all_tables(), args.provenance)]


def _sweep(args, results: Path, runs: Path) -> list[str]:
    return [str(p) for p in scaling.write_sweep(results / "tables", scaling.sweep(), args.provenance)]


def _speed(args, results: Path, runs: Path) -> str:
    device = device_from_args(None)
    if device == "cuda":
        groups = (
            {"47m": speed.GROUPS["47m"]} if args.quick else {g: speed.GROUPS[g] for g in speed.GPU_GROUPS}
        )
        # the full job fits each group's batch to the card (the paper's per GPU, halved until it fits)
        scopes, dtype, batch = ("model", "layer"), "bf16", 16 if args.quick else None
    else:  # the gate's layers, timed as the gate times them
        groups, scopes, dtype, batch = {"gate": speed.GATE_LAYERS}, ("layer",), "fp32", 4
    threads, clock = (None, "wall") if device == "cuda" else (speed.GATE_THREADS, "thread")
    rounds = 10 if args.quick else 20
    with intra_op_threads(threads):
        rows = speed.run(groups, scopes, device, DTYPES[dtype], batch, rounds, 2, clock=clock)
        batches = {r["group"]: r["batch"] for r in rows if "batch" in r}
        metadata = (
            speed.describe(
                rows,
                device,
                dtype,
                batch=batch or "fitted per group",
                batches=batches,
                processes=1,
                rounds=rounds,
                warmup=2,
                threads=torch.get_num_threads(),
                clock=clock,
                compile="eager",
                **kernel_metadata(args.expert_matmul, device),
            )
            | args.provenance
        )
    return str(save_run(results / "speed" / slug(metadata["device"]), f"{dtype}-all", metadata, rows))


def _decode(args, results: Path, runs: Path) -> str:
    """The inference grid: on a GPU the 262M group's default grid; on the CPU the tiny groups, small, one thread."""
    device = device_from_args(None)
    gpu = device == "cuda"
    groups = decode.GPU_GROUPS if gpu else decode.CPU_GROUPS
    batches, contexts = decode.GRIDS[device]
    rounds = (3 if gpu else 5) if args.quick else (5 if gpu else 20)
    grid = decode.Grid(speed.preset_groups(None, groups), batches, contexts, rounds, 2, total_memory(device))
    with intra_op_threads(cpu_threads(device)):
        dtype = "bf16" if gpu else "fp32"
        return str(
            decode.measure(grid, device, dtype, results / "decode", args.expert_matmul, args.provenance)[2]
        )


def _train_config(args, task: str, model: str, seed: int) -> TrainConfig:
    preset = default_preset(task, model)
    full_listops = task == "listops" and not args.quick
    return TrainConfig(
        task,
        preset,
        steps=_steps(args)[task],
        batch=LISTOPS_BATCH if full_listops else 32,
        seed=seed,
        eval_every=50 if args.quick else (500 if task == "listops" else 100),
        stop_at=LISTOPS_TARGET if full_listops else None,
        device=device_from_args(None),
    )


def _trainer(task: str, model: str, seed: int) -> Callable:
    def step(args, results: Path, runs: Path) -> dict:
        cfg = _train_config(args, task, model, seed)
        # A full run continues the models it finds (the committed ListOps trio takes more CPU hours than any one
        # sitting has); a quick run trains afresh, so it always analyses models of the code it runs.
        with intra_op_threads(cpu_threads(cfg.device)):
            return train(
                cfg, runs / run_name(task, cfg.preset, seed), resume=not args.quick, progress=not args.json
            )

    return step


def _check_trained(args, runs: Path) -> None:
    """Before any step, the models already in ``runs`` that the job would train over: one of another model or
    task (a full run continues it, and would stop at its training step), or, for a quick run (which trains
    afresh), one trained for other steps: a full run's model pointed at by --runs, which it would replace."""
    for task, pairs in TASKS.items():
        for model, seed in pairs:
            cfg = _train_config(args, task, model, seed)
            saved = runs / run_name(task, cfg.preset, seed) / "checkpoint.pt"
            if not saved.exists():
                continue
            payload = checkpoint.load(saved)
            if payload["config"] != cfg.model_config.to_dict() or payload["task"] != task:
                raise ValueError(f"--runs: {saved} holds another model or task; give another --runs")
            steps = payload["train"].get("steps")
            if args.quick and steps != cfg.steps:
                raise ValueError(
                    f"--runs: {saved} was trained for {steps} steps, and a quick run would replace it; "
                    "give another --runs"
                )


def _run_names(task: str = "listops") -> list[str]:
    return [run_name(task, default_preset(task, model), seed) for model, seed in TASKS[task]]


def _analyser(task: str) -> Callable:
    def step(args, results: Path, runs: Path) -> int:
        sample = 64 if args.quick else 256  # ListOps sequences, or text chunks
        checkpoints = [runs / name / "checkpoint.pt" for name in _run_names(task)]
        out = results / "analysis" / FOLDERS[task]
        return len(analyze(checkpoints, out, sample=sample, provenance=args.provenance))

    return step


def _report(args, results: Path, runs: Path) -> str:
    return str(write_report(results, results / "report.html", report_environment() | args.provenance))


def _steps(args) -> dict[str, int]:
    """The step count each task's analysed models train to, under one cosine. The paper analyses trained models;
    the tiny text models' held-out bits per byte are lowest at about 1,500 steps of the embedded play and rise
    after (they memorise it)."""
    if args.quick:
        return {"listops": 100, "lm": 100}
    return {"listops": LISTOPS_STEPS, "lm": 1500}


# ListOps at batch 128 in batches of one length, on one thread of a 2-core CPU: about 0.17 s a step (dense) and
# 0.21 s (SwitchHead). Four warm restarts to 60,000 steps left the trio at 80 to 84%; under one cosine over
# 100,000 steps, stopped once three evaluations in a row reach the analysis' 85%, the committed trio got there at
# 41,500 (SwitchHead), 62,500 and 57,500 steps (dense), about 3 to 4 hours each over two sittings.
LISTOPS_STEPS = 100_000
# The validation accuracy the routing analysis needs (the paper's models reach about 95%)
LISTOPS_TARGET = 0.85
LISTOPS_BATCH = 128  # a full run's (quick: the default 32)

STEPS = (
    Step("tables", _tables),
    Step("cost sweep", _sweep),
    Step("speed", _speed),
    Step("decode", _decode),
    *(
        Step(f"training {name}", _trainer(task, model, seed))
        for task, pairs in TASKS.items()
        for name, (model, seed) in zip(_run_names(task), pairs, strict=True)
    ),
    *(Step(f"routing analysis, {FOLDERS[task]}", _analyser(task)) for task in TASKS),
    Step("report", _report),
)


def register(commands) -> None:
    parser = commands.add_parser("all", help="the main job: tables, sweep, speed, training, analysis, report")
    parser.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU")
    parser.add_argument(
        "--results", help="where results and the report go (default: results, or results-quick with --quick)"
    )
    parser.add_argument(
        "--runs", help="where the analysis models train (default: results/runs, or runs-quick with --quick)"
    )
    add_kernel_choices(parser)
    add_json(parser)
    parser.set_defaults(run=_run)


def _outcome(result: dict) -> str:
    """A trained model's last evaluation, in words."""
    if "val_accuracy" in result:
        return f"validation accuracy {result['val_accuracy']:.1%} (majority class {result['majority_class']:.1%})"
    return f"validation {result['val_bits_per_byte']:.3f} bits per byte"


def _provenance(args) -> dict:
    """What every file of the job says about it, recorded once before the first step writes: a commit read
    later would count the job's own results as changes to the checkout."""
    return {
        "job": "switchbench all" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "training_steps": _steps(args),
        "commit": commit(),
    }


def _run(args) -> None:
    own = "-quick" if args.quick else ""  # a quick run never replaces the results of a full one
    results = writable_folder(Path(args.results or f"results{own}"), "--results")
    # a full run's models are results too: committed, so the next sitting continues them
    runs = writable_folder(Path(args.runs or ("runs-quick" if args.quick else "results/runs")), "--runs")
    log = {}
    replaceable(results / "report.html", "--results")
    _check_trained(args, runs)
    args = argparse.Namespace(**vars(args), provenance=_provenance(args))
    for step in STEPS:
        start = time.perf_counter()
        if not args.json:
            print(f"== {step.name}", flush=True)
        log[step.name] = step.run(args, results, runs)
        if not args.json:
            print(f"   done in {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        print(json.dumps(log, indent=2))
        return
    for name in (name for task in TASKS for name in _run_names(task) if f"training {name}" in log):
        print(f"{name}: {_outcome(log[f'training {name}'])}")
    print(
        f"report: {log['report']} (all of this run's results are under {results}/, its models under {runs}/)"
    )
