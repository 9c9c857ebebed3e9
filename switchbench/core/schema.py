"""What each kind of file the commands read must hold, checked as it is read: a file of the right format but the
wrong shape is a one-line ValueError naming the file and what is wrong, never a traceback further on."""

import json
import math
from pathlib import Path

import pandas as pd

from switchbench.core.results import read_csv

TEXT, NUMBER, INTEGER, OBJECT, LIST = "text", "a number", "an integer", "an object", "a list"

# The columns each CSV kind must have, and what their cells are (a NUMBER cell may be empty).
CSV_COLUMNS = {
    "log": {"step": INTEGER},
    "table": {"preset": TEXT, "macs_vs_dense": NUMBER, "mem_vs_dense": NUMBER},
    "sweep": {"size": TEXT, "model": TEXT, "macs_crossover_T": NUMBER, "mem_crossover_T": NUMBER},
    "summary": {
        "model": TEXT,
        "layer": INTEGER,
        "head": INTEGER,
        "side": TEXT,
        "entropy": NUMBER,
        "perplexity": NUMBER,
    },
    "preferences": {
        "model": TEXT,
        "layer": INTEGER,
        "head": INTEGER,
        "side": TEXT,
        "expert": INTEGER,
        "token": TEXT,
        "lift": NUMBER,
        "share": NUMBER,
    },
    "training_log": {"model": TEXT, "step": INTEGER},
    "similarity": {
        "model_a": TEXT,
        "model_b": TEXT,
        "layer": INTEGER,
        "pearson": NUMBER,
        "js_distance": NUMBER,
    },
    "quality_summary": {
        "family": TEXT,
        "runs": INTEGER,
        "bpb_mean": NUMBER,
        "bpb_low": NUMBER,
        "bpb_high": NUMBER,
        "train_macs": NUMBER,
    },
}
# The keys each row of a run's JSON must have; the optional ones are checked where present (None allowed).
RUN_ROWS = {
    "speed": {"preset": TEXT, "scope": TEXT, "what": TEXT, "status": TEXT},
    "kernels": {"case": TEXT, "impl": TEXT, "pass": TEXT},
    "decode": {"preset": TEXT, "family": TEXT, "status": TEXT},
    "profile": {"preset": TEXT, "what": TEXT, "kind": TEXT, "name": TEXT, "ms": NUMBER, "fraction": NUMBER},
    "quality": {
        "family": TEXT,
        "preset": TEXT,
        "seed": INTEGER,
        "val_bits_per_byte": NUMBER,
        "train_macs": NUMBER,
    },
}
OPTIONAL_NUMBERS = (
    "ms",
    "ms_iqr",
    "tflops",
    "memory_bytes",
    "ratio_time",
    "ratio_memory",
    "ratio_macs",
    "ratio_macs_executed",
    "ratio_scores",
    "time_over_floor",
    "fraction_of_matmul_peak",
    "vs_dense",
    "routing_ms",
    "moe_overhead_ms",
    "moe_ms",
    "dense_equivalent_ms",
    "max_rel_error",
    "kv_cache_bytes_per_token",
    "max_abs_diff_vs_forward",
    "prefill_ms",
    "decode_ms",
    "ratio_decode_time",
    "ratio_decode_floor",
)
# A checkpoint's payload: the model and its configuration, and the state a resumed run continues from.
CHECKPOINT = {
    "task": TEXT,
    "config": OBJECT,
    "step": INTEGER,
    "train": OBJECT,
    "model": OBJECT,
    "optimizer": OBJECT,
}


def read_table(path: Path, kind: str) -> pd.DataFrame:
    """A CSV of ``kind`` (a key of CSV_COLUMNS), checked."""
    path = Path(path)
    try:
        table = read_csv(path)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise ValueError(f"{path}: not a readable CSV ({first_line(error)})") from None
    for column, kind_of in CSV_COLUMNS[kind].items():
        if column not in table.columns:
            raise ValueError(f"{path}: no {column!r} column")
        if not _column_is(table[column], kind_of):
            raise ValueError(f"{path}: column {column!r} must hold {kind_of}")
    return table


def read_run(path: Path, kind: str) -> dict:
    """A run's JSON (``{"metadata": {...}, "rows": [...]}``) of ``kind`` (a key of RUN_ROWS), checked."""
    path = Path(path)
    run = read_json(path, "run file")
    if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
        raise ValueError(f"{path}: not a switchbench {kind} run (needs a list of 'rows')")
    if not isinstance(run.get("metadata", {}), dict):
        raise ValueError(f"{path}: 'metadata' must be an object")
    others = [
        k
        for k, keys in RUN_ROWS.items()
        if k != kind and run["rows"] and not _row_problem(run["rows"][0], keys)
    ]
    if others and _row_problem(run["rows"][0], RUN_ROWS[kind]):
        raise ValueError(f"{path}: a {others[0]} run, not a {kind} run")
    for i, row in enumerate(run["rows"]):
        problem = _row_problem(row, RUN_ROWS[kind])
        if problem:
            raise ValueError(f"{path}: row {i}: {problem}")
    return run


def check_checkpoint(path: Path, payload: dict) -> dict:
    """A checkpoint's payload has every part, each of its kind."""
    for key, kind in CHECKPOINT.items():
        if key not in payload:
            raise ValueError(f"{path}: incomplete checkpoint (no {key!r})")
        # a whole float is an integer in JSON text, not in a checkpoint, which torch saves as it was made
        if not _is(payload[key], kind) or (kind == INTEGER and not isinstance(payload[key], int)):
            raise ValueError(f"{path}: the checkpoint's {key!r} must be {kind}")
    return payload


def read_json(path: Path, what: str = "JSON file"):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what}") from None
    # RecursionError: arrays or objects nested past Python's stack; ValueError (UnicodeDecodeError and
    # JSONDecodeError among them): an integer past Python's 4,300 digits too
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: not a readable {what} ({first_line(error)})") from None


def check_fields(path: Path, fields, kinds: dict, where: str, optional: tuple = ()) -> dict:
    """``fields``, an object at ``where`` in the file at ``path``, with each key of ``kinds`` of its kind (those
    in ``optional`` may be absent); a one-line ValueError naming the first that is not."""
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: {where} must be {OBJECT}")
    for key, kind in kinds.items():
        if (key in fields or key not in optional) and not _is(fields.get(key), kind):
            raise ValueError(f"{path}: {where}: {key!r} must be {kind}")
    return fields


def _row_problem(row, keys: dict) -> str | None:
    if not isinstance(row, dict):
        return "not an object"
    for key, kind in keys.items():
        if not _is(row.get(key), kind):
            return f"{key!r} must be {kind}"
    wrong = [k for k in OPTIONAL_NUMBERS if row.get(k) is not None and not _is(row[k], NUMBER)]
    return f"{wrong[0]!r} must be a number" if wrong else None


def _is(value, kind: str) -> bool:
    if kind == TEXT:
        return isinstance(value, str)
    if kind == OBJECT:
        return isinstance(value, dict)
    if kind == LIST:
        return isinstance(value, list)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return kind == NUMBER or isinstance(value, int) or (math.isfinite(value) and value.is_integer())


def _column_is(column: pd.Series, kind: str) -> bool:
    if kind == TEXT:
        return True  # any cell reads as text
    if not pd.api.types.is_numeric_dtype(column) or pd.api.types.is_bool_dtype(column):
        return False
    if kind == INTEGER:
        return bool(column.notna().all() and (column == column.round()).all())
    return True


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:120] if text else type(error).__name__
