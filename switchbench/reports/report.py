"""One self-contained HTML report of everything under results/: images embedded, CSS inline, no request of any
kind; token strings and file contents are escaped (jinja2 autoescape).

The page is a summary (the paper's claims beside this suite's numbers), then one section per kind of result that
exists. A section is a name, a loader that reads its files from the results folder (None: nothing to show) and
its template ``sections/<name>.html.j2``. A run or analysis whose files cannot be read is left out with a note on
stderr naming it, and the rest of its section is shown; a section that cannot be read at all is left out the same way.
"""

import base64
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2
import markupsafe

from switchbench.bench.command import device_from_args
from switchbench.bench.inference import decode
from switchbench.bench.published import WALLCLOCK
from switchbench.bench.timing.speed import below_floor, scores_ratio
from switchbench.core.environment import describe_machine, environment
from switchbench.core.results import newest, read_csv, recorded, writable_file, write_atomic
from switchbench.core.schema import read_json, read_run, read_table
from switchbench.reports import labels, summary

UNREADABLE = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    RecursionError,
)  # malformed CSV or JSON, a missing field
STRONGEST = 12  # token preferences shown before the disclosure
TABLES = {
    "table1": "Table 1",
    "table2": "Table 2",
    "table3": "Table 3",
    "table7": "Table 7",
    "macmatched": "MAC-matched variants",
}


@dataclass(frozen=True)
class Section:
    name: str  # the anchor, and the template sections/<name>.html.j2
    title: str  # in the navigation bar
    load: Callable[[Path], object]  # the results folder -> what the template shows, or None


def _rows(path, kind: str | None = None) -> list[dict]:
    """A results CSV as rows (an empty cell is None), checked as ``kind`` (see bench.schema) unless it is
    package data."""
    table = read_csv(path) if kind is None else read_table(path, kind)
    return table.astype(object).where(table.notna(), None).to_dict("records")


def _image(path: Path) -> str | None:
    """A PNG as a data URI."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode() if path.exists() else None


def _each(items, load: Callable, quiet: bool = False) -> list:
    """``load`` of each item (a run's file or an analysis folder) that can be read; each one that cannot is named on
    stderr (unless ``quiet``) and left out, so one broken file does not hide its neighbours."""
    loaded = []
    for item in items:
        try:
            loaded.append(load(item))
        except UNREADABLE as error:
            if not quiet:
                print(f"switchbench report: {item} left out: {_reason(error)}", file=sys.stderr)
    return loaded


def _reason(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _metadata(path: Path) -> dict:
    """A results folder's metadata.json (what made its files, where, from which commit), or {}."""
    if not path.exists():
        return {}
    metadata = read_json(path, "metadata file")
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: not a JSON object")
    return metadata


def _run(path: Path, kind: str) -> dict:
    run = read_run(path, kind)
    metadata, gpu = run.get("metadata", {}), "cuda" in run.get("metadata", {})
    return run | {
        "file": str(path),
        "gpu": gpu,
        "timing": labels.timing(metadata, gpu),
        "job": labels.job(metadata),
    }


def load_tables(results: Path) -> dict | None:
    folder = results / "tables"
    tables = {
        name: {"title": title, "rows": _rows(folder / f"{name}.csv", "table"), "csv": f"tables/{name}.csv"}
        for name, title in TABLES.items()
        if (folder / f"{name}.csv").exists()
    }
    if not tables:
        return None
    metadata = _metadata(folder / "metadata.json")
    return {"tables": tables, "metadata": metadata, "job": labels.job(metadata)}


def load_sweep(results: Path) -> dict | None:
    path = results / "tables" / "cost_scaling.csv"
    if not path.exists():
        return None
    rows = _rows(path, "sweep")
    first = list({(r["size"], r["model"]): r for r in reversed(rows)}.values())[::-1]  # one row per curve
    return {
        "image": _image(results / "tables" / "cost_scaling.png"),
        "rows": first,
        "csv": "tables/cost_scaling.csv",
    }


def load_speed(results: Path, quiet: bool = False) -> dict | None:
    """The newest run of each configuration (groups, compile mode, expert matmul) in each device folder, and the
    paper's Table 5: a GPU's evidence is one run per group and mode, not one run of everything. ``quiet``: say
    nothing of unreadable runs (the Speed section has said it)."""
    runs = _newest_of_each(
        results / "speed", lambda path: _run(path, "speed"), labels.speed_configuration, quiet
    )
    return {"runs": runs, "table5": _rows(WALLCLOCK)} if runs else None


def _newest_of_each(
    kind: Path, load: Callable, configuration: Callable[[dict], tuple], quiet: bool = False
) -> list[dict]:
    """In each device folder under ``kind``, the newest run (by the time it recorded, where it did: a checkout gives
    every file about one modification time) of each configuration that ``configuration(metadata)`` names."""

    def keyed(path: Path) -> tuple[dict, tuple, str]:
        run = load(path)
        key = configuration(run["metadata"])
        # a setting of an unexpected shape (a list where a name was) leaves this run out, not the section
        hash(key)
        return run, key, recorded(run["metadata"])

    runs = []
    for folder in sorted(p for p in kind.glob("*") if p.is_dir()):
        newest_of = {}
        paths = sorted((p for p in folder.glob("*.json") if p.is_file()), key=lambda p: p.stat().st_mtime)
        for run, key, _ in sorted(_each(paths, keyed, quiet), key=lambda keyed: keyed[2]):
            newest_of[key] = run
        runs += newest_of.values()
    return runs


def load_decode(results: Path) -> dict | None:
    """The newest decode run of each device folder, each with a summary per preset at its largest cell beside the
    training-step time ratio of the same preset where a speed run has one."""
    folders = sorted(p for p in (results / "decode").glob("*") if p.is_dir())
    runs = _each([p for p in map(newest, folders) if p is not None], lambda path: _run(path, "decode"))
    if not runs:
        return None
    speed = (load_speed(results, quiet=True) or {"runs": []})["runs"]
    return {
        "runs": [
            run
            | {
                "summary": _decode_summary(
                    run["rows"],
                    _training_ratios(
                        speed, run["metadata"].get("device"), {r["preset"] for r in run["rows"]}
                    ),
                )
            }
            for run in runs
        ]
    }


def _training_ratios(
    speed_runs: list[dict], device: str | None, presets: set[str]
) -> dict[str, tuple[float, str]]:
    """The training-step time ratios on ``device`` of as many of ``presets`` as one speed run has, and that run:
    the newest of those that time the most of them. One run, so that the ratios side by side share their settings
    (the newest run of each preset put a compiled batch-64 ratio beside eager batch-8 ones); none from another
    device."""

    def ratios(run: dict) -> dict[str, float]:
        return {
            r["preset"]: r["ratio_time"]
            for r in run["rows"]
            if r.get("what") == "train step" and r.get("ratio_time") is not None and r["preset"] in presets
        }

    runs = [run for run in speed_runs if run["metadata"].get("device") == device and ratios(run)]
    if not runs:
        return {}
    run = max(runs, key=lambda run: (len(ratios(run)), recorded(run["metadata"])))
    source = f"{run['file']} ({labels.speed_setting(run['metadata'])})"
    return {preset: (ratio, source) for preset, ratio in ratios(run).items()}


def _decode_summary(rows: list[dict], training: dict[str, tuple[float, str]]) -> list[dict]:
    """One row per preset: its cache, and its decode ratio at the run's largest batch and context."""
    timed = [r for r in rows if r["status"] == "ok"]
    cell = max(((r["batch"], r["context"]) for r in timed), default=None)
    out = {}
    for r in rows:
        if r["status"] != "ok" or (r["batch"], r["context"]) == cell:
            ratio, source = training.get(r["preset"], (None, None))
            out[r["preset"]] = r | {"train_step_ratio": ratio, "train_step_source": source}
    return list(out.values())


def load_kernels(results: Path) -> dict | None:
    path = newest(results / "kernels")
    return {"runs": [_run(path, "kernels")]} if path is not None else None


def load_profile(results: Path) -> dict | None:
    """The newest profile of each configuration (presets, expert matmul) in each device folder: its shares as one row
    per share with a cell per model. A profile of SwitchHead alone on another expert matmul does not hide the
    pair's."""
    runs = _newest_of_each(
        results / "profile", _profile, lambda m: (tuple(m.get("presets") or ()), m.get("expert_matmul"))
    )
    return {"runs": runs} if runs else None


def _profile(path: Path) -> dict:
    run = _run(path, "profile")
    columns = list(dict.fromkeys((r["preset"], r["what"]) for r in run["rows"]))
    shares = list(dict.fromkeys(r["name"] for r in run["rows"] if r["kind"] == "share"))
    cells = {(r["name"], r["preset"], r["what"]): r for r in run["rows"] if r["kind"] == "share"}
    table = [{"share": name, "cells": [cells.get((name, *column)) for column in columns]} for name in shares]
    steps = {column: next(r for r in run["rows"] if (r["preset"], r["what"]) == column) for column in columns}
    kernels = {
        column: [r for r in run["rows"] if r["kind"] == "kernel" and (r["preset"], r["what"]) == column]
        for column in columns
    }
    overhead = {(r["preset"], r["what"]): r for r in run["rows"] if r["kind"] == "moe overhead"}
    return run | {
        "columns": columns,
        "table": table,
        "steps": steps,
        "kernels": kernels,
        "overhead": [overhead.get(column) for column in columns] if overhead else None,
    }


def load_quality(results: Path) -> dict | None:
    """Every quality run of each device folder, the strongest first (most seeds x tokens per run): its runs, its
    summary per family and its figure. The summary takes each family's claim from the strongest run that has it."""
    folders = sorted(p for p in (results / "quality").glob("*") if p.is_dir())
    runs = _each(
        [path for folder in folders for path in sorted(folder.glob("*.json"))],
        lambda path: _quality(path, results),
    )
    runs.sort(key=lambda run: (run["metadata"].get("device", ""), -quality_strength(run)))
    return {"runs": runs} if runs else None


def quality_strength(run: dict) -> int:
    """Tokens of evidence in a quality run: seeds x training tokens per run."""
    meta = run["metadata"]
    return int(meta.get("seeds", 0)) * int(meta.get("tokens_per_run", 0))


# A quality summary's columns against dense, which a run without dense (or of dense alone) does not write
AGAINST_DENSE = (
    [f"{figure}{part}" for figure in ("vs_dense", "vs_dense_best") for part in ("", "_low", "_high", "_df")]
    + ["verdict", "verdict_best"]
    + [f"{cost}_vs_dense" for cost in ("train_macs", "train_seconds", "memory_bytes")]
)


def _quality(path: Path, results: Path) -> dict:
    stem = path.with_suffix("")
    run = _run(path, "quality")
    summary_csv = stem.with_name(f"{stem.name}-summary.csv")
    summary = _rows(summary_csv, "quality_summary")
    if not run["rows"] or not summary:
        raise ValueError(f"{path}: no runs" if not run["rows"] else f"{summary_csv}: no family")
    for row in summary:  # a file cut short: a family without its figures, a difference without its interval
        needed = ["bpb_mean", "bpb_low", "bpb_high", "train_macs"]
        for key in ("vs_dense", "vs_dense_best"):
            needed += [f"{key}_low", f"{key}_high"] if row.get(key) is not None else []
        missing = [key for key in needed if not _numeric(row.get(key))]
        if missing:
            raise ValueError(f"{summary_csv}: {row['family']} has no {missing[0]}")
    return run | {
        # a run without dense, or of dense alone, has no column against it: blank cells
        "summary": [dict.fromkeys(AGAINST_DENSE) | row for row in summary],
        "image": _image(stem.with_suffix(".png")),
        "csv": stem.with_suffix(".csv").relative_to(results).as_posix(),
    }


def load_analyses(results: Path) -> list[dict] | None:
    folders = sorted(p for p in (results / "analysis").glob("*") if p.is_dir())
    analyses = _each(folders, lambda folder: _analysis(folder, results))
    anchors = set()
    for analysis in analyses:  # each analysis' headings get ids of their own, unique on the page
        anchor = "routing-" + re.sub(r"[^A-Za-z0-9_-]", "-", analysis["name"])
        while anchor in anchors:
            anchor += "-"
        anchors.add(anchor)
        analysis["anchor"] = anchor
    return analyses or None


def _analysis(run: Path, results: Path) -> dict:
    def rows(kind: str) -> list[dict]:
        return _rows(run / f"{kind}.csv", kind) if (run / f"{kind}.csv").exists() else []

    def images(pattern: str) -> list[tuple[str, str]]:
        return [(p.stem, _image(p)) for p in sorted(run.glob(pattern))]

    metadata = _metadata(run / "metadata.json")
    found = {
        "name": run.name,
        "metadata": metadata,
        "training": labels.training(metadata),
        "folder": run.relative_to(results).as_posix(),
        "maxima": _image(run / "attention_maxima.png"),
        "curves": _image(run / "training_curves.png"),
        "selections": images("*-selection-*.png"),
        "figures": images("*-usage.png") + images("*-cooccurrence.png"),
        "summary": rows("summary"),
        "preferences": rows("preferences"),
        "log": rows("training_log"),
        "similarity": rows("similarity"),
        "similarity_image": _image(run / "similarity.png"),
        "explorer": (run / "explorer.html").exists(),
        "regenerate": labels.regenerate(metadata, run.as_posix()),
    }
    strongest = sorted(found["preferences"], key=lambda r: -r["lift"])[:STRONGEST]
    return found | {
        "accuracy": summary.final_accuracy(found["log"]),
        "strongest": strongest,
        "pairs": summary.mean_similarity(found["similarity"]),
        "by_layer": _by_layer(found["similarity"]),
    }


def _by_layer(rows: list[dict]) -> list[dict]:
    """Similarity rows as one row per layer: (pearson, js_distance) of each pair in order of appearance."""
    layers: dict[int, list] = {}
    for row in rows:
        layers.setdefault(row["layer"], []).append((row["pearson"], row["js_distance"]))
    return [{"layer": layer, "pairs": pairs} for layer, pairs in sorted(layers.items())]


SECTIONS = (
    Section("tables", "Compute and memory", load_tables),
    Section("sweep", "Cost vs length", load_sweep),
    Section("speed", "Speed", load_speed),
    Section("decode", "Inference", load_decode),
    Section("kernels", "Kernel", load_kernels),
    Section("profile", "Profile", load_profile),
    Section("quality", "Quality", load_quality),
    Section("analysis", "Routing", load_analyses),
)


def collect(results: Path) -> dict[str, object]:
    """Each section's data, for the sections with results; an unreadable one is noted on stderr and left out."""
    loaded = {}
    for section in SECTIONS:
        try:
            data = section.load(Path(results))
        except UNREADABLE as error:
            _left_out(section, error)
            continue
        if data is not None:
            loaded[section.name] = data
    return loaded


def _left_out(section: "Section", error: Exception) -> None:
    print(f"switchbench report: section '{section.title}' left out: {_reason(error)}", file=sys.stderr)


def _float(value) -> float | None:
    """``value`` as a number, or None for text and a missing cell."""
    try:
        return float(value)
    except (TypeError, ValueError, jinja2.UndefinedError):
        return None


def _number(value, digits: int = 3) -> str:
    """Thousands separators for integers, significant digits for other numbers, text unchanged."""
    number = _float(value)
    if number is None:
        return "" if value is None else str(value)
    if number != number:
        return "–"
    if number.is_integer() and abs(number) >= 1:
        return f"{int(number):,}"
    return f"{number:.{digits}g}"


def _percent(value) -> str:
    number = _float(value)
    return "" if number is None or number != number else f"{100 * number:.1f}%"


def _count(value) -> str:
    """A count in the units the paper's tables use: 527M, 0.82M, 7.44G (three significant digits)."""
    number = _float(value)
    if number is None:
        return "" if value is None else str(value)
    if number != number:
        return "–"
    rounded = float(f"{number:.3g}")  # 999.6M is 1G
    if abs(rounded) >= 1e9:
        return f"{rounded / 1e9:.3g}G"
    return f"{rounded / 1e6:.3g}M" if abs(rounded) >= 1e4 else _number(value)  # 1,024 bytes, not 1.02e+03


def _mib(value) -> str:
    number = _float(value)
    if number is None:
        return ""
    return "–" if number != number else f"{number / 2**20:,.1f} MiB"


def _numeric(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def render(loaded: dict, environment: dict, link: str = ".") -> str:
    """The page; ``link`` is the results folder as seen from the report (for the CSV links)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("switchbench.reports"), autoescape=True)
    env.filters.update(number=_number, percent=_percent, mib=_mib, count=_count, scores_ratio=scores_ratio)
    env.tests.update(below_floor=below_floor, below_decode_floor=decode.below_floor)
    env.globals.update(
        trained=labels.trained, speed_setting=labels.speed_setting, reference_min_r=summary.REFERENCE_MIN_R
    )
    env.tests["numeric"] = _numeric
    context = {"environment": environment, "summary": _summary(loaded), "link": link}
    sections = []
    for section in (s for s in SECTIONS if s.name in loaded):
        template = env.get_template(f"sections/{section.name}.html.j2")
        try:  # one section's data of a shape its template cannot show leaves that section out, not the page
            html = template.render(context | {"section": section, "data": loaded[section.name]})
        except (*UNREADABLE, jinja2.UndefinedError) as error:
            _left_out(section, error)
            continue
        sections.append((section, markupsafe.Markup(html)))
    return env.get_template("report.html.j2").render(context | {"sections": sections})


def _summary(loaded: dict) -> list[summary.Line]:
    """The summary's lines; a part whose results it cannot read is left out, named, as a section is."""
    found = []
    for name, part in summary.parts(loaded):
        try:
            found += part()
        except UNREADABLE as error:
            print(
                f"switchbench report: the summary's {name} lines left out: {_reason(error)}", file=sys.stderr
            )
    return found


def write_report(results: Path, out: Path, environment: dict, loaded: dict | None = None) -> Path:
    """The report on ``results`` at ``out``; ``loaded``: what :func:`collect` read of it, where already read."""
    loaded = collect(results) if loaded is None else loaded
    return write_atomic(Path(out), render(loaded, environment, _link(results, out)))


def _link(results: Path, out: Path) -> str:
    """The results folder as the report at ``out`` reaches it."""
    return Path(os.path.relpath(Path(results).resolve(), Path(out).resolve().parent)).as_posix()


def replaceable(path: Path | str, flag: str = "--out") -> Path:
    """``path`` if the report can be written there losing nothing: a new file or an earlier report, not a file of
    another kind (a baseline given as --out by mistake); else a one-line ValueError."""
    path = writable_file(path, flag)
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(1024)
        if not (head.startswith(b"<!DOCTYPE html>") and b"<title>switchbench report</title>" in head):
            raise ValueError(f"{flag} {path} exists and is not a switchbench report: refusing to replace it")
    return path


def register(commands) -> None:
    parser = commands.add_parser("report", help="one self-contained HTML report of everything measured")
    parser.add_argument(
        "--results", default="results", help="the results folder to report on (default: %(default)s)"
    )
    parser.add_argument("--out", help="the HTML file to write (default: report.html in the results folder)")
    parser.set_defaults(run=_run_command)


def _run_command(args) -> int:
    results = Path(args.results)
    if not results.is_dir():
        raise ValueError(f"no results folder at {args.results}")
    out = replaceable(args.out or results / "report.html")
    loaded = collect(results)
    if not loaded:
        print(
            f"switchbench report: nothing to report: {results} holds no result a section reads",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {write_report(results, out, report_environment(), loaded)}")
    return 0


def report_environment() -> dict:
    """Where the report was made, without the fields this machine does not have."""
    env = environment(device_from_args(None))
    if env.get("machine"):
        env["machine"] = describe_machine(env["machine"])
    return {key: value for key, value in env.items() if value is not None}
