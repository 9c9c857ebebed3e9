"""The speedup regression gate: ratios of a run against a committed baseline, each with its tolerance."""

import json
from pathlib import Path

from .results import newest, write_atomic
from .schema import check_baseline, read_json, read_run

RATIOS = ("ratio_time", "ratio_memory", "ratio_macs")
# Relative slack above the baseline before a ratio counts as a regression; counts are exact.
# Time ratios on a shared CPU move by tens of percent between machines; a SwitchHead layer as slow as the dense
# one (ratio about 1) must still fail against the CPU baseline (about 0.4): 0.4 x 1.75 = 0.7.
TOLERANCES = {"ratio_time": 0.75, "ratio_memory": 0.0, "ratio_macs": 0.0}


def _key(row: dict) -> str:
    return f"{row['preset']} | {row['scope']} | {row['what']}"


def load_run(path: Path) -> dict:
    """A speed run's JSON; a folder means the newest run under it."""
    path = Path(path)
    if path.is_dir():
        folder, path = path, newest(path, "**/*.json")
        if path is None:
            raise ValueError(f"no run (*.json) in {folder}")
    return read_run(path, "speed")


def load_baseline(path: Path) -> dict:
    return check_baseline(path, read_json(path))


def baseline_from(run: dict, tolerances: dict[str, float] = TOLERANCES) -> dict:
    ratios = {
        _key(r): {k: r[k] for k in RATIOS if k in r}
        for r in run["rows"]
        if r.get("baseline") and r["status"] == "ok"
    }
    return {"metadata": run.get("metadata", {}), "tolerances": tolerances, "ratios": ratios}


def write_baseline(run: dict, path: Path) -> Path:
    return write_atomic(Path(path), json.dumps(baseline_from(run), indent=2))


def check(run: dict, baseline: dict) -> list[str]:
    """Every baseline ratio that the run misses or exceeds by more than its tolerance, as a line each."""
    ran_on, expected_on = run.get("metadata", {}).get("device"), baseline.get("metadata", {}).get("device")
    if ran_on and expected_on and ran_on != expected_on:
        raise ValueError(f"the run is from {ran_on!r} and the baseline from {expected_on!r}: not comparable")
    rows = {_key(r): r for r in run["rows"]}
    problems = []
    for key, expected in baseline["ratios"].items():
        row = rows.get(key)
        if row is None or row.get("status") != "ok":
            problems.append(f"{key}: {'missing from the run' if row is None else row.get('status')}")
            continue
        for name, value in expected.items():
            limit = value * (1 + baseline["tolerances"].get(name, 0.0)) + 1e-12
            got = row.get(name)
            if got is None or not got <= limit:
                problems.append(f"{key}: {name} {got} above {limit:.4f} (baseline {value:.4f})")
    return problems
