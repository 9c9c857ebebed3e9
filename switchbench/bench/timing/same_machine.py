"""The gate measured against a reference timed on this machine, in this run: ``switchbench gate``.

A CPU time ratio of two layers belongs to the processor as much as to the code: SwitchHead/dense at the gate's
shapes moved by about a quarter between two 2-core Xeon VMs (0.556 and 0.687 forward+backward), more than the
gate's tolerance. So, as asv's ``continuous`` does, the gate times both versions here: the commit that recorded
the baseline is materialised from git into a temporary folder, and ``switchbench speed --quick`` runs from it and
from the code under test side by side, a process each at once, so that whatever the machine does then falls on
both. Time ratios are then gated against the reference's, measured at the same moment on the same processor, and
so is each layer's time, which a slowdown both layers share moves while their ratio stands still; what a run
counts (operator calls) against the reference's too, what the cost formulas count against the committed numbers.
A time that comes out a regression is timed again (a second look, as many pairs more) before the gate fails: a
neighbour's burst of memory traffic can fall on one side's runs more than the other's.

Where the commit is not in this checkout's history (a shallow clone, a copy without ``.git``), the package comes
from the archive committed beside the baseline (``reference.py``); only without either does the gate fall back to
the committed ratios, with the tolerance ``gate.time_tolerance`` gives them on this machine, and say so.
"""

import atexit
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from switchbench.bench.timing import gate
from switchbench.bench.timing.reference import HERE, NoReference, materialise, unpack_archive
from switchbench.core.environment import cpu_fingerprint, describe_machine
from switchbench.core.results import writable_folder

# Runs `switchbench` from the folder given as the first argument, and proves that is where it was imported from:
# an editable install or a stray folder on the path must not stand in for the version asked for. An editable
# install's finder would also supply any module the folder lacks (a reference older than one of today's modules
# ran as a hybrid), so every finder that places switchbench elsewhere is removed first.
LAUNCH = """\
import importlib.machinery, runpy, sys
source = sys.argv.pop(1)
sys.path.insert(0, source)
def elsewhere(finder):
    if finder is importlib.machinery.PathFinder:  # sys.path's, which reads the folder first
        return False
    spec = getattr(finder, "find_spec", lambda *args: None)("switchbench", None)
    return spec is not None and not (spec.origin or "").startswith(source)
sys.meta_path[:] = [finder for finder in sys.meta_path if not elsewhere(finder)]
try:
    import switchbench
except ImportError:
    sys.exit(f"no switchbench package in {source}")
if not switchbench.__file__.startswith(source):
    sys.exit(f"switchbench came from {switchbench.__file__}, not from {source}")
runpy.run_module("switchbench", run_name="__main__", alter_sys=True)
"""
# The timed runs are forked from a server that has imported torch and torch._dynamo (which the first call of a
# custom op imports): 3.7 s of a 15 s run in a fresh interpreter. Never switchbench: each run imports its own, by
# LAUNCH (so not multiprocessing's forkserver: one per process, whose preload the rehearsal sets to switchbench's
# own command line). One request a line: [LAUNCH's arguments, environment, stdout file, stderr file]; the answer,
# the exit code.
SERVER = """\
import json, os, sys, traceback
import torch, torch._dynamo
launch = sys.argv[1]
for line in sys.stdin:
    argv, env, out, err = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-c", *argv]
        code = 0
        try:
            exec(launch, {"__name__": "__main__"})
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:  # sys.exit("message"), as the interpreter ends it
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
PAIRS = 2
ROUNDS = 10  # per run: two pairs pool 20 a side (the committed baseline's runs had 30; 15 s less in tox)


def timed_run(source: Path, out: Path, rounds: int, commit: str | None = None) -> dict:
    """One ``switchbench speed --quick`` of the package in ``source``, in a process of its own; the run."""
    env = os.environ | ({"SWITCHBENCH_COMMIT": commit} if commit else {})
    speed = ["speed", "--quick", "--rounds", str(rounds), "--out", str(out), "--json"]
    with tempfile.TemporaryDirectory(prefix="switchbench-run-") as work:
        stdout, stderr = Path(work, "stdout"), Path(work, "stderr")
        code = _server(source).run([str(source), *speed], env, stdout, stderr)
        if code:  # no run, no verdict: unusable input (exit 2), as a run that measured nothing
            last = stderr.read_text().strip().splitlines()[-1:] or [f"exit {code}"]
            raise ValueError(f"the speed run of {source} failed: {last[0]}")
        try:
            saved = json.loads(stdout.read_text())["saved"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"the speed run of {source} printed no run JSON (with 'saved') on stdout"
            ) from None
    return gate.load_run(Path(saved))[1]


class _Server:
    """The fork server of SERVER, started at the first run and ended with this process."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, LAUNCH], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        atexit.register(self.close)

    def run(self, argv: list[str], env: dict, stdout: Path, stderr: Path) -> int:
        self.process.stdin.write(json.dumps([argv, dict(env), str(stdout), str(stderr)]) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the gate's fork server ended (exit {self.process.wait()})")
        return int(answer)

    def close(self) -> None:
        self.process.stdin.close()  # the server's loop ends
        self.process.wait()
        self.process.stdout.close()


@functools.cache
def _server(source: Path) -> _Server:
    """A server per side: the two runs of a pair are forked at once."""
    return _Server()


def side_by_side(
    head: Path, reference: Path, commit: str, out: Path, pairs: int, rounds: int, first: int = 1
):
    """``pairs`` runs of the code under test and of the reference, the two of a pair side by side (a process each,
    at once: whatever the machine does then falls on both), numbered from ``first``; -> the runs of each side, pair
    by pair."""
    sides = {"head": (head, None), "reference": (reference, commit)}
    runs = {side: [] for side in sides}
    with ThreadPoolExecutor(len(sides)) as pool:
        for p in range(first, first + pairs):
            started = {
                side: pool.submit(timed_run, source, out / f"{side}-{p}", rounds, tag)
                for side, (source, tag) in sides.items()
            }
            for side, run in started.items():
                runs[side].append(run.result())
    return runs["head"], runs["reference"]


def pooled(runs: list[dict]) -> dict:
    """Several runs of one benchmark as one: each time ratio's rounds together, its median over all of them."""
    rows = []
    for same in zip(*(run["rows"] for run in runs), strict=True):
        if len({gate.row_key(r) for r in same}) > 1:  # one benchmark writes its rows in one order
            raise ValueError(f"the runs' rows differ: {sorted({gate.row_key(r) for r in same})}")
        failed = [r for r in same if r["status"] != "ok"]
        if failed:  # a row one run did not measure is not measured: its verdicts say so
            rows.append(dict(failed[0]))
            continue
        row = dict(same[0])
        if gate.TIME in row:
            row["ratio_time_rounds"] = [r for each in same for r in each["ratio_time_rounds"]]
            row[gate.TIME] = statistics.median(row["ratio_time_rounds"])
        rows.append(row)
    metadata = runs[0]["metadata"] | {"runs": len(runs), "rounds": [r["metadata"]["rounds"] for r in runs]}
    return {"metadata": metadata, "rows": rows}


def register(commands) -> None:
    """The ``gate`` command."""
    parser = commands.add_parser(
        "gate",
        help="time this code and the baseline's commit here, side by side, and gate the speedups: exit 0 pass, "
        "1 regression, 2 unusable input",
    )
    parser.add_argument("--baseline", default="results/baselines/cpu.json", help="default: %(default)s")
    parser.add_argument(
        "--reference",
        help="the code to compare against: a commit, or a folder holding a switchbench package (default: the "
        "baseline's commit)",
    )
    parser.add_argument("--pairs", type=int, default=PAIRS, help="runs of each side (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="timed rounds per run (default %(default)s)"
    )
    parser.add_argument("--out", help="keep every run under this folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    baseline = gate.load_baseline(args.baseline)
    if args.pairs < 1 or args.rounds < 6:
        raise ValueError("--pairs must be >= 1 and --rounds >= 6 (fewer rounds give no 95% interval)")
    if args.out:
        writable_folder(Path(args.out), "--out")
    with tempfile.TemporaryDirectory(prefix="switchbench-gate-") as work:
        out = Path(args.out) if args.out else Path(work)
        reference, commit, why = _reference(args.reference, baseline, args.baseline, Path(work) / "reference")
        if reference is None:
            head = timed_run(HERE, out / "head-1", args.rounds * args.pairs)
            verdicts, against = gate.check(head, baseline), _fallback(why, baseline, head)
        else:
            heads, references = side_by_side(HERE, reference, commit, out, args.pairs, args.rounds)
            head, verdicts = _side_by_side_verdicts(heads, references, baseline)
            second_look = _timing_regressed(verdicts)
            if second_look:  # timed again before crying wolf
                more = side_by_side(
                    HERE, reference, commit, out, args.pairs, args.rounds, first=args.pairs + 1
                )
                heads, references = heads + more[0], references + more[1]
                first_look = verdicts
                head, verdicts = _side_by_side_verdicts(heads, references, baseline, args.pairs)
                _held_to_the_first_look(verdicts, first_look)
            against = (
                f"reference: {commit or reference}{f' ({why})' if why else ''}, timed here side by side with "
                f"{HERE} ({len(heads)} runs of {args.rounds} rounds each); the committed time ratios, recorded "
                f"on {_machine(baseline['metadata'])}, are not used; " + _layer_times(args.pairs, second_look)
            )
    applied = gate.tolerances_applied(
        baseline, head["metadata"].get("machine"), side_by_side=reference is not None
    )
    about = {"baseline": args.baseline, "machine": cpu_fingerprint(), "tolerances": applied}
    if reference is not None:
        about["second_look"] = second_look
    return gate.print_verdicts(verdicts, against, about, args.json)


def _side_by_side_verdicts(
    heads: list[dict], references: list[dict], baseline: dict, first_look: int | None = None
) -> tuple[dict, list[dict]]:
    """This code's runs pooled, and every verdict against the reference's runs timed beside them (the layer times'
    after a second look: see :func:`~switchbench.bench.timing.gate.layer_time_verdicts`)."""
    head = pooled(heads)
    verdicts = gate.check(head, baseline, reference=pooled(references))
    return head, verdicts + gate.layer_time_verdicts(heads, references, baseline, first_look)


def _timing_regressed(verdicts: list[dict]) -> bool:
    """Whether a time (a ratio's, or a layer's against the reference's) is a regression. A neighbour's burst of
    memory traffic can fall on one side's run more than the other's: beside a test suite's workers, unchanged code
    read 1.19 to 1.25 times the reference's layer times in both pairs, and 0.91 to 0.97 a few minutes later. A
    slowdown of the code stays in the pairs timed again; such a burst seldom does."""
    return any(
        v["verdict"] == "REGRESSION" and v["quantity"] in (gate.TIME, gate.LAYER_TIME) for v in verdicts
    )


def _held_to_the_first_look(verdicts: list[dict], first_look: list[dict]) -> None:
    """After a second look, a time ratio is a regression only where the first look's was one too: four runs'
    rounds pooled give a narrower interval than two, and a look started by a layer time must not fail a ratio that
    passed on its own. (The layer times are held so by their own rule.)"""
    before = {(v["ratio"], v["quantity"]): v["verdict"] for v in first_look}
    for v in verdicts:
        key, regressed = (v["ratio"], v["quantity"]), v["verdict"] == "REGRESSION"
        if v["quantity"] == gate.TIME and regressed and before.get(key) != "REGRESSION":
            v["verdict"], v["note"] = "ok", NOT_IN_THE_FIRST_LOOK


NOT_IN_THE_FIRST_LOOK = "past the limit only with the second look's rounds pooled in, not in the first look's"


def _layer_times(pairs: int, second_look: bool = False) -> str:
    if pairs < gate.MIN_PAIRS:
        return f"no {gate.LAYER_TIME} (one pair cannot tell noise from a slowdown: --pairs {gate.MIN_PAIRS} or more)"
    what = (
        f"{gate.LAYER_TIME}: a layer's median time over the reference's, pair by pair; a regression where every "
        "pair is past the limit, the least of them shown"
    )
    if not second_look:
        return what
    return (
        f"{what}. A time regressed in the first {pairs} pairs, so {pairs} more were timed (a second look): the "
        f"ratios are decided over all {2 * pairs} runs' rounds, where they regressed in the first look too, and a "
        f"{gate.LAYER_TIME} where every pair of the first look and the median of all {2 * pairs} are past the "
        "limit, the median shown"
    )


def _reference(
    named: str | None, baseline: dict, baseline_path: str, dest: Path
) -> tuple[Path | None, str | None, str | None]:
    """The folder to run the reference from, its commit and where it came from when not from git; or (None, None,
    why there is none)."""
    if named and Path(named).is_dir():
        lacking = [
            f
            for f in ("__init__.py", "__main__.py", "cli.py")
            if not (Path(named) / "switchbench" / f).is_file()
        ]
        if lacking:
            raise ValueError(f"--reference {named}: no switchbench package in this folder (no {lacking[0]})")
        return Path(named).resolve(), None, None
    if named and Path(named).exists():
        raise ValueError(
            f"--reference {named}: a file; give a commit or a folder holding a switchbench package"
        )
    try:
        commit = named or gate.commit_of(baseline["metadata"])  # the rule check --write archived by
    except NoReference as error:
        return None, None, str(error)
    try:
        return materialise(commit, dest), commit, None
    except NoReference as error:
        if named and "/" in named:  # a folder that is not there (or a ref git does not know)
            raise ValueError(f"--reference {named}: no such folder, and no commit of this history") from None
        if named:
            raise ValueError(f"--reference {named}: {error}") from None
        from_git = str(error)
    shipped = baseline.get("reference_archive")
    if not shipped:
        return None, None, f"{from_git}; the baseline names no archive of its package"
    archive = Path(baseline_path).parent / shipped["file"]
    try:
        return unpack_archive(archive, shipped["sha256"], dest), commit, f"from {archive}: {from_git}"
    except NoReference as error:
        return None, None, f"{from_git}; {error}"


def _fallback(why: str, baseline: dict, head: dict) -> str:
    """What the gate compared against without a reference run: the tolerance ``gate.check`` applied to ``head``."""
    tolerance, machine = gate.time_tolerance(baseline, head["metadata"].get("machine"))
    return (
        f"reference: the committed time ratios ({why}), recorded on {_machine(baseline['metadata'])}; {machine}, "
        f"so time ratios are gated with a tolerance of {tolerance:.0%}"
    )


def _machine(metadata: dict) -> str:
    fingerprint = metadata.get("machine")
    if not fingerprint:
        return "a machine the baseline does not name"
    return describe_machine(fingerprint)
