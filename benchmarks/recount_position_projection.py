"""Bring results recorded before 2026-11-29 to the count that projects Transformer-XL's positions once per batch.

Until then every whole-batch MAC count (speed's TFLOP/s, MFU and MAC floors, profile's MFU, quality's training
MACs, the gate baseline's layer MAC ratios) counted the position projection once per sequence; the model computes
it once per batch. This rescales those count-derived fields of the speed, profile and quality files and of the gate
baselines under ``--results``, and leaves every measured field (times, memory, kernel time, rounds) as it was. Each file it changes says so in its metadata (``recounted``); a
file that says so already is left alone, so running it twice changes nothing.

    python benchmarks/recount_position_projection.py --results results
"""

import argparse
import json
from pathlib import Path

from switchbench.analysis import quality
from switchbench.bench.cost.accounting import exact_cost, model_macs
from switchbench.core.results import save_run, write_atomic
from switchbench.models.config import ModelConfig
from switchbench.models.presets import from_name

NOTE = (
    "2026-11-29: count-derived fields recounted with XL's position projection once per batch, not once per "
    "sequence (benchmarks/recount_position_projection.py); times, memory and every measured field as recorded"
)


def _macs(cfg: ModelConfig, batch: int, scope: str) -> tuple[int, int]:
    """MACs of one sequence and of ``batch`` sequences, of the model or of one attention layer."""
    if scope == "layer":
        cost = exact_cost(cfg)
        return cost.macs, cost.batched_macs(batch)
    return model_macs(cfg), model_macs(cfg, batch)


def speed(path: Path) -> bool:
    run = json.loads(path.read_text())
    metadata, rows = run["metadata"], run["rows"]
    changed = False
    for row in rows:
        if row["scope"] not in ("model", "layer") or row.get("status") != "ok" or "tflops" not in row:
            continue
        batch = row.get("batch") or (metadata.get("batches") or {}).get(row["group"]) or metadata["batch"]
        one, many = _macs(from_name(row["preset"]), batch, row["scope"])
        if many == batch * one:  # nothing shared (RoPE)
            continue
        changed, factor = True, many / (batch * one)
        row["tflops"] *= factor
        row["fraction_of_matmul_peak"] *= factor
        if "ratio_macs" in row:
            base_one, base_many = _macs(from_name(row["baseline"]), batch, row["scope"])
            row["ratio_macs"] = many / base_many
            row["time_over_floor"] = row["ratio_time"] / row["ratio_macs"]
            if (
                "ratio_macs_executed" in row
            ):  # the unchosen experts' products are per sequence: only the shared part moves
                executed = row["ratio_macs_executed"] * batch * base_one - (batch * one - many)
                row["ratio_macs_executed"] = executed / base_many
    if changed:
        save_run(path.parent, "", metadata | {"recounted": NOTE}, rows, stem=path.with_suffix(""))
    return changed


def profile(path: Path) -> bool:
    run = json.loads(path.read_text())
    changed = False
    for row in run["rows"]:
        if row.get("mfu") is None:
            continue
        one, many = _macs(from_name(row["preset"]), row["batch"], "model")
        if many != row["batch"] * one:
            row["mfu"] *= many / (row["batch"] * one)
            changed = True
    if changed:
        save_run(
            path.parent, "", run["metadata"] | {"recounted": NOTE}, run["rows"], stem=path.with_suffix("")
        )
    return changed


def quality_run(path: Path) -> bool:
    """Training MACs were 3 x batch x (carried x M + fresh x M0) per run; which steps carried XL memory is read
    back from that sum, exactly, and the batch counted as the model computes it."""
    run = json.loads(path.read_text())
    metadata, batch, steps = run["metadata"], run["metadata"]["batch"], run["metadata"]["steps"]
    for row in run["rows"]:
        cfg = ModelConfig.from_dict(metadata["models"][row["family"]]["config"])
        fresh = cfg.replace(context_blocks=0)
        carried_macs, fresh_macs = model_macs(cfg), model_macs(fresh)
        carried = round((row["train_macs"] / (3 * batch) - steps * fresh_macs) / (carried_macs - fresh_macs))
        if 3 * batch * (carried * carried_macs + (steps - carried) * fresh_macs) != row["train_macs"]:
            raise SystemExit(f"{path}: {row['family']}'s training MACs are not of the per-sequence count")
        row["train_macs"] = 3 * (
            carried * model_macs(cfg, batch) + (steps - carried) * model_macs(fresh, batch)
        )
    summary = quality.summarize(run["rows"], metadata["confidence"])
    quality.write_files(path.with_suffix(""), metadata | {"recounted": NOTE}, run["rows"], summary)
    return True


def baseline(path: Path) -> bool:
    """The layer rows' exact MAC ratios, at the batch the baseline's runs timed."""
    recorded = json.loads(path.read_text())
    batch = recorded["metadata"]["batch"]
    for key, entry in recorded["ratios"].items():
        preset, scope, _ = key.split(" | ")
        if scope == "layer" and "ratio_macs" in entry:
            many, base_many = (
                exact_cost(from_name(p)).batched_macs(batch) for p in (preset, entry["baseline"])
            )
            entry["ratio_macs"] = many / base_many
    recorded["metadata"]["recounted"] = NOTE
    write_atomic(path, json.dumps(recorded, indent=2) + "\n")
    return True


KINDS = (("speed", speed), ("profile", profile), ("quality", quality_run))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    found = [
        (path, recount) for kind, recount in KINDS for path in sorted((args.results / kind).glob("*/*.json"))
    ]
    found += [(path, baseline) for path in sorted((args.results / "baselines").glob("*.json"))]
    for path, recount in found:
        if "recounted" not in json.loads(path.read_text())["metadata"] and recount(path):
            print(f"recounted {path}")


if __name__ == "__main__":
    main()
