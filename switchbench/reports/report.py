"""One self-contained HTML report of everything under results/: images embedded, CSS inline, no request of any
kind; token strings and file contents are escaped (jinja2 autoescape)."""

import base64
from pathlib import Path

import jinja2

from switchbench.bench.command import device_from_args
from switchbench.bench.environment import environment
from switchbench.bench.published import WALLCLOCK
from switchbench.bench.results import newest, read_csv, writable_file, write_atomic
from switchbench.bench.schema import read_run, read_table

TABLES = {"table1": "Table 1", "table2": "Table 2", "table3": "Table 3", "table7": "Table 7",
          "macmatched": "MAC-matched variants"}  # fmt: skip


def _csv(path, kind: str | None = None) -> list[dict]:
    """A results CSV as rows, checked as ``kind`` (see bench.schema) unless it is package data; an empty cell is
    shown empty."""
    table = read_csv(path) if kind is None else read_table(path, kind)
    return table.astype(object).fillna("").to_dict("records")


def _image(path: Path) -> str | None:
    """A PNG as a data URI."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode() if path.exists() else None


def _runs(files: list[Path | None], kind: str) -> list[dict]:
    return [read_run(f, kind) | {"file": str(f)} for f in files if f is not None]


def _newest_per_device(folder: Path) -> list[dict]:
    """The newest run JSON of each device folder under ``folder``."""
    return _runs([newest(device) for device in sorted(p for p in folder.glob("*") if p.is_dir())], "speed")


def collect(results: Path) -> dict:
    """What the report shows; a section is present only when its files exist."""
    results = Path(results)
    tables = {title: _csv(results / "tables" / f"{name}.csv", "table") for name, title in TABLES.items()
              if (results / "tables" / f"{name}.csv").exists()}  # fmt: skip
    sweep = results / "tables" / "cost_scaling.csv"
    analyses = []
    for run in (
        sorted(p for p in (results / "analysis").glob("*") if p.is_dir())
        if (results / "analysis").exists()
        else []
    ):
        analyses.append({
            "name": run.name,
            "maxima": _image(run / "attention_maxima.png"),
            "selections": [(p.stem, _image(p)) for p in sorted(run.glob("*-selection-*.png"))],
            "usage": [(p.stem, _image(p)) for p in sorted(run.glob("*-usage.png"))],
            "cooccurrence": [(p.stem, _image(p)) for p in sorted(run.glob("*-cooccurrence.png"))],
            "curves": _image(run / "training_curves.png"),
            "summary": _csv(run / "summary.csv", "summary") if (run / "summary.csv").exists() else [],
            "preferences": _csv(run / "preferences.csv", "preferences")[:60] if (run / "preferences.csv").exists() else [],
            "log": _csv(run / "training_log.csv", "training_log") if (run / "training_log.csv").exists() else [],
        })  # fmt: skip
    return {
        "tables": tables,
        "sweep": {
            "image": _image(results / "tables" / "cost_scaling.png"),
            "rows": _crossovers(_csv(sweep, "sweep")),
        }
        if sweep.exists()
        else None,
        "speed": _newest_per_device(results / "speed"),
        "table5": _csv(WALLCLOCK),
        "kernels": _runs([newest(results / "kernels")], "kernels"),
        "analyses": analyses,
    }


def _crossovers(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in rows:
        if (r["size"], r["model"]) not in seen:
            seen.add((r["size"], r["model"]))
            out.append(r)
    return out


def _number(value, digits: int = 3) -> str:
    """Thousands separators for integers, significant digits for other numbers, text unchanged."""
    try:
        number = float(value)
    except (TypeError, ValueError, jinja2.UndefinedError):  # a missing cell is shown empty
        return "" if value is None else str(value)
    if number != number:
        return "–"
    if number.is_integer() and abs(number) >= 1:
        return f"{int(number):,}"
    return f"{number:.{digits}g}"


def _percent(value) -> str:
    try:
        return f"{100 * float(value):.1f}%"
    except (TypeError, ValueError, jinja2.UndefinedError):  # a missing cell is shown empty
        return ""


def _mib(value) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError, jinja2.UndefinedError):  # a missing cell is shown empty
        return ""
    return "–" if number != number else f"{number / 2**20:,.1f} MiB"


def render(data: dict, environment: dict) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("switchbench.reports"), autoescape=True)
    env.filters.update(number=_number, percent=_percent, mib=_mib)
    return env.get_template("report.html.j2").render(environment=environment, **data)


def write_report(results: Path, out: Path, environment: dict) -> Path:
    return write_atomic(Path(out), render(collect(results), environment))


def register(commands) -> None:
    parser = commands.add_parser("report", help="one self-contained HTML report of everything measured")
    parser.add_argument("--results", default="results", help="the results folder to report on")
    parser.add_argument("--out", default="results/report.html")
    parser.set_defaults(run=_run)


def _run(args) -> None:
    if not Path(args.results).is_dir():
        raise ValueError(f"no results folder at {args.results}")
    writable_file(Path(args.out))
    print(f"wrote {write_report(Path(args.results), Path(args.out), report_environment())}")


def report_environment() -> dict:
    """Where the report was made, without the fields this machine does not have."""
    env = environment(device_from_args(None))
    return {key: value for key, value in env.items() if value is not None}
