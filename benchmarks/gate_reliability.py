"""How often the CPU gate cries wolf, and how often it sleeps through a regression, measured.

Runs ``switchbench speed --quick`` N times, alternately beside each count of busy processes given (each spins a
core until the run ends), and checks every run with ``switchbench check`` three ways:

- against the committed baseline: a failure is a false alarm (the code did not change);
- against the baseline with its time ratios x 0.7 (the issue's 30% regression): a pass is a miss;
- against the baseline with its time ratios / 1.3 (a SwitchHead layer 30% slower): a pass is a miss.

    python benchmarks/gate_reliability.py --runs 6 --busy 4 6 --out results/gate/reliability.json

It prints one line per run and writes the runs, the verdicts and the counts as JSON with the environment and
commit. Wall time: about 15 s a run on a quiet 2-core machine, about 4 times that beside 6 busy processes.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from switchbench.bench.timing.gate import TIME
from switchbench.core.environment import commit, environment
from switchbench.core.results import write_atomic

CLI = [sys.executable, "-m", "switchbench"]
BUSY = "while True:\n    pass\n"
REGRESSIONS = {"time ratios x 0.7": 0.7, "SwitchHead 30% slower (time ratios / 1.3)": 1 / 1.3}


def scaled(baseline: dict, factor: float) -> dict:
    """``baseline`` with every time ratio multiplied by ``factor``: what a run of code that regressed looks like
    against the true baseline."""
    ratios = {
        key: entry | ({TIME: entry[TIME] * factor} if TIME in entry else {})
        for key, entry in baseline["ratios"].items()
    }
    return baseline | {"ratios": ratios}


def timed_run(out: Path, busy: int) -> Path:
    """One quick speed run beside ``busy`` spinning processes; the run's JSON."""
    spinners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        done = subprocess.run(
            [*CLI, "speed", "--quick", "--out", str(out), "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return Path(json.loads(done.stdout)["saved"])


def check(run: Path, baseline: Path) -> dict:
    """``switchbench check``'s exit code and its time verdicts (medians, intervals, limits)."""
    done = subprocess.run(
        [*CLI, "check", str(run), "--baseline", str(baseline), "--json"], capture_output=True, text=True
    )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"switchbench check exited {done.returncode}: {done.stderr.strip()}")
    checks = [c for c in json.loads(done.stdout)["checks"] if c["quantity"] == TIME]
    return {"exit": done.returncode, "time": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument(
        "--busy", type=int, nargs="+", default=[4, 6], help="busy processes, in turn (default 4 6)"
    )
    parser.add_argument("--baseline", type=Path, default=Path("results/baselines/cpu.json"))
    parser.add_argument("--out", type=Path, default=Path("results/gate/reliability.json"))
    args = parser.parse_args(argv)
    baseline = json.loads(args.baseline.read_text())
    code = commit()  # read before anything is written
    rows = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        baselines = {"committed": args.baseline}
        for i, (name, factor) in enumerate(REGRESSIONS.items()):
            baselines[name] = work / f"regressed-{i}.json"
            baselines[name].write_text(json.dumps(scaled(baseline, factor)))
        for i in range(args.runs):
            busy = args.busy[i % len(args.busy)]
            run = timed_run(work / f"run-{i}", busy)
            verdicts = {name: check(run, path) for name, path in baselines.items()}
            row = {
                "run": i + 1,
                "busy": busy,
                "false_alarm": verdicts["committed"]["exit"] == 1,
                "missed": [name for name in REGRESSIONS if verdicts[name]["exit"] == 0],
                "time": verdicts["committed"]["time"],
            }
            rows.append(row)
            medians = ", ".join(f"{c['measured']:.4f} [{c['low']:.4f}, {c['high']:.4f}]" for c in row["time"])
            print(
                f"run {i + 1}, {busy} busy: {medians}; false alarm: {row['false_alarm']}; missed: {row['missed']}"
            )
    summary = {
        "runs": len(rows),
        "false_alarms": sum(r["false_alarm"] for r in rows),
        "missed": {name: sum(name in r["missed"] for r in rows) for name in REGRESSIONS},
    }
    metadata = environment("cpu") | {
        "commit": code,
        "command": "python benchmarks/gate_reliability.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "baseline": str(args.baseline),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"metadata": metadata, "summary": summary, "rows": rows}, indent=2))
    print(json.dumps(summary))
    return 1 if summary["false_alarms"] or any(summary["missed"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
