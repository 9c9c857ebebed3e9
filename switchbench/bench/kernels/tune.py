"""``switchbench kernel-tune``: on this GPU, at the presets' expert-matmul and attention shapes, tune the Triton
kernels (the expert matmul's, flash attention's) and time every implementation of the expert matmul; keep both as
package data. Later runs on a GPU of the same name skip tuning (a first SwitchHead training step on a fresh H100 took
55 s, all of it autotuning), and ``--expert-matmul auto`` runs each shape bucket on the implementation measured
fastest there, ``--routing auto`` every router on the method measured fastest over the cases."""

import datetime
import json
import sys
from pathlib import Path

import torch

from switchbench.bench.command import DTYPES, add_json, device_from_args
from switchbench.bench.cost import scaling
from switchbench.bench.kernels.bench import (
    AttentionShape,
    add_sizes,
    attention_shapes,
    case_rows,
    cases,
    make_inputs,
    outputs,
    routing_share,
    routing_times,
)
from switchbench.core import schema
from switchbench.core.results import replace_atomically, writable_file
from switchbench.models.layers.window import make_window
from switchbench.ops import tuned as tuning
from switchbench.ops.expert_matmul import choice
from switchbench.ops.expert_matmul.choice import IMPLS

# The package's tables, beside the modules that read them as package data.
TABLE = Path(tuning.__file__).with_name("data") / tuning.FILE
AUTO_TABLE = Path(choice.__file__).with_name("data") / "expert_matmul_auto.json"
# What is timed: the PyTorch path waits on the host for its capacity, so a CUDA graph cannot capture it and auto
# never chooses it; its inputs and float64 check alone held about 2 GB of host tensors a case at 262M, batch 64
TIMED_IMPLS = tuple(impl for impl in IMPLS if impl != "torch")
# Batches whose shape buckets a training step meets: the paper's 64 on one GPU, 8 on each of eight, and between.
BATCHES = (8, 16, 32, 64)


# The windows the chain times on Triton's attention (its speed-practitioner-262m-triton step): dense's and
# SwitchHead's, with Transformer-XL's term; kernel-check compiles every family's
TUNED_ATTENTION = ("transformer", "switchhead")


def tuned_cases(size: str, batch: int) -> list:
    """kernel-bench's cases at ``size`` and those of the other roles of its speed group (its RoPE sibling, whose
    SwitchHead has other head widths): every expert-matmul shape the group's training steps run."""
    return [c for role in scaling.SIZES[size] for c in cases(role, batch)]


def tune(sizes: list[str], batches: list[int], dtype: torch.dtype) -> dict[str, dict[str, str]]:
    """The configuration measured fastest per kernel and shape key: the expert matmul's after a forward and backward
    of every case at every batch, flash attention's after one of each TUNED_ATTENTION window at the largest batch
    (its keys leave the batch out)."""
    with tuning.retuning():
        for size in sizes:
            for batch in batches:
                for case in tuned_cases(size, batch):
                    outputs(case, make_inputs(case, "cuda", dtype), "triton")
            for shape in attention_shapes(size):
                if shape.term and shape.model in TUNED_ATTENTION:
                    _flash_attention(max(batches), shape, dtype)
    table: dict[str, dict[str, str]] = {}
    for (kernel, key), label in sorted(tuning.chosen().items()):
        table.setdefault(kernel, {})[key] = label
    return table


def _flash_attention(batch: int, shape: AttentionShape, dtype: torch.dtype) -> None:
    """A forward and backward of Triton's flash attention over ``shape``'s causal window, as a training step runs
    it: every launch is measured and recorded."""
    from switchbench.ops.attention import flash

    t, S, width = shape.queries, shape.keys, shape.width
    q = torch.randn(batch, shape.heads, t, width, device="cuda", dtype=dtype)
    k, v = torch.randn(2, batch, shape.key_heads, S, width, device="cuda", dtype=dtype)
    pos = torch.randn(batch, shape.heads, t, S, device="cuda", dtype=dtype) if shape.term else None
    window = make_window(S - t, S - t, t, t, S // t - 1, causal=True, device="cuda")
    o, lse = flash.forward(q, k, v, pos, window.mask, width**-0.5)
    flash.backward(torch.randn_like(o), q, k, v, pos, window.mask, o, lse, width**-0.5)


def time_implementations(sizes: list[str], batches: list[int], dtype: torch.dtype) -> list[dict]:
    """kernel-bench's rows for the whole op of every implementation at every case and batch, each checked against
    the float64 loop before it was timed, and for the case's routings by every method, each with the shape bucket
    it falls in. Each call is timed replayed from a CUDA graph (``TIMED``): the table is keyed by the GPU's name, so
    it ranks the GPU's time, not the host's launches (which a practitioner's captured step does not pay, and which
    depend on the host); an implementation that waits on the host (the PyTorch path) is not timed (TIMED_IMPLS)."""
    return [
        r | {"bucket": choice.case_bucket(case, dtype)}
        for size in sizes
        for batch in batches
        for case in tuned_cases(size, batch)
        for r in case_rows(case, "cuda", dtype, list(TIMED_IMPLS), graphs=True)
    ]


TIMED = "replayed from CUDA graphs"  # how the table's times were taken


def fastest(rows: list[dict], earlier_routings: dict | None = None) -> dict:
    """The routing method whose routings summed over every case are least (:func:`fastest_routing`: this run's
    cases and ``earlier_routings``, the table's of other sizes), and per shape
    bucket the implementation whose forward+backward time summed over the bucket's cases is least, among those
    timed on every one of them (a wrong, skipped or OOM case rules an implementation out of its bucket); and those
    sums in ms. Each time counts the share of that routing the implementation reads (:func:`routing_share`):
    every expert computed needs no grouping of the slots, which a routed implementation pays for. A bucket no
    implementation covers gets no entry: auto falls back there."""
    routing = fastest_routing(rows, earlier_routings)
    return routing | fastest_implementations(rows, routing.get("routing"))


def fastest_routing(rows: list[dict], earlier: dict | None = None) -> dict:
    """``routing``: the method whose timed routings (top-k and grouping, and top-k alone: each case's, once) sum to
    least, among the methods timed on all of them; ``routing_ms``: those sums; ``routing_case_ms``: each case's
    times, over which they are summed, this run's beside ``earlier``'s (a table's, of other sizes: a run per size
    ranks the routings of every size). Empty where nothing was routed."""
    cases = {case: dict(times) for case, times in (earlier or {}).items()}  # the table read stays as it was
    for r in rows:
        if r["view"] == "routing" and r["pass"] == "forward" and "ms" in r:  # no backward
            cases.setdefault(f"{r['case']} | {r['shape_tokens']} | {r['routing']}", {})[r["method"]] = r["ms"]
    everywhere = set.intersection(*(set(times) for times in cases.values())) if cases else set()
    ms = {method: sum(times[method] for times in cases.values()) for method in sorted(everywhere)}
    return {"routing": min(ms, key=ms.get), "routing_ms": ms, "routing_case_ms": cases} if ms else {}


def fastest_implementations(rows: list[dict], routing: str | None) -> dict[str, dict]:
    """:func:`fastest`'s per-bucket choice, each time with its share of routing by ``routing`` (None: the method in
    force)."""
    routings = routing_times(rows, routing)
    cases_of: dict[str, set] = {}
    total: dict[str, dict[str, float]] = {}
    timed: dict[tuple[str, str], set] = {}
    for r in rows:
        if r["pass"] != "forward+backward" or r["view"] != "op":
            continue
        case = r["case"], r["shape_tokens"]  # a case at two batches may fall in one bucket: two cases
        cases_of.setdefault(r["bucket"], set()).add(case)
        share = routing_share(routings, r) if "ms" in r else None
        if share is not None:
            total.setdefault(r["bucket"], {}).setdefault(r["impl"], 0.0)
            total[r["bucket"]][r["impl"]] += r["ms"] + share
            timed.setdefault((r["bucket"], r["impl"]), set()).add(case)
    ms = {
        b: {impl: t for impl, t in sums.items() if timed[b, impl] == cases_of[b]} for b, sums in total.items()
    }
    return {
        "choices": {b: min(sums, key=sums.get) for b, sums in sorted(ms.items()) if sums},
        "ms": {b: sums for b, sums in sorted(ms.items()) if sums},
    }


def merged(existing: dict, gpu: str, fields: dict) -> dict:
    """``existing`` with ``fields`` merged into this GPU's table, entry by entry (other GPUs' tables kept): a run
    over some sizes, or one stopped before it timed anything, replaces what it measured and keeps the rest."""
    import triton  # optional: only GPU machines have it

    table = next((t for t in existing.get("tables", []) if t["device"] == gpu), {})
    table = _deep_merged(table, fields) | {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "written": datetime.date.today().isoformat(),
    }
    others = [t for t in existing.get("tables", []) if t["device"] != gpu]
    return existing | {"tables": [*others, table]}


def _deep_merged(old: dict, new: dict) -> dict:
    """``old`` updated by ``new``: nested dictionaries merged key by key, anything else replaced."""
    out = dict(old)
    for key, value in new.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _deep_merged(out[key], value) if both else value
    return out


def register(commands) -> None:
    parser = commands.add_parser(
        "kernel-tune",
        help="tune the Triton kernels and time every expert matmul on this GPU; keep the choices",
    )
    add_sizes(parser)
    parser.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=list(BATCHES),
        help="sequences a step (default: %(default)s)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="default: %(default)s")
    parser.add_argument(
        "--out",
        default=TABLE,
        help="the Triton configurations' table to update (default: the package's)",
    )
    parser.add_argument(
        "--auto-out", default=AUTO_TABLE, help="auto's table to update (default: the package's)"
    )
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> int:
    if device_from_args(None) != "cuda":
        raise ValueError("kernel-tune autotunes on a CUDA GPU; there is none here")
    if any(b < 1 for b in args.batches):
        raise ValueError(f"batches must be >= 1; got {args.batches}")
    out, auto_out = writable_file(args.out), writable_file(args.auto_out, "--auto-out")
    if out.resolve() == auto_out.resolve():  # the second write would drop the first's configurations
        raise ValueError(f"--out and --auto-out both name {out}: give each table its own file")
    tables = {path: read_tables(path) for path in (out, auto_out)}  # a damaged one, named before the tuning
    gpu, dtype = torch.cuda.get_device_name(), DTYPES[args.dtype]
    say = (lambda line: None) if args.json else print
    configs = tune(args.sizes, args.batches, dtype)
    _update(out, tables[out], gpu, {"configs": configs})
    say(f"{sum(map(len, configs.values()))} tuned configurations for {gpu} written to {out}")
    rows = time_implementations(args.sizes, args.batches, dtype)
    earlier = next((t for t in tables[auto_out].get("tables", []) if t["device"] == gpu), {})
    auto = fastest(rows, earlier.get("routing_case_ms"))
    if "routing_ms" in auto:  # summed over every size's cases: it replaces the earlier sums whole
        earlier.pop("routing_ms", None)
    _update(auto_out, tables[auto_out], gpu, auto | {"timed": TIMED})
    say(
        f"the fastest expert matmul of {len(auto['choices'])} shape buckets for {gpu}, and the fastest routing "
        f"({auto.get('routing', 'none timed')}), written to {auto_out}"
    )
    if args.json:  # what was written to the two tables for this GPU, and where
        payload = {"device": gpu, "dtype": args.dtype, "configs": configs, "auto": auto | {"timed": TIMED}}
        print(json.dumps(payload | {"out": str(out), "auto_out": str(auto_out)}, indent=2))
    # left out of their buckets: said once per implementation and case (each pass and batch has a row)
    wrong = {(r["impl"], r["case"]): r["error"] for r in rows if r["status"] == "wrong"}
    for (impl, case), error in wrong.items():
        print(f"switchbench kernel-tune: {impl} on {case} is wrong: {error}", file=sys.stderr)
    return 1 if wrong else 0


def read_tables(path: Path) -> dict:
    """The tables file at ``path`` ({} where there is none): an object whose "tables" each name their device."""
    if not path.exists():
        return {}
    existing = schema.check_fields(
        path, schema.read_json(path, "table file"), {"tables": schema.LIST}, "the file"
    )
    for i, table in enumerate(existing["tables"]):
        schema.check_fields(path, table, {"device": schema.TEXT}, f"table {i}")
    return existing


def _update(path: Path, existing: dict, gpu: str, fields: dict) -> None:
    replace_atomically(
        path, lambda tmp: tmp.write_text(json.dumps(merged(existing, gpu, fields), indent=2) + "\n")
    )
