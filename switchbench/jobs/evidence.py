"""``switchbench evidence``: every figure a GPU owes, from one command that can be stopped and resumed.

GPU time comes in short slices on nodes without internet. The chain runs its steps
(:mod:`~switchbench.jobs.evidence_steps`) in order of value (figures first, the report last), each as
``switchbench`` (or pytest) subprocesses, and keeps a state
file beside the results: a second call skips the steps already done for the same code and resumes after the
last one. ``--budget`` is the call's time (see ``run_chain`` and ``fits``): a step whose expected duration does not
fit waits for a later call while the steps after it run, the first step of a call runs whatever its estimate
where no step after it fits, a step that reads another's output waits until that one is done, and a step that
runs past the budget less the report's reserve is stopped (a resumable one continues in the next call, any other
starts again). What each step wrote is listed in the state, so ``--pack`` can put this device's evidence into one
archive to bring back.

"The same code" is a fingerprint of the package's and the tests' Python files and pyproject.toml, not the git
commit: committing the results a node brought back must not make the node run everything again, and a node's
copy of the checkout may have no git history at all.

On the CPU the same chain runs on tiny presets in seconds (a rehearsal of its logic; its numbers stand for
nothing), and the steps that need CUDA are reported as missing.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from switchbench.bench.command import Distinct, add_json, device_from_args, slug
from switchbench.bench.kernels import tune
from switchbench.core import schema
from switchbench.core.environment import commit, device_name, environment
from switchbench.core.results import replace_atomically, writable_file, writable_folder, write_atomic
from switchbench.jobs import evidence_steps, processes
from switchbench.jobs.evidence_steps import (
    REPORT,
    ROOT,
    STEPS,
    Context,
    FailedAtItsEnd,
    OutOfBudget,
    Step,
    StepFailed,
)

# State: what is done for this code, on this device


def load_state(path: Path, code: str) -> dict:
    """The state of this device's chain for ``code``. The steps done for other code are kept as ``earlier`` (their
    figures stand, at their commit, until measured again) and every duration as an estimate."""
    state = _checked_state(path, schema.read_json(path, "chain state")) if path.exists() else {}
    if state.get("fingerprint") == code:
        return {"earlier": {}, "steps": {}, "durations": {}} | state
    steps = state.get("steps", {})
    done = {name: r for name, r in steps.items() if r.get("status") == "done"}
    earlier = state.get("earlier", {}) | done
    # a step that last failed has no duration but where it failed at its end: its declared estimate, which new code
    # may have changed, stands (older chains recorded the estimate of the day as a failed step's duration)
    durations = {
        n: d
        for n, d in state.get("durations", {}).items()
        if steps.get(n, {}).get("status") != "failed" or steps[n].get("ran_through")
    }
    return {"fingerprint": code, "steps": {}, "durations": durations, "earlier": earlier}


def _checked_state(path: Path, state) -> dict:
    """The state file's content, each part of its kind: an edited or damaged file is named before any step."""
    schema.check_fields(path, state, {"fingerprint": schema.TEXT}, "the state", optional=("fingerprint",))
    for part, kind in (("steps", schema.OBJECT), ("earlier", schema.OBJECT), ("durations", schema.NUMBER)):
        schema.check_fields(path, state, {part: schema.OBJECT}, "the state", optional=(part,))
        entries = state.get(part, {})
        schema.check_fields(path, entries, dict.fromkeys(entries, kind), part)
    for name, record in state.get("steps", {}).items():
        schema.check_fields(path, record, {"status": schema.TEXT}, f"steps: {name}")
        timed = {"seconds": schema.NUMBER, "spent": schema.NUMBER}
        schema.check_fields(path, record, timed, f"steps: {name}", optional=tuple(timed))
        for field in timed.keys() & record.keys():
            _check_seconds(path, f"steps: {name}: {field}", record[field])
    for name, seconds in state.get("durations", {}).items():
        _check_seconds(path, f"durations: {name!r}", seconds)
    return state


def _check_seconds(path: Path, what: str, seconds: float) -> None:
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_DURATION):  # NaN or 1e308: --list never ends
        raise ValueError(f"{path}: {what} must be seconds in [0, {MAX_DURATION:g}]; got {seconds}")


MAX_DURATION = 7 * 24 * 3600.0  # a week: no step of the chain is near it


def _save_state(path: Path, state: dict) -> None:
    write_atomic(path, json.dumps(state, indent=2))


def _snapshot(roots: list[Path]) -> dict[Path, tuple[int, int]]:
    """Each file among ``roots`` (files, or folders searched whole) with its time and size."""
    files = {}
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else [root]:
            if path.is_file() and not path.name.endswith(".tmp"):
                stat = path.stat()
                files[path] = (stat.st_mtime_ns, stat.st_size)
    return files


def _written(before: dict, after: dict) -> list[str]:
    return sorted(str(path) for path, stamp in after.items() if before.get(path) != stamp)


# The chain


def plan(
    state: dict, device: str, only: list[str] | None, retry_failed: bool
) -> tuple[list[Step], list[str]]:
    """The steps this call will try, in order, and a line for each step it leaves out and why."""
    todo, notes = [], []
    for step in STEPS:
        done = state["steps"].get(step.name, {})
        if only and step.name not in only:
            continue
        if step.needs_gpu and device != "cuda":
            notes.append(f"{step.name}: needs a CUDA GPU")
        elif done.get("status") == "done":
            notes.append(f"{step.name}: done for this code ({done.get('finished', 'when: not recorded')})")
        # a failed step named in --only is asked for by name: it runs again
        elif done.get("status") == "failed" and not (retry_failed or only):
            notes.append(
                f"{step.name}: failed for this code ({done.get('detail') or 'why: not recorded'}); --retry-failed runs it again"
            )
        else:
            todo.append(step)
    # A GPU comes in short slices and the code moves between them: figures never measured on this device come
    # before figures measured for earlier code, each in order of value
    earlier = state.get("earlier", {})
    return [s for s in todo if s.name not in earlier] + [s for s in todo if s.name in earlier], notes


def expected_seconds(step: Step, state: dict, device: str) -> float:
    """The step's last duration on this device, else its declared estimate."""
    return state["durations"].get(step.name, step.gpu_seconds if device == "cuda" else step.cpu_seconds)


MIN_PROGRESS = 60.0  # seconds left for which a resumable step is still started: what it does is kept
EXIT_RESERVE = 15.0  # seconds, at most a twentieth of the budget


def exit_reserve(budget: float) -> float:
    """Seconds kept at the end of every call, after the report: stopping a step's processes, the archive, the exit.
    Without it a call with no report ran its last step to the budget itself, and the node's own time limit fell
    before the archive was written."""
    return min(EXIT_RESERVE, budget / 20)


def fits(step: Step, need: float, left: float, first: bool) -> bool:
    """Whether to start ``step`` (expected to need ``need`` s) with ``left`` s before the steps' deadline.
    ``first``: the call's first step, with no step after it that fits, gets its chance, so a step estimated longer
    than any call still runs (and its true duration is learnt); a resumable step starts whenever it can make some
    progress."""
    return first or need <= left or (step.resumable and left >= MIN_PROGRESS)


def schedule(
    steps: list[Step], need: Callable[[Step], float], budget: float, reserve: float
) -> list[list[Step]]:
    """The calls of ``budget`` s that ``steps`` take if each lasts what ``need`` says (the report's ``reserve``
    kept at each call's end): ``run_chain``'s decisions played out on the estimates. A resumable step is continued
    by the next call; a step that cannot end within one call is left out (it would be stopped every time)."""
    room = budget - reserve - exit_reserve(budget)
    left_over = {s.name: need(s) for s in steps}
    pending = [s for s in steps if s.resumable or left_over[s.name] <= room]
    calls = []
    while pending and room > 0:
        call, left = [], room
        for step in list(pending):
            if _after_pending(step, pending):  # as run_chain: it waits until what it reads is done
                continue
            rest = [s for s in pending[pending.index(step) + 1 :] if not _after_pending(s, pending)]
            alone = not call and not any(fits(s, left_over[s.name], left, False) for s in rest)
            if left <= 0 or not fits(step, left_over[step.name], left, alone):
                continue
            call.append(step)
            spent = min(left_over[step.name], left)
            left, left_over[step.name] = left - spent, left_over[step.name] - spent
            if left_over[step.name] <= 0:
                pending.remove(step)
        calls.append(call)
    return calls


def _after_pending(step: Step, pending: list[Step]) -> bool:
    return any(s.name in step.after for s in pending)


def run_chain(
    ctx: Context,
    state_path: Path,
    budget: float,
    only: list[str] | None = None,
    retry_failed: bool = False,
    say=print,
    after_step: Callable[[dict], object] = lambda state: None,
) -> dict:
    """Run what is left within ``budget`` seconds. Steps are stopped at the budget less the report's reserve; the
    report (when anything ran) has that reserve at the end, so the call ends within its budget. ``after_step``
    gets the state after each step but the report (the archive is rewritten there: a call killed from outside
    keeps the steps it finished)."""
    state = load_state(state_path, evidence_steps.fingerprint())
    state["environment"] = environment(ctx.device)  # this call's versions, in the archive whatever else is
    todo, notes = plan(state, ctx.device, only, retry_failed)
    say(f"evidence chain on {device_name(ctx.device)} (code {state['fingerprint']}), budget {budget:.0f} s")
    for note in notes:
        say(f"  skip   {note}")
    for step in todo:
        say(f"  to do  {step.name} (~{expected_seconds(step, state, ctx.device):.0f} s): {step.owes}")
    started = time.monotonic()
    end = started + budget - exit_reserve(budget)
    report, reserve = _report_step(only), _report_reserve(only, state, ctx.device)
    ctx.deadline = end - reserve
    ran = []
    # a step named by --only is asked for by name: it runs whatever it did before
    steps = [
        s
        for s in todo
        if s.name != REPORT
        and (s.name in (only or ()) or not _outgrew_a_call(s, state, end - reserve - started))
    ]
    for step in [s for s in todo if s.name != REPORT]:
        left = ctx.deadline - time.monotonic()
        need = expected_seconds(step, state, ctx.device)
        if step not in steps:
            say(
                f"  never  {step.name}: stopped with a whole call to itself; raise --budget, split it, or name it "
                "with --only"
            )
            continue
        waiting = _waiting_for(step, state)
        if waiting:  # it would run on what they left half made, and count as done
            say(f"  waits  {step.name}: for {', '.join(waiting)}")
            continue
        # the call's first step runs whatever its estimate only where no step after it fits: a short call spent
        # on a step that cannot end in it brings nothing back
        rest = [s for s in steps[steps.index(step) + 1 :] if not _waiting_for(s, state)]
        alone = not ran and not any(
            fits(s, expected_seconds(s, state, ctx.device), left, False) for s in rest
        )
        if left <= 0 or not fits(step, need, left, alone):
            say(f"  later  {step.name}: needs about {need:.0f} s, {max(left, 0):.0f} s of this call left")
            continue
        ran.append(_run_step(step, ctx, state, state_path, say, after_step, whole_call=not ran))
        after_step(state)
    if report and (ran or report in todo):
        ctx.deadline = end
        _run_step(report, ctx, state, state_path, say)  # the caller packs once the call ends
    missing = missing_figures(state, ctx.device)
    say("still missing:" if missing else "every figure of the chain is done for this code")
    for line in missing:
        say(f"  {line}")
    return state


def _waiting_for(step: Step, state: dict) -> list[str]:
    """The steps whose output ``step`` reads that are done neither for this code nor for earlier code."""
    done = {n for n, r in state["steps"].items() if r.get("status") == "done"} | set(state.get("earlier", {}))
    return [name for name in step.after if name not in done]


def _report_step(only: list[str] | None) -> Step | None:
    """The report step, when the call runs it (at its end, in the time kept for it)."""
    return next((s for s in STEPS if s.name == REPORT), None) if not only or REPORT in only else None


def _report_reserve(only: list[str] | None, state: dict, device: str) -> float:
    """Seconds kept at a call's end for its report: none where the call runs no report."""
    report = _report_step(only)
    return expected_seconds(report, state, device) if report else 0.0


def check_budget(
    budget: float, state: dict, device: str, only: list[str] | None, named: str | None = None
) -> None:
    """A one-line ValueError when a call of ``budget`` s leaves its steps no time: all of it kept for the report
    and the exit (every call would run nothing but the report). ``named``: how the refusal names the budget."""
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"--budget must be a finite number of seconds > 0; got {budget}")
    if budget > MAX_DURATION:  # past what a process's timeouts take: every step failed, recorded as failed
        raise ValueError(f"--budget must be at most {MAX_DURATION:g} s (a week); got {budget:g}")
    named = named or f"--budget {budget:g} s"
    reserve = _report_reserve(only, state, device)
    # the report alone: its time is the call's
    if only == [REPORT] and budget - exit_reserve(budget) < reserve:
        raise ValueError(
            f"{named} leaves the report too little time: it takes about {reserve:.0f} s, and "
            f"{exit_reserve(budget):.0f} s are kept for the exit"
        )
    if only != [REPORT] and budget - exit_reserve(budget) - reserve <= 0:
        raise ValueError(
            f"{named} leaves the steps no time: {reserve:.0f} s are kept for the report and "
            f"{exit_reserve(budget):.0f} s for the exit"
        )


ROOM_TO_RETRY = 1.25  # a step stopped with a whole call is tried again in a call this much longer than it had


def _outgrew_a_call(step: Step, state: dict, room: float) -> bool:
    """Whether ``step`` was stopped by the budget though it had a whole call to itself, about as long as a call's
    ``room`` now, and cannot go on from where it stopped: trying again would take every call and bring nothing."""
    record = state["steps"].get(step.name, {})
    stopped = record.get("status") == "interrupted" and record.get("whole_call", False)
    return stopped and not step.resumable and room < ROOM_TO_RETRY * record.get("seconds", 0.0)


# A step's status after each of its commands until it ends: what a call killed from outside leaves in its archive
KILLED = "killed"
UNFINISHED = ("interrupted", "failed", KILLED)


def _files(step: Step, earlier_run: dict, before: dict, roots: list[Path]) -> list[str]:
    """What ``step`` wrote since ``before``; a resumable step's earlier calls kept what they wrote too (a test
    part's logs): it is still what the step owes."""
    files = _written(before, _snapshot(roots))
    if step.resumable and earlier_run.get("status") in UNFINISHED:
        files = sorted(set(earlier_run.get("files", [])) | set(files))
    return files


def _spent(step: Step, earlier_run: dict, seconds: float) -> float:
    """The step's time: a resumable step finished over two calls lasts both (a failed one's retry starts afresh)."""
    resumed = step.resumable and earlier_run.get("status") in ("interrupted", KILLED)
    return round(seconds + (earlier_run.get("spent", earlier_run.get("seconds", 0.0)) if resumed else 0.0), 1)


def _run_step(
    step: Step,
    ctx: Context,
    state: dict,
    state_path: Path,
    say,
    after_step: Callable[[dict], object] = lambda state: None,
    whole_call: bool = False,
) -> str:
    """Run ``step`` and record how it ended; ``whole_call``: it is the call's first step, the whole call its own.
    After each of its commands the step so far is recorded as unfinished and ``after_step`` gets the state, as
    run_chain gives it after each step (the archive is rewritten there): a call killed mid-step keeps what the step's finished commands wrote and the log
    of the one it was in."""
    say(f"== {step.name}: {step.owes}")
    # what a step may write: figures, models, and the package's tables of what kernel-tune measured
    roots = [ctx.results, ctx.runs, tune.TABLE, tune.AUTO_TABLE]
    before, started = _snapshot(roots), time.monotonic()
    record = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit()}
    earlier_run = state["steps"].get(step.name, {})

    def so_far() -> None:
        killed = {
            "status": KILLED,
            "detail": "the call ended during the step (killed from outside)",
            "seconds": round(time.monotonic() - started, 1),
            "files": _files(step, earlier_run, before, roots),
        }
        state["steps"][step.name] = record | killed | {"spent": _spent(step, earlier_run, killed["seconds"])}
        try:
            _save_state(state_path, state)
            after_step(state)
        except OSError as error:  # the figures are on disk: a step goes on without this copy of its progress
            say(f"   (the state or archive not rewritten after a command: {error})")

    ctx.step, ctx.after_command = step.name, so_far
    stopped, ran_through = None, False
    try:
        step.run(ctx)
        status, detail = "done", ""
    except OutOfBudget:
        status, detail = "interrupted", "stopped at the end of the budget"
    except (Stopped, KeyboardInterrupt) as error:  # recorded, with what it wrote, before the chain stops
        ctx.stop()  # the commands of the step's other threads, which the signal did not reach
        stopped, status, detail = error, "interrupted", f"stopped by {_signal_name(error)}"
    except StepFailed as error:
        status, detail = "failed", str(error)
        ran_through = isinstance(error, FailedAtItsEnd)
    except Exception as error:  # a fault in the step's own code: the chain goes on, and the call still packs
        say(traceback.format_exc().rstrip())
        status, detail = (
            "failed",
            f"{type(error).__name__}: {error} (in the step's own code; traceback in the log)",
        )
    seconds = time.monotonic() - started
    detail, *shown = detail.split("\n")  # a failed command's last lines are printed, not kept in the state
    record |= {
        # stopped by a signal, not by the budget: no lesson on the step's length
        "whole_call": whole_call and stopped is None,
        "status": status,
        "detail": detail,
        "ran_through": ran_through,
        "seconds": round(seconds, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "files": _files(step, earlier_run, before, roots),
    }
    ctx.after_command = lambda: None
    record["spent"] = _spent(step, earlier_run, seconds)
    state["steps"][step.name] = record
    if status == "done":
        state.get("earlier", {}).pop(step.name, None)
    estimate = record["spent"]
    if status == "interrupted":
        # A resumable step keeps its estimate. Any other needs more than it ran: twice that, so that a step that
        # outgrew its estimate is not started again and again into the same wall (past a call's room it runs
        # as a call's first step, with all of it).
        previous = expected_seconds(step, state, ctx.device)
        estimate = previous if step.resumable else max(2 * seconds, previous)
    # how soon a step failed, or was stopped from outside, says nothing of how long it runs (unless it failed at its
    # end: a test part whose tests ran, some failing)
    if (status != "failed" or ran_through) and stopped is None:
        state["durations"][step.name] = round(estimate, 1)
    _save_state(state_path, state)
    say(f"   {status} in {seconds:.0f} s{': ' + detail if detail else ''}")
    for line in shown:
        say(f"   | {line}")
    if stopped is not None:
        raise stopped
    return status


class Stopped(BaseException):
    """The chain was sent SIGTERM (a node's time limit, a scheduler): the running step is stopped and recorded,
    the archive written, and the call exits. A BaseException, so that no step's own handler takes it for a
    failure."""


def _signal_name(error: BaseException) -> str:
    return "SIGINT" if isinstance(error, KeyboardInterrupt) else "SIGTERM"


def _raise_stopped(signum, frame) -> None:
    # once: a second SIGTERM must not break the recording and packing
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stopped()


def missing_figures(state: dict, device: str) -> list[str]:
    lines = []
    for step in STEPS:
        done = state["steps"].get(step.name, {})
        if done.get("status") != "done":
            why = "needs a CUDA GPU" if step.needs_gpu and device != "cuda" else done.get("status", "not run")
            if step.name in state.get("earlier", {}) and not done:
                why = f"done for earlier code, commit {state['earlier'][step.name].get('commit') or 'not recorded'}"
            lines.append(f"{step.owes} ({step.name}: {why})")
    return lines


def pack(state: dict, state_path: Path, archive: Path, results: Path, runs: Path) -> list[Path]:
    """Every file the chain wrote for this code, its state and its log, in ``archive`` (paths as seen from here);
    each model it trained (a folder of ``runs``, about 10 MB of checkpoint) in an archive of its own beside it,
    ``<archive>-<model>.tar.gz``. The figures stay a small archive wherever what comes back from a node is capped
    per file, and a model travels back only to be trained further or analysed again."""
    files = {Path(f) for record in state["steps"].values() for f in record.get("files", [])}
    files |= {state_path, state_path.with_name("log.txt")}
    models: dict[str, set[Path]] = {}
    runs = runs.resolve()
    for path in list(files):
        if (resolved := path.resolve()).is_relative_to(runs):
            models.setdefault(resolved.relative_to(runs).parts[0], set()).add(path)
            files.discard(path)
    stem = archive.name.removesuffix(".gz").removesuffix(".tar")
    parts = [(archive, files)] + [
        (archive.with_name(f"{stem}-{name}.tar.gz"), paths) for name, paths in sorted(models.items())
    ]
    return [_archive(path, members, (results, runs)) for path, members in parts]


def _archive(archive: Path, files: set[Path], folders: tuple[Path, ...]) -> Path:
    def write(tmp: Path):
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(p for p in files if p.exists()):
                tar.add(path, arcname=_arcname(path, folders))

    return replace_atomically(archive, write)


def _arcname(path: Path, folders: tuple[Path, ...]) -> str:
    """The file's path from here (the checkout, as a node runs the chain), else from the checkout's root or the
    parent of the folder of ``folders`` (--results, --runs) it is in: an archive holds no absolute paths and no
    '..'."""
    path = path.resolve()
    for base in (Path.cwd(), ROOT, *(folder.resolve().parent for folder in folders)):
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return path.name


def register(commands) -> None:
    parser = commands.add_parser(
        "evidence",
        help="every figure a GPU owes: tests, kernels, speed, profile, gate, quality, ListOps, report",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        help="default: cuda when available; on the CPU a rehearsal on tiny presets",
    )
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for this call (default 540)")
    parser.add_argument(
        "--since",
        type=float,
        metavar="EPOCH",
        help="count --budget from this Unix time (`date +%%s` taken before the install), not from the chain's start",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[s.name for s in STEPS],
        metavar="STEP",
        action=Distinct,
        help="these steps alone (--list names them)",
    )
    parser.add_argument("--retry-failed", action="store_true", help="run failed steps again")
    parser.add_argument("--results", default="results", help="where the figures go (default: results)")
    parser.add_argument("--runs", default="runs", help="where the ListOps models are trained (default: runs)")
    parser.add_argument(
        "--pack",
        metavar="FILE.tar.gz",
        help="then write what the chain wrote into one archive, and each model it trained into one beside it",
    )
    parser.add_argument("--list", action="store_true", help="print the plan and what is missing; run nothing")
    parser.add_argument(
        "--node",
        metavar="FOLDER",
        help="with --list: plan a GPU's next calls from the state a node brought back (results/evidence/FOLDER)",
    )
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.list and (args.pack or args.since is not None):  # --retry-failed changes the plan it prints
        raise ValueError("--list runs nothing: --pack and --since go without it")
    device = device_from_args(args.device)
    results = writable_folder(Path(args.results), "--results")
    runs = writable_folder(Path(args.runs), "--runs")
    if args.pack:
        # it is a gzipped tar whatever its name says, and the models' archives beside it are named after it
        if not args.pack.endswith(".tar.gz"):
            raise ValueError(f"--pack {args.pack}: the archive is a gzipped tar; name it FILE.tar.gz")
        writable_file(args.pack, "--pack")
    folder = results / "evidence" / slug(device_name(device))
    if args.node is not None:  # a node's durations and steps done, read here before its next call
        if not args.list or args.device == "cpu":
            raise ValueError(
                "--node plans a node's next calls on its GPU: give it with --list, without --device cpu"
            )
        folder, device = results / "evidence" / args.node, "cuda"
        if not (folder / "state.json").is_file():
            raise ValueError(
                f"--node {args.node}: no {folder / 'state.json'} (unpack the node's archive first)"
            )
    state_path = folder / "state.json"
    state = load_state(state_path, evidence_steps.fingerprint())
    # --list without --device plans a GPU's calls from anywhere; --device cpu lists the CPU rehearsal's
    planned = (args.device or "cuda") if args.list else device
    check_budget(args.budget, state if planned == device else _blank(state), planned, args.only)
    if args.list:
        return _list(args, state, device, planned)
    spent = spent_before(args.since, args.budget)
    budget = args.budget - spent
    if spent:  # what the install left of the call
        named = f"--budget {args.budget:g} s less the {spent:.0f} s spent since --since"
        check_budget(budget, state, device, args.only, named)
    folder.mkdir(parents=True, exist_ok=True)
    ctx = Context(device, results, runs, 0.0, folder / "log.txt")
    stream = sys.stderr if args.json else sys.stdout
    say = _sayer(stream, ctx.log)
    # a node brings back what the command writes under its $OUT: the steps' output too, as it comes
    if ctx.gpu:
        ctx.echo = processes.Echo(stream.buffer)
    if args.since is not None:
        say(f"--budget {args.budget:g} s since {args.since:.0f}: {spent:.0f} s spent before the chain")

    def packed_now(state: dict) -> list[str]:
        return [str(p) for p in pack(state, state_path, Path(args.pack), results, runs)] if args.pack else []

    previous = signal.signal(signal.SIGTERM, _raise_stopped), signal.getsignal(signal.SIGINT)
    try:
        state = run_chain(ctx, state_path, budget, args.only, args.retry_failed, say, packed_now)
    except (Stopped, KeyboardInterrupt) as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the archive is written once more, whole
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for path in packed_now(load_state(state_path, evidence_steps.fingerprint())):
            say(f"packed {path}")
        say(
            f"switchbench evidence: stopped by {_signal_name(error)}; what the finished steps wrote is packed"
        )
        return 130 if isinstance(error, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    packed = packed_now(state)
    for path in packed:
        say(f"packed {path}")
    failed = [name for name, record in state["steps"].items() if record["status"] == "failed"]
    if args.json:
        print(
            json.dumps(
                {"state": state, "missing": missing_figures(state, device), "packed": packed}, indent=2
            )
        )
    return 1 if failed else 0


def _sayer(stream: TextIO, log: Path) -> Callable[[str], None]:
    """The chain's lines, to ``stream`` and into the log the archive carries, beside its commands' output. A
    stream whose reader is gone (a node's `tee`, killed with the chain's pipeline at its time limit) is let go: the
    chain must still record the stopped step and pack, where a BrokenPipeError ended it with neither."""
    live = [stream]

    def say(line: str) -> None:
        with log.open("a") as sink:
            sink.write(line + "\n")
        try:
            for out in live:
                print(line, file=out, flush=True)
        except (OSError, ValueError):
            live.clear()
            # Python flushes the stream once more at exit; nothing may be left to write to a broken pipe
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())

    return say


def spent_before(since: float | None, budget: float) -> float:
    """Seconds of the call's ``budget`` spent before the chain started, counted from ``since`` (a Unix time): a
    node's install and imports took a minute of a 600 s call that the budget did not know of."""
    if since is None:
        return 0.0
    spent = time.time() - since
    if (
        not math.isfinite(since) or spent < -5
    ):  # a few seconds of clock skew between two readings of one clock
        raise ValueError(f"--since {since:g} is not a Unix time of the past (now {time.time():.0f})")
    if spent >= budget:
        raise ValueError(f"--since {since:.0f}: the {budget:g} s budget was spent {spent - budget:.0f} s ago")
    return max(spent, 0.0)


def _blank(state: dict) -> dict:
    """``state`` with nothing done and no duration learnt: a plan for another device, from declared estimates."""
    return {"fingerprint": state["fingerprint"], "steps": {}, "durations": {}}


def _list(args: argparse.Namespace, state: dict, device: str, planned_on: str) -> int:
    """The plan on ``planned_on``, call by call, with each step's expected seconds (from the declared estimates and
    nothing done when that is not this device), and what this device's chain still misses."""
    here = planned_on == device
    plan_state = state if here else _blank(state)
    todo, notes = plan(plan_state, planned_on, args.only, args.retry_failed)
    report = [s for s in todo if s.name == REPORT]
    seconds = {s.name: expected_seconds(s, plan_state, planned_on) for s in todo}
    reserve = _report_reserve(args.only, plan_state, planned_on)  # as run_chain keeps it
    steps = [s for s in todo if s.name != REPORT]
    calls = schedule(steps, lambda s: seconds[s.name], args.budget, reserve) or [report] * bool(report)
    planned = {s.name for call in calls for s in call}
    payload = {
        "budget": args.budget,
        "report_reserve": reserve,
        "calls": [[{"step": s.name, "seconds": seconds[s.name]} for s in call] for call in calls],
        "too_long": [s.name for s in steps if s.name not in planned],
        "skipped": notes,
        "missing": missing_figures(state, device),
    }
    if args.json:
        print(json.dumps(payload, indent=2))
        return 0
    where = "a CUDA GPU" if planned_on == "cuda" else "the CPU (a rehearsal on tiny presets)"
    print(
        f"the plan on {where}: {len(calls)} calls of {args.budget:.0f} s, {reserve:.0f} s of each kept for the "
        f"report{'' if here else ' (declared estimates; nothing done yet)'}"
    )
    for number, call in enumerate(calls, 1):
        print(f"  call {number}: " + ", ".join(f"{s.name} (~{seconds[s.name]:.0f} s)" for s in call))
    for name in payload["too_long"]:
        print(f"  never: {name} needs ~{seconds[name]:.0f} s, more than one call holds; raise --budget")
    for note in notes:
        print(f"  skip {note}")
    print("still missing here:" if payload["missing"] else "nothing missing here")
    print("\n".join(f"  {line}" for line in payload["missing"]))
    return 0
