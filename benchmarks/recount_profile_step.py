"""Bring GPU profiles recorded before 2026-11-29 to a step counted once.

Until then `profile` on CUDA summed every range of its step label, and the profiler returns that label twice there:
the host's range, and a device annotation over the kernels the step's thread launched (all of a forward's, about a
third of a training step's). Each share's fraction, the "outside kernels" share and the MoE overhead's fraction of
the step were taken over that larger time: a dense forward read 52% outside kernels where its kernels filled 95%
of it. This recounts them over ``ms_wall``, the host's clock around the same profiled steps (the label's host range
lies just inside it), which becomes ``ms_profiled``. Kernel times, ``ms_unprofiled``, ``ms_wall`` and MFU stay as
recorded. Each file it changes says so in its metadata (``step_recounted``); a file that says so already, or a CPU
profile (one range a step there), is left alone.

    python benchmarks/recount_profile_step.py --results results
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from switchbench.core.results import save_run

NOTE = (
    "2026-11-29: shares' fractions, 'outside kernels' and the MoE overhead's fraction recounted over ms_wall (the "
    "step label was counted twice on CUDA: benchmarks/recount_profile_step.py); kernel times as recorded"
)
OUTSIDE = "outside kernels"


def recount(rows: list[dict]) -> None:
    """Each profiled step's rows (one preset and pass) over its host clock, in place."""
    steps = defaultdict(list)
    for row in rows:
        steps[(row["preset"], row["what"])].append(row)
    for step in steps.values():
        wall = step[0]["ms_wall"]
        shares = [r for r in step if r["kind"] == "share"]
        kernels = sum(r["ms"] for r in shares if r["name"] != OUTSIDE)
        outside = max(wall - kernels, 0.0)
        total = kernels + outside  # as profile.summarise: the shares add up to the step
        for row in step:
            row["ms_profiled"] = wall
            if row["kind"] == "share" and row["name"] == OUTSIDE:
                row["ms"] = outside
            if row["kind"] in ("share", "kernel"):
                row["fraction"] = row["ms"] / total
            elif row["kind"] == "moe overhead":
                row["fraction"] = row["ms"] / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    for path in sorted((args.results / "profile").glob("*/*.json")):
        run = json.loads(path.read_text())
        metadata = run["metadata"]
        # a profile of the fixed code counts the host's range alone, inside ms_wall: nothing to recount
        counted_once = all(r["ms_profiled"] <= r["ms_wall"] for r in run["rows"])
        if "step_recounted" in metadata or "cuda" not in metadata or counted_once:
            continue
        recount(run["rows"])
        save_run(path.parent, "", metadata | {"step_recounted": NOTE}, run["rows"], stem=path.with_suffix(""))
        print(f"recounted {path}")


if __name__ == "__main__":
    main()
