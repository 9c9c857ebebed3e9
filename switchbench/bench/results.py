"""Result files: written whole or not at all, never over an earlier run."""

import csv
import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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
    """A matplotlib figure as STEM.png and STEM.svg, each written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    written = [
        replace_atomically(
            Path(stem).with_suffix(f".{fmt}"),
            lambda tmp, f=fmt: fig.savefig(tmp, format=f, dpi=dpi, bbox_inches="tight"),
        )
        for fmt in ("png", "svg")
    ]
    plt.close(fig)
    return written


def new_run_stem(folder: Path, label: str) -> Path:
    """``folder/label``, or ``folder/label-2``, ... : the first stem with no .json beside it."""
    stem, n = Path(folder) / label, 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = Path(folder) / f"{label}-{n}"
    return stem


def to_csv(rows: list[dict]) -> str:
    """CSV text with a column for every key of any row, in order of appearance; missing cells empty."""
    buffer = io.StringIO()
    if rows:
        fields = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(buffer, fieldnames=fields, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buffer.getvalue()


def newest(folder: Path, pattern: str = "*.json") -> Path | None:
    """The most recently written file matching ``pattern`` under ``folder``, or None."""
    files = sorted(Path(folder).glob(pattern), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def save_run(folder: Path, label: str, metadata: dict, rows: list[dict]) -> Path:
    """``label.json`` (metadata + rows) and ``label.csv`` (rows) under ``folder``; returns the JSON path."""
    stem = new_run_stem(folder, label)
    write_atomic(stem.with_suffix(".csv"), to_csv(rows))
    payload = json.dumps({"metadata": metadata, "rows": rows}, indent=2, allow_nan=False)  # strict JSON
    return write_atomic(stem.with_suffix(".json"), payload)


def slug(text: str) -> str:
    """``text`` as a file name: lower case, every other character as '-'."""
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
