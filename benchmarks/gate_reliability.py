"""How often the CPU gate cries wolf, and how often it sleeps through a regression, measured.

Runs ``switchbench gate`` as tox does (this checkout against the baseline's commit, both timed here, interleaved)
N times, alternately beside each count of busy processes given (each spins a core until the gate ends, or with
``--neighbour bursts`` streams memory in bursts):

- the checkout as it is: a failure is a false alarm (the code did not change);
- a copy of the checkout whose SwitchHead attention forward is made slower in CPU time by each factor of ``--plants``
  (default 1.5; a spin after the call, no extra tensor operation): a pass is a miss;
- a copy whose dense and SwitchHead attention forwards are both made slower by each factor of ``--shared-plants``
  (default 1.3): their ratio stands still, so only the layers' times against the reference's catch it; a pass is a
  miss.

    python benchmarks/gate_reliability.py --runs 6 --busy 4 6 --out results/gate/reliability.json

It prints one line per gate and, after every gate, writes the verdicts and the counts so far as JSON with the
machine and the commit. The reference commit is materialised once and shared by every gate (``--reference`` as a
folder); without git history, a copy of the checkout stands in for it. Wall time: about a minute a gate on a quiet
2-core machine, about four beside 4 busy processes.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from switchbench.bench.timing.gate import LAYER_TIME, TIME, load_baseline
from switchbench.bench.timing.reference import HERE, NoReference, materialise
from switchbench.bench.timing.same_machine import LAUNCH, PAIRS, ROUNDS
from switchbench.core.environment import commit, environment
from switchbench.core.results import write_atomic

BUSY = "while True:\n    pass\n"
# A neighbour as a test suite's workers are: bursts of memory traffic (copies of 256 MiB, past any cache) of 0.5 to 3 s
# with pauses of as long between them, each process on its own seed. Beside pytest-xdist workers a CI-like run of
# unchanged code read 1.19 to 1.25 times the reference's layer times, where spinning processes never moved them.
BURSTS = """\
import random, time
import numpy as np
a = np.ones(1 << 25)
b = np.empty_like(a)
rng = random.Random({seed})
while True:
    end = time.monotonic() + rng.uniform(0.5, 3.0)
    while time.monotonic() < end:
        np.copyto(b, a)
    time.sleep(rng.uniform(0.5, 3.0))
"""
NEIGHBOURS = {"spin": lambda seed: BUSY, "bursts": lambda seed: BURSTS.format(seed=seed)}
# Appended to a copy's attention module: the class's forward, then a spin of (factor - 1) times the CPU time the
# forward took, which the gate's clock (the thread's CPU time) counts.
PLANT = """

import time as _time


def _planted(forward, factor={factor}):
    def slower(self, *args, **kwargs):
        start = _time.thread_time()
        out = forward(self, *args, **kwargs)
        end = start + factor * (_time.thread_time() - start)
        while _time.thread_time() < end:
            pass
        return out

    return slower


{cls}.forward = _planted({cls}.forward)
"""
PLANTED = {"switchhead": "SwitchHeadAttention", "dense": "DenseAttention"}  # module: class


def copied(dest: Path, plant: float | None = None, families: tuple[str, ...] = ("switchhead",)) -> Path:
    """A copy of the checkout's package under ``dest``, the attention forward of each of ``families`` ``plant``
    times slower if given; the folder to run it from."""
    shutil.copytree(HERE / "switchbench", dest / "switchbench", ignore=shutil.ignore_patterns("__pycache__"))
    for family in families if plant is not None else ():
        module = dest / "switchbench" / "models" / "families" / f"{family}.py"
        module.write_text(module.read_text() + PLANT.format(factor=plant, cls=PLANTED[family]))
    return dest


def gated(source: Path, reference: Path, busy: int, rounds: int, pairs: int, neighbour: str = "spin") -> dict:
    """``switchbench gate`` of the package in ``source`` beside ``busy`` processes of the ``neighbour`` kind: its
    exit code and its time verdicts."""
    settings = ["--reference", str(reference), "--rounds", str(rounds), "--pairs", str(pairs), "--json"]
    spinners = [subprocess.Popen([sys.executable, "-c", NEIGHBOURS[neighbour](i)]) for i in range(busy)]
    try:
        done = subprocess.run(
            [sys.executable, "-c", LAUNCH, str(source), "gate", *settings],
            capture_output=True,
            text=True,
        )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if done.returncode not in (0, 1):
        raise RuntimeError(f"switchbench gate exited {done.returncode}: {done.stderr.strip()}")
    checks = json.loads(done.stdout)["checks"]
    return {
        "exit": done.returncode,
        "time": [c for c in checks if c["quantity"] == TIME],
        "layer_time": [c for c in checks if c["quantity"] == LAYER_TIME],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument(
        "--busy", type=int, nargs="+", default=[4, 6], help="busy processes, in turn (default 4 6)"
    )
    parser.add_argument(
        "--neighbour",
        choices=sorted(NEIGHBOURS),
        default="spin",
        help="what the busy processes do: spin a core, or bursts of memory traffic (default spin)",
    )
    parser.add_argument(
        "--plants", type=float, nargs="+", default=[1.5], help="SwitchHead slow-downs planted (default 1.5)"
    )
    parser.add_argument(
        "--shared-plants",
        type=float,
        nargs="*",
        default=[1.3],
        help="slow-downs of both layers planted (default 1.3)",
    )
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="timed rounds per speed run (the gate's default)"
    )
    parser.add_argument(
        "--pairs", type=int, default=PAIRS, help="runs of each side per gate (the gate's default)"
    )
    parser.add_argument("--baseline", type=Path, default=HERE / "results" / "baselines" / "cpu.json")
    parser.add_argument("--out", type=Path, default=Path("results/gate/reliability.json"))
    args = parser.parse_args(argv)
    code = commit()  # read before anything is written
    reference_commit = load_baseline(args.baseline)["metadata"]["commit"]
    metadata = environment("cpu") | {
        "commit": code,
        "reference": reference_commit,
        "command": "python benchmarks/gate_reliability.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "baseline": str(args.baseline),
        "rounds": args.rounds,
        "pairs": args.pairs,
        "neighbour": args.neighbour,
    }
    rows = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        try:
            reference = materialise(reference_commit, work / "reference")
        except NoReference as error:  # the gate would fall back to the committed ratios; this asks the same
            print(f"{error}: the reference is a copy of this checkout", flush=True)
            reference, metadata["reference"] = copied(work / "reference"), f"a copy of {code}"
        heads = (
            {"as committed": HERE}
            | {f"forward x {factor}": copied(work / f"plant-{factor}", factor) for factor in args.plants}
            | {
                f"both forwards x {factor}": copied(work / f"shared-{factor}", factor, tuple(PLANTED))
                for factor in args.shared_plants
            }
        )
        for i in range(args.runs):
            busy = args.busy[i % len(args.busy)]
            for name, source in heads.items():
                verdict = gated(source, reference, busy, args.rounds, args.pairs, args.neighbour)
                regressed = verdict["exit"] == 1
                rows.append({"run": i + 1, "busy": busy, "code": name, "regressed": regressed} | verdict)
                measured = ", ".join(
                    f"{c['measured']:.4f} [{c['low']:.4f}, {c['high']:.4f}] vs {c['baseline']:.4f}"
                    for c in verdict["time"]
                )
                measured += "; layers vs reference " + ", ".join(
                    "/".join(f"{p:.3f}" for p in c["pairs"]) for c in verdict["layer_time"]
                )
                print(f"run {i + 1}, {busy} busy, {name}: {measured}; regression: {regressed}", flush=True)
                summary = _written(
                    args.out, metadata, rows, list(heads)
                )  # after every gate: a stop keeps them
    print(json.dumps(summary))
    return 1 if summary["false_alarms"] or any(summary["missed"].values()) else 0


def _written(out: Path, metadata: dict, rows: list[dict], heads: list[str]) -> dict:
    """The counts so far, written with the gates' rows; the counts."""
    summary = {
        "runs": max(row["run"] for row in rows),
        "false_alarms": sum(r["regressed"] for r in rows if r["code"] == "as committed"),
        "missed": {name: sum(not r["regressed"] for r in rows if r["code"] == name) for name in heads[1:]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps({"metadata": metadata, "summary": summary, "rows": rows}, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(main())
