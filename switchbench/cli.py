"""The ``switchbench`` command line."""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from switchbench.models.config import MOA_GATINGS, MODELS, POSITIONS, ModelConfig
from switchbench.models.presets import PRESETS, from_name

from .bench.kernels import SIZES
from .bench.params import parameter_counts

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except ValueError as error:
        print(f"switchbench {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    presets = commands.add_parser("presets", help="the named configurations and their key hyperparameters")
    _add_json(presets)
    presets.set_defaults(run=run_presets)

    params = commands.add_parser("params", help="parameter counts of a preset or of any configuration")
    add_config_args(params)
    _add_json(params)
    params.set_defaults(run=run_params)

    sweep = commands.add_parser("sweep", help="MACs and memory against context length, 128 to 16384 tokens")
    sweep.add_argument("--out", default="results/tables", help="folder for the CSV and the plot")
    _add_json(sweep)
    sweep.set_defaults(run=run_sweep)

    kernels = commands.add_parser("kernel-bench", help="expert-matmul throughput against one dense matmul")
    kernels.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    kernels.add_argument("--batch", type=int, help="sequences (default: 64 on a GPU, 1 on the CPU)")
    kernels.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    kernels.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    kernels.add_argument("--out", default="results/kernels", help="folder for the JSON and CSV results")
    _add_json(kernels)
    kernels.set_defaults(run=run_kernel_bench)

    count = commands.add_parser("count", help="MACs and memory of one attention layer, every view")
    add_config_args(count)
    _add_json(count)
    count.set_defaults(run=run_count)

    tables = commands.add_parser("tables", help="regenerate the paper's Tables 1, 2, 3 and 7 cell by cell")
    tables.add_argument("--out", default="results/tables", help="folder for CSV, Markdown and LaTeX")
    _add_json(tables)
    tables.set_defaults(run=run_tables)

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
    _add_json(speed)
    speed.set_defaults(run=run_speed)

    gate = commands.add_parser("check", help="exit 1 when a run's ratios are worse than the baseline's")
    gate.add_argument("run_file", metavar="RUN", help="a speed run's JSON, or a folder (its newest run)")
    gate.add_argument("--baseline", required=True, help="e.g. results/baselines/cpu.json")
    gate.add_argument("--write", action="store_true", help="write RUN's ratios as the new baseline instead")
    _add_json(gate)
    gate.set_defaults(run=run_check)

    train = commands.add_parser("train", help="train a small model for the routing analysis (CPU by default)")
    train.add_argument("--task", choices=["listops", "lm"], default="listops")
    train.add_argument("--model", choices=["dense", "switchhead", "moa", "switchall"], default="switchhead")
    train.add_argument("--preset", help="default: listops-<model>-h<H> for ListOps, tiny-<model> for LM")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch", type=int, default=32)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-every", type=int, default=100)
    train.add_argument("--text", help="LM: a text file instead of the embedded default")
    train.add_argument("--hf-dataset", help="LM: a Hugging Face dataset saved on disk (save_to_disk)")
    train.add_argument("--out", help="run folder (default: runs/<task>-<preset>)")
    train.add_argument("--resume", action="store_true", help="continue from the run folder's checkpoint")
    train.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    _add_json(train)
    train.set_defaults(run=run_train)

    analyze = commands.add_parser(
        "analyze", help="attention maxima, expert selections and routing statistics"
    )
    analyze.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT")
    source = analyze.add_mutually_exclusive_group()
    source.add_argument("--input", help="text to analyse (ListOps tokens, or any text for an LM)")
    source.add_argument(
        "--example", type=int, help="ListOps: which validation example (default: the longest)"
    )
    analyze.add_argument("--out", help="default: results/analysis/<first run>")
    _add_json(analyze)
    analyze.set_defaults(run=run_analyze)

    report = commands.add_parser("report", help="one self-contained HTML report of everything measured")
    report.add_argument("--results", default="results", help="the results folder to report on")
    report.add_argument("--out", default="results/report.html")
    report.set_defaults(run=run_report)

    everything = commands.add_parser(
        "all", help="the main job: tables, sweep, speed, training, analysis, report"
    )
    everything.add_argument("--quick", action="store_true", help="a few minutes on a 2-core CPU")
    everything.add_argument("--results", default="results", help="where results and the report go")
    everything.add_argument("--runs", default="runs", help="where the analysis models are trained")
    _add_json(everything)
    everything.set_defaults(run=run_all)
    return parser


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


_CHOICES = {"model": MODELS, "pos": POSITIONS, "moa_gating": MOA_GATINGS}


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


def run_presets(args) -> None:
    rows = [_preset_row(name, cfg) for name, cfg in PRESETS.items()]
    _emit(rows, args.json)


def run_params(args) -> None:
    cfg = config_from_args(args)
    counts = parameter_counts(cfg)
    if args.json:
        print(json.dumps({"preset": args.preset, "config": cfg.to_dict(), **counts}, indent=2))
        return
    per_layer = counts["per_layer"]
    rows = [
        {"what": "total", "parameters": counts["total"]},
        {"what": "embedding", "parameters": counts["embedding"]},
        {"what": "output head", "parameters": counts["head"]},
        {"what": f"per layer (x{counts['layers']}): attention", "parameters": per_layer["attention"]},
        {"what": "per layer: MLP", "parameters": per_layer["mlp"]},
        {"what": "per layer: attention + MLP", "parameters": per_layer["attention_plus_mlp"]},
        {"what": "per layer: LayerNorms", "parameters": per_layer["layer_norms"]},
        {"what": "per layer: XL biases u, v and logit scale", "parameters": per_layer["xl_bias_and_scale"]},
    ]
    print(f"{args.preset or 'custom'}: {_describe(cfg)}")
    print(format_table(rows))


def run_count(args) -> None:
    from .bench import tables
    from .bench.measure import cost_views

    cfg = config_from_args(args)
    views = cost_views(cfg)
    published = [r for r in tables.published_rows() if PRESETS.get(r.preset) == cfg]
    if args.json:
        rows = [{"table": r.table, "preset": r.preset, "macs": r.macs, "mem": r.mem} for r in published]
        print(json.dumps({"config": cfg.to_dict(), "published": rows, **views}, indent=2))
        return
    names = {
        "paper": "paper's convention (its table script)",
        "printed_eq": "paper's printed equations",
        "exact": "exact, this implementation",
        "fvcore": "measured: fvcore",
        "flop_counter": "measured: FlopCounterMode / 2",
        "saved_floats": "measured: saved-tensor hooks",
    }
    rows = [{"view": f"published, Table {r.table} ({r.preset})", "MACs": r.macs, "memory (floats)": r.mem}
            for r in published]  # fmt: skip
    for key, label in names.items():
        macs, mem = views.get(f"macs_{key}"), views.get(f"mem_{key}")
        rows.append({"view": label, "MACs": _count(macs), "memory (floats)": _count(mem)})
    print(f"{args.preset or 'custom'}: {_describe(cfg)}; one attention layer, one sequence of T = {cfg.T}, "
          f"C = {1 + cfg.context_blocks}, forward")  # fmt: skip
    print(format_table(rows))


def _count(value) -> str:
    return "-" if value is None else f"{value:,}"


def run_tables(args) -> None:
    from .bench import tables

    built = tables.all_tables()
    written = tables.write_tables(Path(args.out), built)
    summary = []
    for t in tables.TABLES:
        rows = built[f"table{t}"]
        summary += [
            {
                "table": t,
                "preset": r["preset"],
                "MACs published": r["macs_published"],
                "MACs paper": r["macs_paper_printed"],
                "mem published": r["mem_published"],
                "mem paper": r["mem_paper_printed"],
                "MACs vs dense": f"{100 * r['macs_vs_dense']:.1f}%",
                "mem vs dense": f"{100 * r['mem_vs_dense']:.1f}%",
                "reproduced": r["reproduced"],
            }
            for r in rows
        ]
    if args.json:
        print(json.dumps({"rows": summary, "written": [str(p) for p in written]}, indent=2))
        return
    print(format_table(summary))
    print(f"wrote {len(written)} files under {args.out}")


def run_sweep(args) -> None:
    from .bench import scaling

    rows = scaling.sweep()
    written = scaling.write_sweep(Path(args.out), rows)
    if args.json:
        print(json.dumps({"rows": rows, "written": [str(p) for p in written]}, indent=2))
        return
    summary = [
        {
            "size": r["size"],
            "model": r["model"],
            "T where T² MACs = half": f"{r['macs_crossover_T']:,.0f}",
            "T where T² memory = half": f"{r['mem_crossover_T']:,.0f}",
            "MACs at 16384": f"{r['macs']:.3g}",
            "memory at 16384": f"{r['mem']:.3g}",
        }
        for r in rows
        if r["T"] == scaling.LENGTHS[-1]
    ]
    print(format_table(summary))
    print(f"wrote {', '.join(str(p) for p in written)}")


def run_speed(args) -> None:
    import os

    import torch

    from .bench import speed
    from .bench.results import save_run

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
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
    folder = Path(args.out) / _slug(metadata["device"])
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
    import csv

    from .bench.published import WALLCLOCK

    with WALLCLOCK.open(newline="") as f:
        return [
            {"size": r["size"], "model": r["model"], "heads": r["n_heads_active"], "ms/iter": r["ms_per_iter"],
             "rel. time": r["rel_time"], "GPU memory": f"{r['gpu_mem_gb']}G", "rel. memory": r["rel_mem"],
             "GPUs": f"{r['n_gpus']}x {r['gpu']}"}
            for r in csv.DictReader(f)
        ]  # fmt: skip


def run_check(args) -> int:
    from .bench import gate

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


def run_train(args) -> None:
    from switchbench.analysis.train import TrainConfig, default_preset, train

    preset = args.preset or default_preset(args.task, args.model)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(args.task, preset, args.steps, args.batch, args.lr, seed=args.seed, eval_every=args.eval_every,
                      text=args.text, hf_dataset=args.hf_dataset, device=device)  # fmt: skip
    out = Path(args.out or f"runs/{args.task}-{preset}")
    result = train(cfg, out, resume=args.resume, progress=not args.json)
    if args.json:
        print(json.dumps({"run": str(out), "preset": preset, **result}, indent=2))
        return
    summary = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
    print(f"{preset}: {summary}\ncheckpoint {out / 'checkpoint.pt'}, log {out / 'log.csv'}")


def run_analyze(args) -> None:
    from switchbench.analysis.analyze import analyze

    first = Path(args.checkpoints[0])
    out = Path(
        args.out
        or Path("results/analysis") / (first.parent.name if first.name == "checkpoint.pt" else first.stem)
    )
    written = analyze([Path(p) for p in args.checkpoints], out, args.input, args.example)
    if args.json:
        print(json.dumps({"out": str(out), "written": [str(p) for p in written]}, indent=2))
        return
    print(f"wrote {len(written)} files under {out}")


def run_kernel_bench(args) -> None:
    import torch

    from .bench import kernels
    from .bench.environment import environment
    from .bench.results import save_run

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    batch = args.batch if args.batch is not None else 64 if device == "cuda" else 1
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    dtype = getattr(torch, DTYPES[args.dtype])
    # Off a GPU, Triton runs in its interpreter: correct but not worth timing.
    impls = ["triton", "torch", "dense"] if device == "cuda" else ["torch", "dense"]
    rows = kernels.run(args.sizes, batch, device, dtype, impls)
    metadata = environment(device) | {"dtype": args.dtype, "batch": batch, "sizes": args.sizes}
    label = f"{_slug(metadata['device'])}-{args.dtype}-b{batch}"
    path = save_run(Path(args.out), label, metadata, rows)
    if args.json:
        print(json.dumps({"metadata": metadata, "rows": rows, "saved": str(path)}, indent=2))
        return
    print(f"{metadata['device']}, {args.dtype}, batch {batch}; vs dense = dense-matmul time / this time")
    table = [
        {
            "case": r["case"],
            "pass": r["pass"],
            "impl": r["impl"],
            "ms": f"{r['ms']:.3f}",
            "TFLOP/s": f"{r['tflops']:.3g}",
            "vs dense": f"{100 * r['vs_dense']:.0f}%",
        }
        for r in rows
    ]
    print(format_table(table))
    print(f"saved {path} and its .csv")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def run_report(args) -> None:
    from switchbench.reports.report import write_report

    if not Path(args.results).is_dir():
        raise ValueError(f"no results folder at {args.results}")
    print(f"wrote {write_report(Path(args.results), Path(args.out), _report_environment())}")


def _report_environment() -> dict:
    import torch

    from .bench.environment import environment

    env = environment("cuda" if torch.cuda.is_available() else "cpu")
    return {key: value for key, value in env.items() if value is not None}


def run_all(args) -> None:
    """Tables, cost sweep, speed on this device, the analysis pair trained and analysed, and the report."""
    import torch

    from switchbench.analysis.analyze import analyze
    from switchbench.analysis.train import TrainConfig, default_preset, train
    from switchbench.reports.report import write_report

    from .bench import scaling, speed, tables
    from .bench.results import save_run

    results, runs, log = Path(args.results), Path(args.runs), {}
    step = _stepper(args.json)
    with step("tables"):
        log["tables"] = [str(p) for p in tables.write_tables(results / "tables", tables.all_tables())]
    with step("cost sweep"):
        log["sweep"] = [str(p) for p in scaling.write_sweep(results / "tables", scaling.sweep())]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with step(f"speed on {device}"):
        if device == "cuda":
            groups = (
                {"47m": speed.GROUPS["47m"]} if args.quick else {g: speed.GROUPS[g] for g in speed.GPU_GROUPS}
            )
            scopes, dtype, batch = ("model", "layer"), "bf16", 16 if args.quick else 64
        else:
            groups, scopes, dtype, batch = {"gate": speed.GATE_LAYERS}, ("layer",), "fp32", 4
        rounds = 10 if args.quick else 20
        rows = speed.run(groups, scopes, device, speed.DTYPES[dtype], batch, rounds, 2)
        metadata = speed.describe(rows, device, dtype, batch=batch, processes=1, rounds=rounds, warmup=2)
        log["speed"] = str(
            save_run(results / "speed" / _slug(metadata["device"]), f"{dtype}-all", metadata, rows)
        )
    steps = 150 if args.quick else 1000
    presets = [default_preset("listops", model) for model in ("dense", "switchhead")]
    checkpoints = []
    for preset in presets:
        with step(f"training {preset} for {steps} steps"):
            cfg = TrainConfig(
                "listops", preset, steps=steps, eval_every=50 if args.quick else 100, device=device
            )
            log[preset] = train(cfg, runs / f"listops-{preset}", progress=not args.json)
            checkpoints.append(runs / f"listops-{preset}" / "checkpoint.pt")
    with step("routing analysis"):
        log["analysis"] = len(
            analyze(checkpoints, results / "analysis" / "listops", sample=64 if args.quick else 256)
        )
    with step("report"):
        report = write_report(results, results / "report.html", _report_environment())
    if args.json:
        print(json.dumps(log | {"report": str(report)}, indent=2))
        return
    for preset in presets:
        print(f"{preset}: validation accuracy {log[preset]['val_accuracy']:.1%} "
              f"(majority class {log[preset]['majority_class']:.1%})")  # fmt: skip
    print(f"report: {report}")


def _stepper(quiet: bool):
    import contextlib
    import time

    @contextlib.contextmanager
    def step(name: str):
        start = time.perf_counter()
        if not quiet:
            print(f"== {name}", flush=True)
        yield
        if not quiet:
            print(f"   done in {time.perf_counter() - start:.0f} s", flush=True)

    return step


def _preset_row(name: str, cfg: ModelConfig) -> dict:
    counts = parameter_counts(cfg)
    return {
        "preset": name,
        "model": cfg.model,
        "pos": cfg.pos,
        "d_model": cfg.d_model,
        "layers": cfg.n_layers,
        "heads": f"{cfg.n_heads}x{cfg.d_head}",
        "experts": _experts(cfg),
        "mlp": f"{cfg.mlp_experts}x{cfg.mlp_expert_size} K{cfg.mlp_k}"
        if cfg.mlp == "sigma_moe"
        else cfg.d_ff,
        "T": cfg.T,
        "C": 1 + cfg.context_blocks,
        "params": counts["total"],
        "layer_params": counts["per_layer"]["attention_plus_mlp"],
    }


def _experts(cfg: ModelConfig) -> str:
    if cfg.attention == "switchhead":
        return f"E{cfg.n_experts} k{cfg.k} {cfg.experts}" + (" shared" if cfg.shared_selection else "")
    if cfg.attention == "moa":
        return f"E{cfg.n_experts} {cfg.moa_gating}"
    return "-"


def _describe(cfg: ModelConfig) -> str:
    heads = f"{cfg.n_heads}x{cfg.d_head}"
    return f"{cfg.model} ({cfg.pos}), d_model {cfg.d_model}, {cfg.n_layers} layers, heads {heads}"


def _emit(rows: list[dict], as_json: bool) -> None:
    print(json.dumps(rows, indent=2) if as_json else format_table(rows))


def format_table(rows: list[dict]) -> str:
    """Plain-text table; integers with thousands separators, right-aligned."""
    cells = [[f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()] for row in rows]
    header = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    numeric = [isinstance(v, int) for v in rows[0].values()]

    def line(values):
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


if __name__ == "__main__":
    sys.exit(main())
