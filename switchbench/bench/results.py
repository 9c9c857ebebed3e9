"""Result files: written whole or not at all, never over an earlier run."""

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd


def replace_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """Have ``write`` fill a temporary file beside ``path``, then rename it into place: a reader sees the old
    file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_atomic(path: Path, text: str) -> Path:
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


def save_figure(fig, stem: Path, dpi: int = 100) -> list[Path]:
    """A matplotlib figure as STEM.png and STEM.svg, each written atomically; a pyplot figure is closed."""
    written = [
        replace_atomically(
            Path(stem).with_suffix(f".{fmt}"),
            lambda tmp, f=fmt: fig.savefig(tmp, format=f, dpi=dpi, bbox_inches="tight"),
        )
        for fmt in ("png", "svg")
    ]
    plt.close(fig)  # a no-op for figures made without pyplot
    return written


def new_run_stem(folder: Path, label: str) -> Path:
    """``folder/label``, or ``folder/label-2``, ... : the first stem with no .json beside it."""
    stem, n = Path(folder) / label, 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = Path(folder) / f"{label}-{n}"
    return stem


def frame(rows: list[dict] | pd.DataFrame) -> pd.DataFrame:
    """Rows as a table with a column for every key of any row; integer columns stay integers where cells are
    missing (pandas would make them floats)."""
    if isinstance(rows, pd.DataFrame):
        return rows
    table = pd.DataFrame(rows)
    for name in table.columns:
        values = [row[name] for row in rows if row.get(name) is not None]
        if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            table[name] = table[name].astype("Int64")
    return table


def write_csv(path: Path, rows: list[dict] | pd.DataFrame) -> Path:
    """Rows as CSV, full precision, missing cells empty; written atomically."""
    return replace_atomically(path, lambda tmp: frame(rows).to_csv(tmp, index=False))


def read_csv(path: Path) -> pd.DataFrame:
    """A CSV written by :func:`write_csv`, or shipped as package data; empty cells become missing values."""
    with path.open(newline="") as f:
        return pd.read_csv(f)


def newest(folder: Path, pattern: str = "*.json") -> Path | None:
    """The most recently written file matching ``pattern`` under ``folder``, or None."""
    files = sorted(Path(folder).glob(pattern), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def save_run(folder: Path, label: str, metadata: dict, rows: list[dict]) -> Path:
    """``label.json`` (metadata + rows) and ``label.csv`` (rows) under ``folder``; returns the JSON path."""
    stem = new_run_stem(folder, label)
    write_csv(stem.with_suffix(".csv"), rows)
    payload = json.dumps({"metadata": metadata, "rows": rows}, indent=2, allow_nan=False)  # strict JSON
    return write_atomic(stem.with_suffix(".json"), payload)
