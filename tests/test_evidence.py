"""The GPU evidence chain's logic on the CPU: budget, stop, resume, skip, failures, the missing list, the archive.

Most tests run the chain over stand-in steps (small Python subprocesses that write a file), so what is checked is
the chain itself; the last one runs the real rehearsal on tiny presets end to end, stopped once by its budget."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from switchbench import cli
from switchbench.bench.command import slug
from switchbench.bench.kernels import tune
from switchbench.cli import main
from switchbench.core.environment import device_name
from switchbench.jobs import evidence, evidence_steps, processes


def _writer(name: str, seconds: float = 0.0, code: int = 0):
    """A step that appends a line to results/<name>.txt after ``seconds``, then exits ``code``."""

    def run(ctx: evidence.Context):
        target = ctx.results / f"{name}.txt"
        script = (
            f"import time, pathlib; time.sleep({seconds}); p = pathlib.Path({str(target)!r}); "
            f"p.write_text(p.read_text() + 'x' if p.exists() else 'x'); raise SystemExit({code})"
        )
        ctx.command([sys.executable, "-c", script])

    return run


def _steps(*steps: evidence.Step, report_seconds: float = 0.5) -> tuple:
    return (
        *steps,
        evidence.Step(evidence.REPORT, "the report", 1, _writer("report"), cpu_seconds=report_seconds),
    )


def _chain(tmp_path: Path, budget: float, **kwargs) -> dict:
    ctx = evidence.Context("cpu", tmp_path / "results", tmp_path / "runs", 0.0, tmp_path / "log.txt")
    ctx.results.mkdir(exist_ok=True)
    lines = []
    state = evidence.run_chain(ctx, tmp_path / "state.json", budget, say=lines.append, **kwargs)
    return state | {"said": lines}


def _runs(tmp_path: Path, name: str) -> int:
    path = tmp_path / "results" / f"{name}.txt"
    return len(path.read_text()) if path.exists() else 0


def test_a_step_that_does_not_fit_waits_for_a_later_call_and_the_steps_after_it_run(tmp_path, monkeypatch):
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("a", "figure A", 1, _writer("a"), cpu_seconds=0.5),
            evidence.Step("b", "figure B", 1, _writer("b"), cpu_seconds=60),
            evidence.Step("c", "figure C", 1, _writer("c"), cpu_seconds=0.5),
        ),
    )
    first = _chain(tmp_path, budget=20)
    assert [_runs(tmp_path, n) for n in "abc"] == [1, 0, 1] and _runs(tmp_path, "report") == 1
    assert any(line.startswith("  later  b: needs about 60 s") for line in first["said"])
    assert evidence.missing_figures(first, "cpu") == ["figure B (b: not run)"]
    second = _chain(tmp_path, budget=20)  # b is the call's first step: it gets its chance, 60 s or not
    assert [_runs(tmp_path, n) for n in "abc"] == [1, 1, 1] and _runs(tmp_path, "report") == 2
    assert any(line.startswith("  skip   a: done for this code") for line in second["said"])
    assert second["said"][-1] == "every figure of the chain is done for this code"
    third = _chain(tmp_path, budget=20)  # nothing left: nothing runs, not even the report
    assert [_runs(tmp_path, n) for n in ("a", "b", "c", "report")] == [1, 1, 1, 2]
    assert third["steps"]["a"]["files"] == [str(tmp_path / "results" / "a.txt")]


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
def test_a_step_that_runs_past_the_budget_is_stopped_and_the_next_call_starts_it_again(tmp_path, monkeypatch):
    # a report of 2 s: with 0.5 s, its git calls and command took up to a quarter of it beside busy processes
    slow = evidence.Step("slow", "figure S", 1, _writer("slow", 30), cpu_seconds=0.1)
    monkeypatch.setattr(evidence, "STEPS", _steps(slow, report_seconds=2))
    start = time.monotonic()
    state = _chain(tmp_path, budget=6)
    assert time.monotonic() - start < 12 and _runs(tmp_path, "slow") == 0  # killed, nothing written
    # stopped at the budget less the exit's reserve (0.3 s) and the report's (2 s), and the report still ran
    # within the budget; the step needs more than the 3.7 s it ran: it asks twice that of the next call
    record = state["steps"]["slow"]
    # (above: what a loaded machine adds to the kill, the reap and the pipe's drain)
    assert record["status"] == "interrupted" and 3.6 <= record["seconds"] < 5.2
    # both rounded to 0.1 s: twice the rounded time is within 0.1 s (and a float's error) of the rounded double
    assert state["durations"]["slow"] == pytest.approx(2 * record["seconds"], abs=0.15)
    assert _runs(tmp_path, "report") == 1
    monkeypatch.setattr(evidence, "STEPS", _steps(evidence.Step("slow", "figure S", 1, _writer("slow"))))
    assert _chain(tmp_path, budget=60)["steps"]["slow"]["status"] == "done" and _runs(tmp_path, "slow") == 1


@pytest.mark.slow  # four chains of subprocesses
def test_a_failed_step_is_recorded_skipped_on_resume_and_retried_on_request(tmp_path, monkeypatch):
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("bad", "figure X", 1, _writer("bad", code=3), cpu_seconds=0.5),
            evidence.Step("good", "figure G", 1, _writer("good"), cpu_seconds=0.5),
        ),
    )
    state = _chain(tmp_path, budget=60)
    assert state["steps"]["bad"]["status"] == "failed" and "exited 3" in state["steps"]["bad"]["detail"]
    assert state["steps"]["good"]["status"] == "done"  # a failure does not stop the chain
    # how soon it failed is no estimate of how long it runs: its declared estimate stands
    assert "bad" not in state["durations"] and state["durations"]["good"] < 30
    again = _chain(tmp_path, budget=60)
    assert _runs(tmp_path, "bad") == 1 and any("bad: failed for this code" in line for line in again["said"])
    _chain(tmp_path, budget=60, retry_failed=True)
    assert _runs(tmp_path, "bad") == 2 and _runs(tmp_path, "good") == 1
    # named in --only, a failed step is asked for: it runs again (a call that ran nothing spent a lease's time)
    _chain(tmp_path, budget=60, only=["bad"])
    assert _runs(tmp_path, "bad") == 3 and _runs(tmp_path, "good") == 1


def test_a_step_that_failed_at_its_end_keeps_its_duration(tmp_path, monkeypatch):
    """A test part whose tests ran, some failing, took as long as it runs: its time is learnt, and it outlives a change
    of code (the H200's four parts of 19 to 44 s, each failing a few tests, kept their declared 120 s)."""

    def tests_failing(ctx: evidence.Context):
        time.sleep(0.3)
        raise evidence_steps.FailedAtItsEnd("2 failed, first tests/test_x.py::test_y")

    part = evidence.Step("part", "the tests", 120, tests_failing, cpu_seconds=60)
    monkeypatch.setattr(evidence, "STEPS", _steps(part))
    state = _chain(tmp_path, budget=600)
    record = state["steps"]["part"]
    assert record["status"] == "failed" and record["ran_through"]
    assert 0.3 <= state["durations"]["part"] < 30 and state["durations"]["part"] == record["spent"]
    again = evidence.load_state(tmp_path / "state.json", "other code")
    assert again["durations"]["part"] == state["durations"]["part"]


def test_a_fault_in_a_steps_own_code_is_a_failed_step_and_the_chain_goes_on(tmp_path, monkeypatch):
    """An exception other than a failed command (a bug in the step) had ended the process before the archive was
    written, so the call brought back nothing of the steps done before it."""

    def faulty(ctx: evidence.Context):
        raise KeyError("no such column")

    steps = (
        evidence.Step("faulty", "figure F", 1, faulty),
        evidence.Step("good", "figure G", 1, _writer("good")),
    )
    monkeypatch.setattr(evidence, "STEPS", _steps(*steps))
    state = _chain(tmp_path, budget=60)
    assert state["steps"]["faulty"]["status"] == "failed"
    assert state["steps"]["faulty"]["detail"].startswith("KeyError: 'no such column'")
    assert any("Traceback" in line for line in state["said"]) and state["steps"]["good"]["status"] == "done"


def test_new_code_estimates_a_step_that_last_failed_by_its_declared_seconds(tmp_path):
    """A chain of older code recorded a failed step's estimate of that day as its duration (the H100's 150 s for
    the practitioner's 262M step, since declared 300 s, and never finished): new code drops it, and keeps the
    durations steps measured."""
    path = tmp_path / "state.json"
    steps = {"failed": {"status": "failed"}, "done": {"status": "done", "finished": "then"}}
    path.write_text(
        json.dumps({"fingerprint": "old", "steps": steps, "durations": {"failed": 150, "done": 95}})
    )
    state = evidence.load_state(path, "new")
    declared = evidence.Step("failed", "figure F", 300, _writer("f"))
    assert evidence.expected_seconds(declared, state, "cuda") == 300 and state["durations"] == {"done": 95}


def test_new_code_runs_everything_again_with_the_old_durations_as_estimates(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "STEPS", _steps(evidence.Step("a", "figure A", 1, _writer("a"))))
    _chain(tmp_path, budget=60)
    monkeypatch.setattr(evidence_steps, "fingerprint", lambda: "other code")
    state = _chain(tmp_path, budget=60)
    assert _runs(tmp_path, "a") == 2 and state["fingerprint"] == "other code" and "a" in state["durations"]
    assert state["earlier"] == {}  # measured again for this code


def test_after_new_code_figures_never_measured_come_before_those_measured_for_earlier_code(
    tmp_path, monkeypatch
):
    """A was measured, B never was; with new code the chain measures B first, and until A is measured again it
    stands at its earlier commit."""
    monkeypatch.setattr(
        evidence, "STEPS", _steps(*(evidence.Step(n, f"figure {n}", 1, _writer(n)) for n in "AB"))
    )
    monkeypatch.setattr(evidence, "commit", lambda: "c0ffee")
    _chain(tmp_path, budget=60, only=["A"])
    monkeypatch.setattr(evidence_steps, "fingerprint", lambda: "other code")
    waiting = evidence.load_state(tmp_path / "state.json", "other code")
    assert evidence.missing_figures(waiting, "cpu")[:2] == [
        "figure A (A: done for earlier code, commit c0ffee)",
        "figure B (B: not run)",
    ]
    state = _chain(tmp_path, budget=60)
    assert [line[3:] for line in state["said"] if line.startswith("== ")] == [
        "B: figure B",
        "A: figure A",
        "report: the report",
    ]
    assert evidence.missing_figures(state, "cpu") == [] and state["earlier"] == {}


def test_a_step_that_needs_a_gpu_is_missing_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(
        evidence, "STEPS", _steps(evidence.Step("tune", "tuned table", 1, _writer("t"), needs_gpu=True))
    )
    state = _chain(tmp_path, budget=60)
    assert _runs(tmp_path, "t") == 0
    assert evidence.missing_figures(state, "cpu") == ["tuned table (tune: needs a CUDA GPU)"]


def _trainer(ctx: evidence.Context):
    """Two models' checkpoints under the runs folder, as the ListOps step leaves them."""
    for name in ("m1", "m2"):
        (ctx.runs / name).mkdir(parents=True, exist_ok=True)
        (ctx.runs / name / "checkpoint.pt").write_bytes(b"weights")


@pytest.mark.parametrize("packed_from", ["the folders' parent", "elsewhere"])
def test_the_archive_holds_what_the_chain_wrote_and_its_state_with_relative_paths(
    packed_from, tmp_path, tmp_path_factory, monkeypatch
):
    """The figures in one archive; each trained model in one of its own beside it (a checkpoint is ~10 MB, and
    what comes back from a node may be capped per file). Packed from elsewhere, with the runs in another folder
    than the results, each path is from its own folder's parent (a model went in as a bare checkpoint.pt)."""
    steps = (evidence.Step("a", "figure A", 1, _writer("a")), evidence.Step("t", "models", 1, _trainer))
    monkeypatch.setattr(evidence, "STEPS", _steps(*steps))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "old.csv").write_text("an earlier run")
    if packed_from == "elsewhere":
        scratch = tmp_path_factory.mktemp("scratch")
        (scratch / "runs").mkdir()
        (tmp_path / "runs").symlink_to(scratch / "runs")
    state = _chain(tmp_path, budget=60)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path if packed_from == "the folders' parent" else tmp_path / "elsewhere")
    archives = evidence.pack(
        state, tmp_path / "state.json", tmp_path / "out.tar.gz", tmp_path / "results", tmp_path / "runs"
    )
    assert [a.name for a in archives] == ["out.tar.gz", "out-m1.tar.gz", "out-m2.tar.gz"]
    names = []
    for archive in archives:
        with tarfile.open(archive) as tar:
            names.append(sorted(tar.getnames()))
    assert names == [
        ["log.txt", "results/a.txt", "results/report.txt", "state.json"],
        ["runs/m1/checkpoint.pt"],
        ["runs/m2/checkpoint.pt"],
    ]


def test_the_tables_kernel_tune_writes_into_the_package_come_back_in_the_archive(tmp_path, monkeypatch):
    """kernel-tune writes the tables it ships (Triton's configurations, auto's measured winners) into the
    checkout's package data, outside the results folder: the step's files and the archive hold both (the
    configurations' table had moved to another folder than the one the chain watched)."""
    tables = [tmp_path / "switchbench" / "ops" / "data" / "configs.json", tmp_path / "matmul" / "auto.json"]
    for name, path in zip(("TABLE", "AUTO_TABLE"), tables, strict=True):
        monkeypatch.setattr(tune, name, path)
        path.parent.mkdir(parents=True)
        path.write_text("{}")  # as shipped, before this GPU is tuned

    def tuner(ctx: evidence.Context):
        for path in tables:
            path.write_text('{"tables": ["this GPU"]}')

    monkeypatch.setattr(evidence, "STEPS", _steps(evidence.Step("tune", "tuned tables", 1, tuner)))
    state = _chain(tmp_path, budget=60)
    assert state["steps"]["tune"]["files"] == sorted(map(str, tables))
    monkeypatch.chdir(tmp_path)
    archive = evidence.pack(
        state, tmp_path / "state.json", tmp_path / "out.tar.gz", tmp_path / "results", tmp_path / "runs"
    )[0]
    with tarfile.open(archive) as tar:
        assert {"switchbench/ops/data/configs.json", "matmul/auto.json"} <= set(tar.getnames())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "0"], "--budget must be a finite number of seconds > 0"),
        (["--budget", "nan"], "--budget must be a finite number of seconds > 0; got nan"),
        (["--budget", "inf"], "--budget must be a finite number of seconds > 0; got inf"),
        (["--budget", "1e300"], "--budget must be at most 604800 s (a week); got 1e+300"),
        (["--results", "/proc/no-such"], "--results /proc/no-such"),
        (["--pack", "/proc/x.tar.gz"], "--pack /proc/x.tar.gz"),
        (
            ["--pack", "x.zip"],
            "--pack x.zip: the archive is a gzipped tar; name it FILE.tar.gz",
        ),  # a .zip of tar
        (["--since", "nan"], "--since nan is not a Unix time of the past"),
        (["--since", f"{time.time() + 3600:.0f}"], "is not a Unix time of the past"),
        (["--budget", "60", "--since", "1"], "the 60 s budget was spent"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["evidence", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "results").exists()


def test_a_budget_the_install_left_too_short_is_named_as_given(tmp_path, capsys, monkeypatch):
    """It said "--budget 3.20377 s leaves the steps no time", a budget the user never gave."""
    monkeypatch.chdir(tmp_path)
    since = f"{time.time() - 55:.3f}"
    assert main(["evidence", "--device", "cpu", "--budget", "60", "--since", since]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--budget 60 s less the 5[5-9] s spent since --since leaves the steps no time", err), (
        err
    )


def test_since_counts_the_budget_from_before_the_chain(tmp_path, monkeypatch, capsys):
    """A node's install and imports took a minute of a 600 s call before the chain's clock started, so a call of
    --budget 530 ended 70 s later than planned: --since counts them in."""
    monkeypatch.chdir(tmp_path)
    step = evidence.Step("a", "figure A", 1, _writer("a"), cpu_seconds=30)
    monkeypatch.setattr(
        evidence, "STEPS", _steps(step, evidence.Step("b", "figure B", 1, _writer("b"), cpu_seconds=0.5))
    )
    since = f"{time.time() - 40:.3f}"  # 40 s of a 60 s call gone: 20 s left, less the reserves; a needs 30
    assert main(["evidence", "--device", "cpu", "--budget", "60", "--since", since]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^--budget 60 s since \d+: 4[01] s spent before the chain$", out, re.M)
    assert "  later  a: needs about 30 s" in out and (tmp_path / "results" / "b.txt").exists()
    assert main(["evidence", "--device", "cpu", "--budget", "60"]) == 0  # the whole call: a runs
    assert (tmp_path / "results" / "a.txt").exists()


@pytest.mark.slow  # two calls of a step that sleeps
def test_a_resumable_step_done_over_two_calls_lasts_both(tmp_path, monkeypatch):
    """Its duration was the last call's alone, so the next code planned a short step for a long one."""
    calls = []

    def part(ctx: evidence.Context):
        calls.append(ctx.step)
        time.sleep(0.3)
        if len(calls) == 1:
            raise evidence.OutOfBudget("stopped")

    monkeypatch.setattr(evidence, "STEPS", _steps(evidence.Step("r", "figure R", 1, part, resumable=True)))
    first = _chain(tmp_path, budget=60)["steps"]["r"]
    assert first["status"] == "interrupted" and first["seconds"] >= 0.3
    state = _chain(tmp_path, budget=60)
    record = state["steps"]["r"]
    assert record["status"] == "done" and record["seconds"] >= 0.3
    # both calls' time, each rounded to 0.1 s
    assert record["spent"] == pytest.approx(first["seconds"] + record["seconds"], abs=0.11)
    assert state["durations"]["r"] == record["spent"]


def test_the_fingerprint_follows_the_code_not_the_results(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    (root / "switchbench").mkdir(parents=True)
    (root / "switchbench" / "a.py").write_text("x = 1")
    (root / "pyproject.toml").write_text("")
    monkeypatch.setattr(evidence_steps, "ROOT", root)
    before = evidence_steps.fingerprint()
    (root / "results").mkdir()
    (root / "results" / "speed.json").write_text("{}")
    assert evidence_steps.fingerprint() == before
    (root / "switchbench" / "a.py").write_text("x = 2")
    assert evidence_steps.fingerprint() != before


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_on_tiny_presets_across_two_calls(tmp_path, capsys, monkeypatch):
    """The real chain on the CPU, run from outside the checkout: a first call stopped by its budget, a second that
    finishes; every step but kernel-tune (CUDA only) done, each with the files it owes, and the archive of all of
    it."""
    monkeypatch.chdir(tmp_path)
    common = [
        "evidence",
        "--device",
        "cpu",
        "--results",
        str(tmp_path / "results"),
        "--runs",
        str(tmp_path / "runs"),
    ]
    assert main([*common, "--budget", "40"]) == 0
    first = capsys.readouterr().out
    assert "  later  " in first and "still missing:" in first
    status = main([*common, "--budget", "1500", "--pack", str(tmp_path / "evidence.tar.gz"), "--json"])
    out = json.loads(capsys.readouterr().out)
    steps = out["state"]["steps"]
    # a failure names the step and its cause: the CI's report cuts the state's JSON short of the failed step
    failed = {name: record["detail"] for name, record in steps.items() if record["status"] != "done"}
    assert status == 0, f"failed: {failed}; the log ends: {_log_tail(tmp_path / 'results')}"
    assert {name for name, record in steps.items() if record["status"] == "done"} == {
        s.name for s in evidence.STEPS if not s.needs_gpu
    }
    assert out["missing"] == [
        f"the shipped table of tuned Triton configurations at {size} (kernel-tune-{size.lower()}: needs a CUDA GPU)"
        for size in ("47M", "262M")
    ]
    results = tmp_path / "results"
    for folder in ("kernels", "speed", "profile", "quality", "tests", "speed-gate"):
        assert any((results / folder).rglob("*.json")), folder
    assert (results / "baselines").glob("*.json") and (results / "report.html").exists()
    summary = json.loads(next((results / "tests").rglob("*.json")).read_text())
    assert summary["passed"] > 0 and summary["failed"] == []
    with tarfile.open(tmp_path / "evidence.tar.gz") as tar:
        names = tar.getnames()
    assert "results/report.html" in names and not any(n.startswith(("/", "..")) for n in names)


def _log_tail(results: Path, lines: int = 40) -> str:
    logs = sorted(results.glob("evidence/*/log.txt"))
    return "\n".join(logs[0].read_text(errors="replace").splitlines()[-lines:]) if logs else "(no log)"


class _FakeClock:
    """``time`` as the chain sees it: a monotonic clock that only the simulated steps move."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def strftime(fmt: str) -> str:
        return time.strftime(fmt)


def _simulated(step: evidence.Step, clock: _FakeClock, slower: float) -> evidence.Step:
    """``step`` lasting ``slower`` times its declared GPU seconds; stopped at the deadline as ``ctx.command``
    stops a process (a resumable step keeps what it did, any other starts again)."""
    left = {"seconds": slower * step.gpu_seconds}

    def run(ctx: evidence.Context):
        if clock.now + left["seconds"] > ctx.deadline:
            spent = max(ctx.deadline - clock.now, 0.0)
            clock.now += spent
            if step.resumable:
                left["seconds"] -= spent
            raise evidence.OutOfBudget(step.name)
        clock.now += left["seconds"]

    return replace(step, run=run)


def _calls(
    tmp_path, monkeypatch, slower: Callable[[evidence.Step], float], most: int
) -> tuple[list, list, dict]:
    """The real run_chain over ``most`` calls of the default budget at most, on a fake clock, each step lasting
    ``slower(step)`` times its declared GPU seconds: each call's length, the steps each call finished, the state."""
    clock = _FakeClock()
    monkeypatch.setattr(evidence, "time", clock)
    monkeypatch.setattr(evidence, "device_name", lambda device: "Simulated H100")
    monkeypatch.setattr(evidence, "commit", lambda: "abc")
    monkeypatch.setattr(evidence, "environment", lambda device: {"device": "Simulated H100"})
    monkeypatch.setattr(evidence, "STEPS", tuple(_simulated(s, clock, slower(s)) for s in evidence.STEPS))
    lengths, finished = [], []
    for _ in range(most):
        ctx = evidence.Context("cuda", tmp_path / "results", tmp_path / "runs", 0.0, tmp_path / "log.txt")
        start, done = clock.now, set(_done(tmp_path))
        state = evidence.run_chain(ctx, tmp_path / "state.json", BUDGET, say=lambda line: None)
        lengths.append(clock.now - start)
        finished.append([name for name in _done(tmp_path) if name not in done])
        if not evidence.missing_figures(state, "cuda"):
            break
    return lengths, finished, state


def _done(tmp_path) -> list[str]:
    path = tmp_path / "state.json"
    steps = json.loads(path.read_text())["steps"] if path.exists() else {}
    return [name for name, record in steps.items() if record["status"] == "done"]


BUDGET = 540.0  # the default --budget


@pytest.mark.parametrize(("slower", "calls"), [(1.0, 12), (1.25, 17)])
def test_the_gpu_chain_finishes_in_calls_that_each_end_within_the_budget(
    slower, calls, tmp_path, monkeypatch
):
    """The real run_chain on a fake clock, every step lasting its declared GPU duration (or 25% longer than
    declared, learnt as it goes): every step done within ``calls`` calls of the default budget, none past it."""
    lengths, _, state = _calls(tmp_path, monkeypatch, lambda step: slower, calls)
    assert evidence.missing_figures(state, "cuda") == [], f"after {len(lengths)} calls"
    assert max(lengths) <= BUDGET, lengths
    if slower == 1.0:  # the plan --list prints is what the chain did
        steps = [s for s in evidence.STEPS if s.name != evidence.REPORT]
        assert len(lengths) == len(evidence.schedule(steps, lambda s: s.gpu_seconds, BUDGET, 20.0))


def test_on_the_durations_the_h100_suggests_the_first_call_brings_back_figures(tmp_path, monkeypatch):
    """The H100's lesson: the fast tests ran twice their declared time, and a compiled step's duration is unknown
    (assumed twice too, but for the 262M one, declared from its stop at 226 s on an H100). The first call still
    finishes figure steps, and every step is done within 16 calls."""

    def slower(step: evidence.Step) -> float:
        compiled = step.name.startswith("speed-compiled") or step.name == "speed-practitioner-47m-compiled"
        unknown = (step.name.startswith("tests") or compiled) and step.name != "speed-compiled-262m"
        return 2.0 if unknown else 1.0

    lengths, finished, state = _calls(tmp_path, monkeypatch, slower, 16)
    assert evidence.missing_figures(state, "cuda") == [], f"after {len(lengths)} calls"
    assert max(lengths) <= BUDGET, lengths
    figures = [name for name in finished[0] if name.startswith(("speed", "profile"))]
    assert len(figures) >= 2, finished[0]


@pytest.mark.parametrize("flags", [["--pack", "x.tar.gz"], ["--since", "0"]], ids=lambda f: f[0])
def test_list_refuses_what_only_a_run_reads(flags, tmp_path, monkeypatch, capsys):
    """--list with --pack or --since printed the plan and ignored them: a user expecting an archive got none
    (--retry-failed it reads: the plan runs the failed steps again)."""
    monkeypatch.chdir(tmp_path)
    assert main(["evidence", "--list", *flags]) == 2
    assert "--list runs nothing" in capsys.readouterr().err
    assert not (tmp_path / "x.tar.gz").exists()


def test_the_plan_is_printed_for_a_gpu_on_any_device_call_by_call(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a machine without CUDA
    monkeypatch.setattr(evidence, "device_from_args", lambda choice: choice or "cpu")
    assert main(["evidence", "--list", "--json"]) == 0  # no --device: the GPU's plan, from anywhere
    out = json.loads(capsys.readouterr().out)
    planned = [entry["step"] for call in out["calls"] for entry in call]
    assert (
        set(planned) == {s.name for s in evidence.STEPS if s.name != evidence.REPORT}
        and out["too_long"] == []
    )
    resumable = {s.name for s in evidence.STEPS if s.resumable}  # listed in each call they go on in, whole
    room = 540 - out["report_reserve"] - evidence.exit_reserve(540)
    assert all(sum(e["seconds"] for e in call if e["step"] not in resumable) <= room for call in out["calls"])
    monkeypatch.setattr(
        evidence, "device_from_args", lambda choice: choice or "cpu"
    )  # a machine without CUDA
    assert main(["evidence", "--list", "--budget", "200"]) == 0  # no --device: the GPU's plan, from anywhere
    text = capsys.readouterr().out
    assert text.startswith("the plan on a CUDA GPU: ")
    assert (
        "never: speed-practitioner-262m needs ~300 s, more than one call holds" in text and "call 1: " in text
    )


def test_the_list_plans_the_device_asked_for_and_the_report_alone(capsys):
    """--device cpu lists the CPU rehearsal (it listed the GPU's plan); --only report is one call of the report
    (it was 0 calls)."""
    assert main(["evidence", "--device", "cpu", "--list", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cpu = {s.name: s.cpu_seconds for s in evidence.STEPS}
    assert all(entry["seconds"] == cpu[entry["step"]] for call in out["calls"] for entry in call)
    assert "kernel-tune-47m: needs a CUDA GPU" in out["skipped"]
    assert main(["evidence", "--device", "cpu", "--list", "--only", "report"]) == 0
    text = capsys.readouterr().out
    assert "1 calls of 540 s" in text and "  call 1: report (~" in text


def test_the_list_plans_a_node_s_next_calls_from_the_state_it_brought_back(tmp_path, monkeypatch, capsys):
    """Here, without a GPU, --list planned a GPU from declared estimates and nothing done: the durations a node
    learnt and the steps it finished (its archive unpacked here) were out of the plan of its next call."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(evidence_steps, "fingerprint", lambda: "this")
    folder = tmp_path / "results" / "evidence" / "nvidia-h200"
    folder.mkdir(parents=True)
    first, second = (s.name for s in evidence.STEPS[:2])
    state = {"fingerprint": "this", "steps": {first: {"status": "done"}}, "durations": {second: 123.0}}
    (folder / "state.json").write_text(json.dumps(state))
    assert main(["evidence", "--list", "--node", "nvidia-h200", "--json"]) == 0
    planned = [entry for call in json.loads(capsys.readouterr().out)["calls"] for entry in call]
    assert first not in {e["step"] for e in planned}
    assert next(e["seconds"] for e in planned if e["step"] == second) == 123.0
    for argv, says in (
        (
            ["--list", "--node", "nvidia-h100"],
            "--node nvidia-h100: no results/evidence/nvidia-h100/state.json",
        ),
        (["--node", "nvidia-h200"], "--node plans a node's next calls on its GPU: give it with --list"),
        (["--list", "--device", "cpu", "--node", "nvidia-h200"], "without --device cpu"),
    ):
        assert main(["evidence", *argv]) == 2
        assert says in capsys.readouterr().err


def test_a_budget_that_leaves_the_steps_no_time_is_refused(tmp_path, capsys, monkeypatch):
    """The report's 20 s (declared, on a GPU) and the exit's twentieth are kept from every call: 21 s leave nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(["evidence", "--list", "--budget", "21"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--budget 21 s leaves the steps no time: 20 s are kept for the report and 1 s for the exit")
    )
    assert main(["evidence", "--list", "--budget", "23"]) == 0
    # the report alone ran out of its budget at once and exited 0, having done nothing
    assert main(["evidence", "--list", "--only", "report", "--budget", "0.001"]) == 2
    assert "leaves the report too little time: it takes about 20 s" in capsys.readouterr().err
    assert main(["evidence", "--list", "--only", "report", "--budget", "22"]) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a pytest of its own under xdist: 15 s
@pytest.mark.skipif(
    not all(map(importlib.util.find_spec, ("xdist", "pytest_benchmark"))),
    reason="needs pytest-xdist and pytest-benchmark",
)
@pytest.mark.parametrize(("step", "workers"), [("tests", "8"), ("flash", "4")])
def test_a_gpu_step_s_pytest_command_starts_under_xdist(step, workers, monkeypatch, tmp_path):
    """On an H200 node the tests step stopped at start-up (pytest exit 3): pytest-benchmark 5.2 warns under xdist
    unless told to stay off, and the suite turns warnings into errors; the flash attention step's tests had the
    same flaw until a review found it. Each step's own flags, on one small test file."""
    seen = []
    monkeypatch.setattr(evidence_steps, "device_name", lambda device: "NVIDIA H200")  # its results' folder
    ctx = evidence.Context("cuda", tmp_path, tmp_path, 0.0, tmp_path / "log.txt")
    monkeypatch.setattr(ctx, "command", lambda argv, **how: seen.append(argv) or "")
    monkeypatch.setattr(evidence_steps, "_tests_summary", lambda *args: {"failed": []})  # no log: nothing ran
    monkeypatch.setattr(evidence_steps, "session_status", lambda log: 0)
    if step == "tests":
        evidence_steps._tests("not slow", "test_config.py")(ctx)
    else:
        evidence_steps._flash(ctx)
    argv = next(argv for argv in seen if argv[2] == "pytest")
    assert argv[argv.index("-n") + 1] == workers and "--benchmark-disable" in argv
    flags = [a for a in argv[1:] if not a.endswith(".py")]  # the suite's files left out
    flags[flags.index("-n") + 1] = "2"
    done = subprocess.run(
        [sys.executable, *flags, str(Path(__file__).parent / "test_environment.py")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:]


def test_every_gpu_step_s_commands_are_ones_the_command_line_takes(monkeypatch, tmp_path):
    """A lease is 15 minutes: a step whose command the parser refuses wastes a call. Each step's GPU branch on a
    node of two GPUs (the data-parallel runs included), its commands recorded and answered with an output that
    names a saved run, parsed by the command line's own parser; pytest's files exist."""
    monkeypatch.setattr(evidence_steps, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(evidence_steps, "_tests_summary", lambda *args: {"failed": []})
    monkeypatch.setattr(evidence_steps, "session_status", lambda log: 0)
    monkeypatch.setattr(evidence_steps.torch.cuda, "device_count", lambda: 2)
    parser = cli._parser()
    for step in evidence.STEPS:
        seen = []
        ctx = evidence.Context("cuda", tmp_path / "results", tmp_path / "runs", 0.0, tmp_path / "log.txt")
        monkeypatch.setattr(
            ctx, "command", lambda argv, seen=seen, **how: seen.append(argv) or '{"saved": "r"}'
        )
        step.run(ctx)
        assert seen, step.name
        for argv in seen:
            if "pytest" in argv[:3]:
                assert all(Path(a).exists() for a in argv if a.endswith(".py")), (step.name, argv)
                continue
            at = argv.index("switchbench")  # python -m switchbench, or torchrun's -m switchbench
            try:
                parser.parse_args(argv[at + 1 :])
            except SystemExit:
                pytest.fail(f"{step.name}: the command line refuses {' '.join(argv[at + 1 :])}")


def test_the_flash_attention_step_times_the_kernel_after_its_tests_and_fails_naming_those_that_failed(
    monkeypatch, tmp_path
):
    """On a GPU the step runs the kernel's tests first, then times the pair and profiles it whatever they found,
    and fails at its end naming the failed tests. It stopped at the first failure and timed nothing: one tolerance
    missed in tests never run on a GPU would have cost the call its headline figure."""
    seen = []
    ctx = evidence.Context("cuda", tmp_path, tmp_path, 0.0, tmp_path / "log.txt")
    monkeypatch.setattr(evidence_steps, "device_name", lambda device: "NVIDIA H200")

    def command(argv, ok=(0,), cwd=None):
        seen.append(argv[2:4] if argv[3] != "speed" else [*argv[2:4], argv[argv.index("--attention") + 1]])
        if argv[2] == "pytest":
            assert "-x" not in argv and 1 in ok  # every test runs, and failures do not stop the step
            log = Path(next(a for a in argv if a.startswith("--report-log=")).split("=", 1)[1])
            phases = [("t::a", "passed")] + [("t::b", "failed")] * (failing[0] == "test")
            lines = [
                {"$report_type": "TestReport", "nodeid": node, "when": when, "outcome": outcome}
                for node, outcome in phases
                for when, outcome in (("setup", "passed"), ("call", outcome), ("teardown", "passed"))
            ]
            lines.append({"$report_type": "SessionFinish", "exitstatus": int(bool(failing[0]))})
            log.write_text("\n".join(map(json.dumps, lines)))
        return ""

    monkeypatch.setattr(ctx, "command", command)
    timed = [["pytest", "-q"], ["switchbench", "speed", "triton"], ["switchbench", "profile"]]
    failing = [""]  # what the tests do: pass, fail a test, or end failed naming none
    evidence_steps._flash(ctx)
    assert seen == timed
    for failing[0], says in (
        ("test", r"1 flash tests failed, first t::b \(the pair was timed"),
        ("session", r"the flash tests exited 1 \(see .*; the pair was timed"),  # none named: a worker crashed
    ):
        seen.clear()
        with pytest.raises(evidence.StepFailed, match=says):
            evidence_steps._flash(ctx)
        assert seen == timed
    assert len(list((tmp_path / "tests" / "nvidia-h200").glob("flash-*.jsonl"))) >= 1  # packed with the step


@pytest.mark.slow  # three calls of a 3 s budget
def test_a_step_stopped_with_a_whole_call_is_not_tried_again_at_that_budget(tmp_path, monkeypatch):
    """The H100's tests step: stopped with the whole call to itself, then first in every later call and stopped
    again. Now it is left out of calls no longer than what it had, with a line saying so, and the rest runs."""
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("long", "figure L", 1, _writer("long", 30), cpu_seconds=0.1),
            evidence.Step("short", "figure S", 1, _writer("short"), cpu_seconds=0.1),
        ),
    )
    first = _chain(tmp_path, budget=3)
    assert first["steps"]["long"]["status"] == "interrupted" and first["steps"]["long"]["whole_call"]
    second = _chain(tmp_path, budget=3)
    assert any(line.startswith("  never  long") for line in second["said"])
    assert second["steps"]["short"]["status"] == "done" and _runs(tmp_path, "long") == 0
    # named by --only it is asked for by name, as a failed step is: a call that installed and printed "never"
    # brought nothing back, and no call could be long enough to be let try again
    third = _chain(tmp_path, budget=3, only=["long"])
    assert not any(line.startswith("  never") for line in third["said"])
    assert any(line.startswith("== long") for line in third["said"])


def test_a_command_s_echo_whose_reader_is_gone_is_let_go_and_its_output_still_read(tmp_path):
    """On a GPU the steps' output is also written to the chain's, which a node's `tee` carries back; when the
    pipeline is killed the echo's writes fail, and the command's pipe must still be read (else it blocks once the
    pipe is full) and its output logged."""
    read, write = os.pipe()
    os.close(read)
    sink = os.fdopen(write, "wb", buffering=0)
    echo = processes.Echo(sink)
    script = "import sys; [sys.stdout.write('x' * 1000 + '\\n') for _ in range(300)]"  # past a pipe's 64 KiB
    log = tmp_path / "log.txt"
    process = processes.start([sys.executable, "-c", script], dict(os.environ), None, log, forked=False)
    out, killed = processes.output(process, 30, log, echo)
    assert not killed and process.returncode == 0 and len(out.splitlines()) == 300
    assert echo.stream is None and log.read_text() == out
    sink.close()


GRANDCHILD = """
import os, signal, subprocess, sys, time
if sys.argv[1:] == ["grandchild"]:
    os.setsid()  # out of the step's session: a process-group kill misses it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), flush=True)  # and it holds the step's output pipe
    time.sleep(120)
else:
    subprocess.Popen([sys.executable, __file__, "grandchild"])
    time.sleep({parent_sleeps})
"""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_rehearsal_runs_a_stand_in_once_across_steps_and_a_step_its_command_twice(tmp_path, device):
    """The 262M and 47M groups both rehearse on the tiny group: the second step reuses the first's command. A step
    that runs one command twice (two gate runs to pool) runs it twice, and a GPU runs every command."""
    count = tmp_path / "count.txt"
    argv = [sys.executable, "-c", f"open({str(count)!r}, 'a').write('x'); print('ran')"]
    ctx = evidence.Context(device, tmp_path, tmp_path, time.monotonic() + 60, tmp_path / "log.txt")
    ctx.step = "speed-262m"
    assert ctx.command(argv) == ctx.command(argv) == "ran\n"
    ctx.step = "speed-47m"
    assert ctx.command(argv) == "ran\n"
    assert len(count.read_text()) == (2 if device == "cpu" else 3)
    if device == "cpu":
        assert "(ran to its end in step speed-262m: not run again)" in (tmp_path / "log.txt").read_text()


@pytest.mark.slow  # a stopped step and its grandchild: seconds
@pytest.mark.parametrize("parent_sleeps", [120, 0])
def test_a_stop_reaches_a_grandchild_that_left_the_session_and_the_call_ends(tmp_path, parent_sleeps):
    """A step whose grandchild left the session, ignores SIGTERM and holds the output pipe: the call still ends
    within its budget (and a grace for the pipe), and the grandchild is killed while its parent lives. Where the
    parent ended first, the orphan is out of reach; the call ends anyway with what the step printed."""
    script = tmp_path / "step.py"
    script.write_text(GRANDCHILD.replace("{parent_sleeps}", str(parent_sleeps)))
    # 5 s: the grandchild, a second interpreter, prints its pid before the deadline even on a loaded machine
    ctx = evidence.Context("cpu", tmp_path, tmp_path, time.monotonic() + 5, tmp_path / "log.txt")
    start = time.monotonic()
    if parent_sleeps:
        with pytest.raises(evidence.OutOfBudget):
            ctx.command([sys.executable, str(script)])
    else:
        out = ctx.command([sys.executable, str(script)])
        assert out.strip()  # the grandchild's pid, printed before the pipe was given up
    assert time.monotonic() - start < 5 + 2 * processes.STRAY_GRACE + 1
    pid = int((tmp_path / "log.txt").read_text().split()[-1])
    if parent_sleeps:
        time.sleep(0.2)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    else:
        os.kill(pid, signal.SIGKILL)  # what no stop can reach: cleaned up here


def _ended_soon(pid: int, what: str, outlived: str) -> None:
    """Fails unless process ``pid`` is gone (or a zombie) within 5 s, killing it then."""
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{what} (pid {pid}) outlived {outlived}")


SLEEPING_TEST = """
import os, time
def test_sleeps():
    open(PIDS, "w").write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.slow  # a pytest-xdist run started and killed: seconds
def test_a_pytest_worker_dies_with_its_controller(tmp_path):
    """A chain killed from outside takes its test step's pytest with it (the kernel kills it at its parent's death)
    but not pytest's workers, which its session kill would have reached: this suite's worker asks the kernel to kill
    it at its controller's death too, so none is left in a GPU test into a node's next call."""
    pids = tmp_path / "pid.txt"
    (tmp_path / "test_sleeps.py").write_text(f"PIDS = {str(pids)!r}\n" + SLEEPING_TEST)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))  # this suite's conftest, as a plugin
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "1",
        "-p",
        "conftest",
        "-p",
        "no:cacheprovider",
        "test_sleeps.py",
    ]
    controller = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline and controller.poll() is None, "the worker never started its test"
        time.sleep(0.1)
    worker = int(pids.read_text())
    controller.kill()
    controller.wait()
    _ended_soon(worker, "the worker", "its controller")


# the sixth test blocks the first call until its budget stops it (pytest starting from the warmed fork server);
# the next call passes it
PART = """
import os, time, pytest
@pytest.mark.parametrize("i", range(12))
def test_part(i):
    if i == 5 and not os.path.exists(FLAG):
        open(FLAG, "w").close()
        time.sleep(600)
    assert i != 1
"""


@pytest.mark.slow  # two pytest runs of their own, one stopped by its budget: 18 s
@pytest.mark.skipif(importlib.util.find_spec("pytest_reportlog") is None, reason="needs pytest-reportlog")
def test_the_step_so_far_is_recorded_after_each_command_of_the_main_thread_alone(tmp_path):
    """After each command that ends well the chain records the step and rewrites the archive; a step's own
    threads (ListOps trains three models at once) raced it and each other: two packs of one archive removed each
    other's temporary file, and a SIGTERM then lost the step's record. A failed command ends its step, which
    records it once."""
    ctx = evidence.Context("cpu", tmp_path, tmp_path, time.monotonic() + 60, tmp_path / "log.txt")
    recorded = []
    ctx.after_command = lambda: recorded.append(threading.current_thread().name)
    ok, fails = [sys.executable, "-c", "pass"], [sys.executable, "-c", "raise SystemExit(1)"]
    ctx.command(ok)
    worker = threading.Thread(target=ctx.command, args=([sys.executable, "-c", "print(1)"],), name="worker")
    worker.start()
    worker.join()
    with pytest.raises(evidence.StepFailed):
        ctx.command(fails)
    assert recorded == [threading.main_thread().name]


def test_a_test_whose_worker_crashed_is_failed_not_stopped_midway(tmp_path):
    """pytest-xdist reports a test whose worker died as failed in a phase of no name ("???") with no teardown
    after it; read as stopped midway it was no failure, and a flash step whose tests crashed a worker was done."""
    reports = [
        *(("t::a", when, "passed") for when in ("setup", "call", "teardown")),
        ("t::b", "setup", "passed"),
        ("t::b", "???", "failed"),  # its worker crashed
        ("t::c", "setup", "passed"),  # stopped midway: runs again
    ]
    log = tmp_path / "log.jsonl"
    log.write_text(
        "\n".join(
            json.dumps({"$report_type": "TestReport", "nodeid": node, "when": when, "outcome": outcome})
            for node, when, outcome in reports
        )
    )
    assert evidence_steps.test_outcomes([log]) == {"t::a": "passed", "t::b": "failed"}


@pytest.mark.slow  # two pytest runs of their own, the first stopped by its budget: 25 s
def test_a_tests_part_stopped_midway_keeps_its_outcomes_and_the_next_call_runs_the_rest(
    tmp_path, monkeypatch
):
    tests = tmp_path / "test_part.py"
    tests.write_text(f"FLAG = {str(tmp_path / 'blocked-once')!r}\n{PART}")
    # the rehearsal's server imports torch and pytest at its first fork (3.5 s idle, 7 s beside busy processes):
    # started before the chain's clock, the budget is pytest's collection and five tests
    (tmp_path / "warm.log").touch()
    warm = processes._Forked("pytest", ["--version"], dict(os.environ), tmp_path, tmp_path / "warm.log")
    assert warm.wait(300) == 0
    warm.stdout.close()
    step = evidence.Step(
        "tests-1", "part 1", 1, evidence_steps._tests("not slow", str(tests)), resumable=True
    )
    monkeypatch.setattr(evidence, "STEPS", _steps(replace(step, cpu_seconds=1)))
    first = _chain(tmp_path, budget=20)  # pytest's start, five tests, then the sixth until the budget's end
    assert first["steps"]["tests-1"]["status"] == "interrupted"
    (summary_path,) = (tmp_path / "results" / "tests").rglob("*.json")
    summary = json.loads(summary_path.read_text())
    ran_first = summary["counts"]["tests"]
    failed = summary["failed"]  # test ids, relative to where pytest found its root
    assert ran_first == 5 and len(failed) == 1 and failed[0].endswith(f"{tests.name}::test_part[1]")
    second = _chain(tmp_path, budget=60)
    assert second["steps"]["tests-1"]["status"] == "failed"  # one test fails: the part is done, and red
    # the rest alone ran in this call: less than the part takes, so no lesson on its length
    assert not second["steps"]["tests-1"]["ran_through"]
    logs = sorted((tmp_path / "results" / "tests").rglob("*.jsonl"))
    assert len(logs) == 2
    again = evidence_steps.test_outcomes(logs[1:])
    # the rest, and the test that failed again (a retry must test it, not read its old failure)
    assert len(again) == 12 - ran_first + 1 and set(again) & set(evidence_steps.test_outcomes(logs[:1])) == {
        failed[0]
    }
    summary = json.loads(summary_path.read_text())
    assert summary["counts"] == {"passed": 11, "failed": 1, "skipped": 0, "tests": 12}


@pytest.mark.slow  # 600 forked commands: about 8 s
def test_forked_commands_started_and_ended_from_several_threads_keep_their_exit_status(tmp_path):
    """ListOps starts its trainings on three threads. multiprocessing reads a forked child's status once, and each
    start polls every other child: a poll that lost that read to another thread's took the status for 255, in 12
    of 1,000 quick commands from four threads (none in 4,000 since starts and polls take turns)."""
    (tmp_path / "exits3.py").write_text("import sys\nsys.exit(3)\n")
    log = tmp_path / "log.txt"
    log.touch()
    codes = []

    def commands(n: int):
        for _ in range(n):  # `python -m exits3`, forked as the rehearsal forks its commands
            process = processes._Forked("exits3", [], dict(os.environ), tmp_path, log)
            codes.append(process.wait(60))
            process.stdout.close()

    threads = [threading.Thread(target=commands, args=(150,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert codes == [3] * 600


@pytest.mark.slow  # a forked command and a stopped one: seconds
def test_the_rehearsal_forks_its_commands_with_their_output_status_and_stop(tmp_path):
    """A CPU `python -m switchbench` runs forked from the preloaded server: it prints what the command prints in
    a process of its own, its error line goes to the log with its exit status, and the deadline stops it."""
    ctx = evidence.Context("cpu", tmp_path, tmp_path, time.monotonic() + 60, tmp_path / "log.txt")
    printed = ctx.switchbench("presets", "--json")
    assert {row["preset"] for row in printed} >= {"tiny-transformer", "tiny-switchhead"}
    with pytest.raises(evidence.StepFailed, match="exited 2"):
        ctx.switchbench("speed", "--device", "cpu", "--rounds", "0")
    assert "switchbench speed: error: --rounds must be >= 1; got 0" in (tmp_path / "log.txt").read_text()
    ctx.deadline = time.monotonic() + 3
    before = time.monotonic()
    with pytest.raises(evidence.OutOfBudget):
        ctx.switchbench(
            "train", "--task", "listops", "--device", "cpu", "--steps", "100000", "--out", str(tmp_path)
        )
    assert time.monotonic() - before < 3 + processes.STRAY_GRACE


DAMAGED_STATES = {
    "not-json": "{bad",
    "a list": "[]",
    "step names in a list": '{"steps": [1, 2]}',
    "a step's record as text": '{"steps": {"listops": "done"}}',
    "a step without its status": '{"steps": {"listops": {"seconds": 3}}}',
    "a duration as text": '{"durations": {"listops": "x"}}',
    # the planner counted a resumable step's time down from it forever (--list took 1.6 GB in 15 s)
    "a duration past any call": '{"durations": {"listops": 1e308}}',
    "a duration of NaN": '{"durations": {"listops": NaN}}',
    "a step's seconds as text": '{"steps": {"listops": {"status": "done", "seconds": "3"}}}',
    "a step's time spent of NaN": '{"steps": {"listops": {"status": "interrupted", "spent": NaN}}}',
    "a step's seconds negative": '{"steps": {"listops": {"status": "done", "seconds": -1}}}',
    "nested past the stack": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("content", DAMAGED_STATES.values(), ids=DAMAGED_STATES.keys())
def test_a_damaged_state_file_is_named_before_any_step(content, tmp_path, monkeypatch, capsys):
    """The chain's state, edited or cut short: one line naming the file, exit 2, the file as it was (exit 3 with
    an AttributeError or TypeError, or a JSON error without the file's name)."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "results" / "evidence" / slug(device_name("cpu")) / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(content)
    assert main(["evidence", "--device", "cpu", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"switchbench evidence: error: results/evidence/{state.parent.name}/state.json: ")
    assert len(err.splitlines()) == 1 and state.read_text() == content


@pytest.mark.parametrize(
    "content",
    [
        '{"fingerprint": "other", "steps": {"report": {"status": "done"}}}',  # earlier, without its commit
        '{"steps": {"report": {"status": "failed"}}}',
    ],
)
def test_a_state_whose_records_lack_their_details_still_plans(content, tmp_path, monkeypatch, capsys):
    """An older or edited state without a record's commit, time or reason: --list plans (it was a KeyError)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(evidence_steps, "fingerprint", lambda: "this")
    state = tmp_path / "results" / "evidence" / slug(device_name("cpu")) / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(
        content.replace('"steps"', '"fingerprint": "this", "steps"', "fingerprint" not in content)
    )
    assert main(["evidence", "--device", "cpu", "--list"]) == 0
    assert "not recorded" in capsys.readouterr().out


# A chain killed from outside: its first step writes a figure, its second prints its pid and sleeps
KILLED_CHAIN = """
import sys
from switchbench.cli import main
from switchbench.jobs import evidence

def quick(ctx):
    ctx.command([sys.executable, "-c", "import pathlib; pathlib.Path('results/a.txt').write_text('a')"])

def sleeper(ctx):
    ctx.command([sys.executable, "-c", "import pathlib; pathlib.Path('results/b.txt').write_text('b')"])
    ctx.command([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"])

evidence.STEPS = (
    evidence.Step("a", "figure A", 1, quick),
    evidence.Step("b", "figure B", 1, sleeper),
    evidence.Step(evidence.REPORT, "the report", 1, quick, cpu_seconds=0.5),
)
sys.exit(main(["evidence", "--device", "cpu", "--budget", "200", "--pack", "out/e.tar.gz"]))
"""


@pytest.mark.slow  # a chain in a process of its own, killed: seconds
@pytest.mark.parametrize(
    ("how", "reader_gone"),
    [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGTERM, True)],
    ids=["SIGTERM", "SIGKILL", "SIGTERM-tee-gone"],
)
def test_a_chain_killed_mid_step_leaves_the_finished_steps_packed_and_no_step_running(
    how, reader_gone, tmp_path
):
    """A node's time limit kills the chain in its second step: the archive already holds the first step's figure
    and what the second step's first command wrote (it is rewritten after every command), the sleeping command's
    output is in the log as it printed it beside the chain's own lines, and the step dies with the chain though
    it runs in a session of its own. SIGTERM also records the step as stopped and packs once more, even where the
    reader of the chain's output died first (a node's `tee`, killed with the pipeline: the chain's next line
    raised BrokenPipeError, which ended it unpacked, with exit 0)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "chain.py").write_text(KILLED_CHAIN)
    chain = subprocess.Popen([sys.executable, "chain.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    log = tmp_path / "results" / "evidence" / slug(device_name("cpu")) / "log.txt"
    deadline = time.monotonic() + 60
    while not (
        log.exists() and "time.sleep(120)" in log.read_text() and log.read_text().split()[-1].isdigit()
    ):
        assert time.monotonic() < deadline and chain.poll() is None, "the second step never started"
        time.sleep(0.1)
    step = int(log.read_text().split()[-1])  # its pid, streamed to the log as printed
    if reader_gone:
        chain.stdout.close()
    chain.send_signal(how)
    code = chain.wait(timeout=30)
    printed = "" if reader_gone else chain.stdout.read()
    chain.stdout.close()
    assert code == (143 if how == signal.SIGTERM else -signal.SIGKILL), printed
    # the step is killed with the chain: by the chain, or by the kernel at its parent's death
    _ended_soon(step, "the step", "the chain")
    with tarfile.open(tmp_path / "out" / "e.tar.gz") as tar:
        names = set(tar.getnames())
        state = json.load(tar.extractfile(next(n for n in names if n.endswith("state.json"))))
        packed_log = tar.extractfile(next(n for n in names if n.endswith("log.txt"))).read().decode()
    assert "results/a.txt" in names and state["steps"]["a"]["status"] == "done"
    assert "results/b.txt" in names and "== b: figure B" in packed_log
    assert state["environment"]["python"] == sys.version.split()[0]
    if how == signal.SIGKILL:
        assert state["steps"]["b"]["status"] == evidence.KILLED
        assert "results/b.txt" in state["steps"]["b"]["files"]
    if how == signal.SIGTERM:
        assert (state["steps"]["b"]["status"], state["steps"]["b"]["detail"]) == (
            "interrupted",
            "stopped by SIGTERM",
        )
        assert reader_gone or "stopped by SIGTERM; what the finished steps wrote is packed" in printed
        assert "b" not in state["durations"]  # a stop says nothing of how long the step runs


def test_a_short_call_runs_the_steps_that_fit_before_one_that_cannot_end_in_it(tmp_path, monkeypatch):
    """The first step's unconditional chance is for a step nothing else can use the call beside: a short call
    that started a step estimated past its room was stopped with nothing, while the next step would have fitted."""
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("long", "figure L", 1, _writer("long"), cpu_seconds=60),
            evidence.Step("short", "figure S", 1, _writer("short"), cpu_seconds=0.5),
        ),
    )
    first = _chain(tmp_path, budget=20)
    assert [_runs(tmp_path, n) for n in ("long", "short")] == [0, 1]
    assert any(line.startswith("  later  long: needs about 60 s") for line in first["said"])
    _chain(tmp_path, budget=20)  # alone now: it gets its chance
    assert _runs(tmp_path, "long") == 1


def test_a_step_that_reads_another_s_output_waits_until_that_one_is_done(tmp_path, monkeypatch):
    """The ListOps analysis, run while the training was unfinished (stopped, failed, or left for a later call),
    analysed half-trained models (or failed, then skipped as failed) and counted as done."""
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("train", "models", 1, _writer("train", code=3), cpu_seconds=0.5, resumable=True),
            evidence.Step("analyse", "analysis", 1, _writer("analyse"), cpu_seconds=0.5, after=("train",)),
        ),
    )
    first = _chain(tmp_path, budget=20)
    assert first["steps"]["train"]["status"] == "failed" and "analyse" not in first["steps"]
    assert "  waits  analyse: for train" in first["said"]
    monkeypatch.setattr(
        evidence,
        "STEPS",
        _steps(
            evidence.Step("train", "models", 1, _writer("train"), cpu_seconds=0.5, resumable=True),
            evidence.Step("analyse", "analysis", 1, _writer("analyse"), cpu_seconds=0.5, after=("train",)),
        ),
    )
    second = _chain(tmp_path, budget=20, retry_failed=True)
    assert second["steps"]["analyse"]["status"] == "done" and _runs(tmp_path, "analyse") == 1


def test_the_plan_keeps_a_step_after_what_it_reads():
    """--list plays out run_chain's decisions: a step that reads another's output is planned once that one ends,
    not beside it (the plan had the analysis in the training's first call, where the chain says it waits)."""
    budget, reserve = 200, 10.0
    room = budget - reserve - evidence.exit_reserve(budget)
    # the first step leaves 30 s: too little for the training to progress, enough for the analysis
    first = evidence.Step("first", "figure", room - 30, _writer("first"))
    train = evidence.Step("train", "models", 300, _writer("train"), resumable=True)
    analyse = evidence.Step("analyse", "analysis", 10, _writer("analyse"), after=("train",))
    calls = evidence.schedule([first, train, analyse], lambda s: s.gpu_seconds, budget, reserve)
    names = [[s.name for s in call] for call in calls]
    last_training = max(i for i, call in enumerate(names) if "train" in call)
    assert names[0] == ["first"] and all("analyse" not in call for call in names[:last_training])
    assert any("analyse" in call for call in names[last_training:])
