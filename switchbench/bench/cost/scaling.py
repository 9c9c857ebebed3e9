"""Cost against context length: where the T^2 attention terms take over from the projections.

The exact count of one attention layer is a quadratic a T^2 + b T (+ c, a few floats of a router's per-expert
statistics) in the chunk length T (C fixed): the T^2 terms are the attention maps (and the XL position scores), the
T terms the projections and routers. The sweep
evaluates it from 128 to 16384 tokens; the cross-over length b / a is where the quadratic terms are half.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from switchbench.bench.command import add_json, emit
from switchbench.bench.cost.accounting import exact_cost
from switchbench.core.environment import environment
from switchbench.core.results import csv_writer, new_figure, save_figure, writable_file, writable_folder
from switchbench.models import family as registry
from switchbench.models.config import ModelConfig
from switchbench.models.cost import Cost
from switchbench.models.presets import PRESETS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LENGTHS = tuple(2**i for i in range(7, 15))  # 128 .. 16384
# Per size, every family's XL and RoPE presets of that size (a family running another's attention, as SwitchAll
# runs SwitchHead's, adds nothing here)
SIZES = {"47m": ("47m", "45m-rope"), "262m": ("262m", "244m-rope")}


def _series(xl: str, rope: str) -> dict[str, str]:
    families = [f for f in registry.families() if f.attention_name in (None, "dense")]
    return {
        f"{f.label} {pos}": f.roles[role]
        for f in families
        for pos, role in (("XL", xl), ("RoPE", rope))
        if role in f.roles
    }


SERIES = {size: _series(*roles) for size, roles in SIZES.items()}


def quadratic(cfg: ModelConfig) -> tuple[Cost, Cost, Cost]:
    """(a, b, c) with cost(T) = a T^2 + b T + c, from the exact count at T = 2, 3 and 4 (C as configured); c is a
    few floats that do not grow with T (a router's per-expert statistics), 0 for most families. T = 1 is left out:
    one token lays out the heads' output without a copy."""
    f2, f3, f4 = (exact_cost(cfg.replace(T=T)) for T in (2, 3, 4))

    def fit(y2: int, y3: int, y4: int) -> tuple[int, int, int]:
        a = ((y4 - y3) - (y3 - y2)) // 2
        b = (y3 - y2) - 5 * a
        return a, b, y2 - 4 * a - 2 * b

    (am, bm, cm), (ak, bk, ck) = fit(f2.macs, f3.macs, f4.macs), fit(f2.mem, f3.mem, f4.mem)
    return Cost(am, ak), Cost(bm, bk), Cost(cm, ck)


def sweep() -> list[dict]:
    rows = []
    for size, series in SERIES.items():
        for label, preset in series.items():
            cfg = PRESETS[preset]
            a, b, _ = quadratic(cfg)
            for T in LENGTHS:
                cost = exact_cost(cfg.replace(T=T))
                rows.append(
                    {
                        "size": size,
                        "model": label,
                        "preset": preset,
                        "T": T,
                        "C": 1 + cfg.context_blocks,
                        "macs": cost.macs,
                        "mem": cost.mem,
                        "macs_quadratic_share": a.macs * T * T / cost.macs,
                        "mem_quadratic_share": a.mem * T * T / cost.mem,
                        "macs_crossover_T": b.macs / a.macs,
                        "mem_crossover_T": b.mem / a.mem,
                    }
                )
    return rows


def figure(rows: list[dict]) -> Figure:
    """MACs and memory against T, log-log, one panel per size and quantity; crossovers marked; one legend below
    the panels, outside the data (inside, the curves of the larger sizes ran under it)."""
    sizes = list(SERIES)
    fig = new_figure(figsize=(6 * len(sizes), 8.5), layout="constrained")
    axes = fig.subplots(2, len(sizes), squeeze=False)
    for col, size in enumerate(sizes):
        for row, (key, name, unit) in enumerate(
            (("macs", "compute", "MACs"), ("mem", "memory", "floats kept for backward"))
        ):
            ax = axes[row][col]
            for label in SERIES[size]:
                points = [r for r in rows if r["size"] == size and r["model"] == label]
                line = ax.plot(
                    [r["T"] for r in points], [r[key] for r in points], marker="o", ms=3, label=label
                )
                crossover = points[0][f"{key}_crossover_T"]
                if LENGTHS[0] <= crossover <= LENGTHS[-1]:
                    ax.axvline(crossover, color=line[0].get_color(), ls=":", lw=1)
            ax.set(xscale="log", yscale="log", xlabel="chunk length T (tokens)", ylabel=unit)
            ax.set_title(f"{size.upper()} presets: {name}")
            ax.grid(True, which="major", alpha=0.3)
    # One legend for every panel: the series are the same at every size
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles,
        names,
        loc="outside lower center",
        ncol=min(len(names), 5),
        fontsize=9,
        title="dotted: T where T² terms are half",
        title_fontsize=9,
    )
    fig.suptitle(
        "One attention layer, one sequence, forward pass (exact count); XL keeps C = 2 chunks, RoPE C = 1"
    )
    return fig


def write_sweep(folder: Path, rows: list[dict], provenance: dict | None = None) -> list[Path]:
    """The sweep's rows as CSV, their plot as PNG and SVG, and cost_scaling.json saying where and how (with
    ``provenance``, the main job's mode and starting commit), renamed into place together: a sweep stopped on the
    way leaves the earlier set whole, never a new CSV beside an old figure."""
    metadata = environment("cpu") | (provenance or {})  # read before writing: the commit, not a dirty one
    stem = folder / "cost_scaling"
    metadata |= {
        "command": "switchbench sweep",
        "count": "exact_cost of one attention layer, one sequence, forward",
        "files": [f"{stem.name}.{suffix}" for suffix in ("csv", "png", "svg")],
    }
    also = {
        stem.with_suffix(".csv"): csv_writer(rows),
        stem.with_suffix(".json"): lambda tmp: tmp.write_text(json.dumps(metadata, indent=2)),
    }
    return save_figure(figure(rows), stem, dpi=110, also=also)


def register(commands) -> None:
    parser = commands.add_parser("sweep", help="MACs and memory against context length, 128 to 16384 tokens")
    parser.add_argument(
        "--out", default="results/tables", help="folder for the CSV, JSON and the plot (default: %(default)s)"
    )
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> None:
    folder = writable_folder(Path(args.out))
    for suffix in ("csv", "png", "svg", "json"):  # a folder of the name failed at the rename, after the work
        writable_file(folder / f"cost_scaling.{suffix}")
    rows = sweep()
    written = write_sweep(Path(args.out), rows)
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
        if r["T"] == LENGTHS[-1]
    ]
    emit({"rows": rows, "written": [str(p) for p in written]}, args.json, summary)
    if not args.json:
        print(f"wrote {', '.join(str(p) for p in written)}")
