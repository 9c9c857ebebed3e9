"""Bring decode runs recorded before 2026-11-29 to the bytes a SwitchAll decode step reads.

Until then the expert weights a decode step reads were looked up by shape alone, and where an attention's experts
and the MLP's share a shape (tiny SwitchAll: SwitchHead's value experts and the sigma-MoE's up projection are both
8 x 64 x 16), the MLP's were read at the attention's rate, 4 of 8 experts a token where it uses 2. This recounts
each timed row's ``decode_bytes_read`` and what follows from it (the decode floor, its bound, the time over it and
the floor ratios) with the run's own peak and bandwidth; times stay as recorded. Each file it changes says so in
its metadata (``bytes_recounted``); a file that says so already is left alone.

    python benchmarks/recount_decode_bytes.py --results results
"""

import argparse
import json
from pathlib import Path

from switchbench.bench.inference import sizing
from switchbench.bench.inference.decode import with_floors
from switchbench.core.results import save_run
from switchbench.models.presets import from_name

NOTE = (
    "2026-11-29: decode_bytes_read and the decode floors recounted with each sub-layer's experts read at its own "
    "rate (benchmarks/recount_decode_bytes.py); times as recorded"
)
WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}


def recount(run: dict) -> bool:
    """The run's rows recounted in place; whether any byte count moved."""
    metadata, rows = run["metadata"], run["rows"]
    width, changed = WIDTH[metadata["dtype"]], False
    for row in rows:
        if row.get("status") == "ok":
            read = sizing.decode_bytes(from_name(row["preset"]), row["batch"], row["context"], width)
            changed |= read != row["decode_bytes_read"]
            row["decode_bytes_read"] = read
    with_floors(
        rows,
        metadata["matmul_peak_tflops"],
        metadata["memory_bandwidth_gbs"],
        metadata["memory_for_max_batch_bytes"],
        width,
    )
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    for path in sorted((args.results / "decode").glob("*/*.json")):
        run = json.loads(path.read_text())
        if "bytes_recounted" in run["metadata"] or not recount(run):
            continue
        metadata = run["metadata"] | {"bytes_recounted": NOTE}
        save_run(path.parent, "", metadata, run["rows"], stem=path.with_suffix(""))
        print(f"recounted {path}")


if __name__ == "__main__":
    main()
