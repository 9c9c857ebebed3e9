"""The GPU chain's steps (``switchbench evidence``): what each runs, on a GPU and in the CPU rehearsal, the figures
it owes, and its expected seconds on a GPU. Each step runs ``switchbench`` (or pytest) commands through a
:class:`Context`, which stops them at the call's deadline. How the chain orders, runs and resumes them is
:mod:`switchbench.jobs.evidence`.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from switchbench.bench.command import slug
from switchbench.core.environment import device_name, environment
from switchbench.core.results import write_atomic
from switchbench.jobs import processes
from switchbench.train.run import default_preset, run_name

ROOT = Path(__file__).resolve().parents[2]  # the checkout: package, tests, pyproject.toml
LISTOPS_RUNS = (("dense", 0), ("switchhead", 0), ("dense", 1))  # the analysis pair and a second dense seed
GPU_PROFILE = ("c4-262m-transformer-h16", "c4-262m-switchhead-h4")
GPU_47M = ("c4-47m-transformer-h10", "c4-47m-switchhead-h2")
REPORT = "report"


def fingerprint() -> str:
    """A hash of the code that produces the figures: the package's and the tests' Python files, pyproject.toml."""
    digest = hashlib.sha256()
    files = sorted([*ROOT.glob("switchbench/**/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "pyproject.toml"])
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class StepFailed(Exception):
    """A command of a step exited non-zero."""


class FailedAtItsEnd(StepFailed):
    """A step that ran to its end and whose results say it failed (tests that failed): how long it took is how long
    it runs."""


class OutOfBudget(Exception):
    """A command of a step was stopped at the end of the budget."""


TAIL_LINES = 30  # of a failed command's output, printed with its failure


@dataclass
class Context:
    """What a step runs with: the device, where results and models go, and the call's deadline."""

    device: str
    results: Path
    runs: Path
    deadline: float  # steps are stopped here: the call's end less the report's reserve
    log: Path
    step: str = ""  # the step running
    # The rehearsal's commands that ran to their end: {(argv, cwd): (step, what it printed)}. GPU steps whose
    # stand-ins are the same command (the 262M and 47M groups both become the tiny one) run it once; a step that
    # runs a command twice (two runs to pool) runs it twice
    rehearsed: dict = field(default_factory=dict)
    # the commands' processes now running (ListOps runs three at once)
    running: set = field(default_factory=set)
    # where the commands' output goes besides the log (a GPU node: the chain's own output, which comes back)
    echo: Callable[[bytes], object] = processes.print_nothing
    # called after each command of a step that ends well (on the main thread): the chain records the step so far
    # and rewrites the archive
    after_command: Callable[[], object] = lambda: None

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def tag(self) -> str:
        return slug(device_name(self.device))

    def switchbench(self, *argv: str) -> dict | None:
        """Run ``switchbench ARGV``; with ``--json`` among them, what it printed, parsed."""
        out = self.command([sys.executable, "-m", "switchbench", *argv])
        return json.loads(out) if "--json" in argv else None

    def command(self, argv: list[str], ok: tuple[int, ...] = (0,), cwd: Path | None = None) -> str:
        """Run ``argv`` (in ``cwd``, default here) to its end or to the deadline, its output streamed to the log;
        -> stdout. An exit status outside ``ok`` is a StepFailed."""
        if self.deadline <= time.monotonic():
            raise OutOfBudget(" ".join(argv[:4]))
        key = (tuple(argv), cwd)
        step, out = self.rehearsed.get(key, (self.step, ""))
        if step != self.step:
            with self.log.open("a") as log:
                log.write(f"$ {' '.join(argv)}\n(ran to its end in step {step}: not run again)\n")
            return out
        out = self._run(argv, ok, cwd)
        # A command that failed or was stopped ends its step, which records it. Only the main thread records:
        # a step's own threads (ListOps) would race it and each other over the state and the archive
        if threading.current_thread() is threading.main_thread():
            self.after_command()
        if not self.gpu:
            self.rehearsed[key] = (self.step, out)
        return out

    def _run(self, argv: list[str], ok: tuple[int, ...], cwd: Path | None) -> str:
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(argv)}\n")
        self.echo(f"$ {' '.join(argv)}\n".encode())
        since = self.log.stat().st_size
        process = processes.start(argv, env, cwd, self.log, forked=not self.gpu)
        self.running.add(process)
        try:
            # the time left once it started: the rehearsal's first fork waits for its server's imports (5 s)
            out, killed = processes.output(process, self.deadline - time.monotonic(), self.log, self.echo)
        finally:
            self.running.discard(process)
        if killed:
            raise OutOfBudget(" ".join(argv[:4]))
        if process.returncode not in ok:
            raise StepFailed(
                f"{' '.join(argv[:5])} ... exited {process.returncode} (see {self.log})\n{self._tail(since)}"
            )
        return out

    def stop(self) -> None:
        """Kill every command running, those of other threads too (a signal reaches the main thread alone)."""
        for process in list(self.running):
            processes.kill(process)

    def _tail(self, since: int, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` the log received from byte ``since`` on (a command's stdout and stderr): a failure
        shows its cause where the chain's own output goes, not only in an archive that may never come back."""
        with self.log.open("rb") as log:
            log.seek(since)
            return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class Step:
    """One step: its name, the figures it owes, its expected seconds on a GPU, and what it runs."""

    name: str
    owes: str
    gpu_seconds: float
    run: Callable[[Context], object]
    needs_gpu: bool = False
    cpu_seconds: float = 20.0  # the rehearsal's
    resumable: bool = False  # a call stopped by the budget keeps what it did; the next continues from there
    after: tuple[str, ...] = ()  # steps whose output it reads: it waits until they are done


# The steps


def _tests(marker: str, cpu_file: str, shard: tuple[int, int] = (0, 1)) -> Callable[[Context], object]:
    """pytest on ``marker``'s tests; on a GPU the ``shard``-th of ``n`` equal shares of the test files, on the CPU
    ``cpu_file`` alone. Each test's outcome is logged as it ends (pytest-reportlog), so a part stopped by the
    budget keeps what it ran, and the next call of the same code runs only the tests not yet logged."""

    def run(ctx: Context):
        _needs_reportlog()
        index, count = shard
        part = f"{marker.replace(' ', '-')}-part{index + 1}of{count}-{fingerprint()}"
        folder = ctx.results / "tests" / ctx.tag
        folder.mkdir(parents=True, exist_ok=True)
        earlier = sorted(folder.glob(f"{part}-*.jsonl"))
        # a test that failed runs again (a retry, or the part going on): its outcome is the latest log's
        finished = [node for node, outcome in test_outcomes(earlier).items() if outcome != "failed"]
        log = folder / f"{part}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        argv = [*pytest_command(workers=8 if ctx.gpu else 0), f"--report-log={log}"]  # one GPU, 8 workers
        argv += [f"--deselect={node}" for node in finished]
        if ctx.gpu:
            argv += ["-m", marker, *map(str, sorted((ROOT / "tests").glob("test_*.py"))[index::count])]
        else:
            argv.append(str(ROOT / "tests" / cpu_file))
        try:
            # in the checkout, whatever the chain's folder: some tests read its git history
            ctx.command(argv, ok=(0, 1, NO_TESTS_LEFT), cwd=ROOT)  # 1: some failed, named by the summary
        finally:
            summary = _tests_summary([*earlier, log], ctx, marker)
            write_atomic(folder / f"{part}.json", json.dumps(summary, indent=2))
        if summary["failed"]:  # this call's failures and those an earlier call of the part logged
            # a call that ran the whole part took as long as the part runs; one that went on from an earlier
            # call's log (or ran its failures again) took less
            failure = StepFailed if finished else FailedAtItsEnd
            raise failure(f"{len(summary['failed'])} failed, first {summary['failed'][0]}")

    return run


def _needs_reportlog() -> None:
    """Steps that run tests read each test's outcome from pytest-reportlog's log."""
    if importlib.util.find_spec("pytest_reportlog") is None:
        raise StepFailed(
            "pytest-reportlog is not installed: install the node-test extra, "
            "pip install --no-index --find-links wheelhouse -e '.[node-test]' (docs/gpu-nodes.md)"
        )


def pytest_command(workers: int = 0) -> list[str]:
    """pytest, quiet and without its cache, on ``workers`` pytest-xdist workers where xdist is installed (none:
    in this process)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if workers and importlib.util.find_spec("xdist"):
        argv += ["-n", str(workers)]
        if importlib.util.find_spec("pytest_benchmark"):
            # pytest-benchmark before 5.3 warns at start-up under xdist unless told: with warnings as errors the
            # whole run stops there (pytest exit 3, seen on an H200 node's 5.2.3)
            argv.append("--benchmark-disable")
    return argv


# The rehearsal's test parts each run this small file: the logic of a part is the same whatever it runs, and a part
# costs the rehearsal pytest's start and the file's tests (test_config.py took 10.7 s, this 3.4 s)
REHEARSAL_TESTS = "test_environment.py"
NO_TESTS_LEFT = 5  # pytest's exit status when nothing was collected: every test of the part ran before


def test_outcomes(logs: list[Path]) -> dict[str, str]:
    """{test id: passed | failed | skipped} of every test whose teardown a report log holds: a test fails if any
    of its phases failed, is skipped if its setup or call was, and passed otherwise."""
    outcomes = {}
    for log in logs:  # oldest first: a test run again has its latest log's outcome
        phases: dict[str, dict[str, str]] = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            try:
                report = json.loads(line)
            except json.JSONDecodeError:  # the last line of a log whose writer was killed
                continue
            if report.get("$report_type") == "TestReport":
                phases.setdefault(report["nodeid"], {})[report["when"]] = report["outcome"]
        for node, seen in phases.items():
            # a crashed worker's test has one report, failed, of no phase ("???"): no teardown follows it
            if "teardown" not in seen and "failed" not in seen.values():
                continue  # stopped midway: runs again
            outcomes[node] = (
                "failed"
                if "failed" in seen.values()
                else "skipped"
                if "skipped" in seen.values()
                else "passed"
            )
    return outcomes


def session_status(log: Path) -> int | None:
    """pytest's exit status as its report log ends it; None where the log has no end (pytest killed)."""
    for line in reversed(log.read_text().splitlines() if log.exists() else []):
        with contextlib.suppress(json.JSONDecodeError):
            report = json.loads(line)
            if report.get("$report_type") == "SessionFinish":
                return report.get("exitstatus")
    return None


def _tests_summary(logs: list[Path], ctx: Context, marker: str) -> dict:
    outcomes = test_outcomes(logs)
    counts = {kind: sum(o == kind for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    return {
        "metadata": environment(ctx.device) | {"selection": marker if ctx.gpu else "rehearsal"},
        "counts": counts | {"tests": len(outcomes)},
        "passed": counts["passed"],
        "failed": sorted(node for node, outcome in outcomes.items() if outcome == "failed"),
        "logs": [log.name for log in logs if log.exists()],
    }


def _kernel_tune(size: str) -> Callable[[Context], object]:
    def run(ctx: Context):
        ctx.switchbench("kernel-tune", "--sizes", size)

    return run


def _kernel_bench(ctx: Context):
    """Both sizes' cases timed eagerly, then on a GPU the 262M ones from CUDA graphs, as a practitioner's captured
    step runs them: the difference is what the host's launches cost each op."""
    sizes = ["47m", "262m"] if ctx.gpu else ["47m"]
    extra = [] if ctx.gpu else ["--batch", "1", "--dtype", "fp32"]
    where = ["--device", ctx.device, "--out", str(ctx.results / "kernels")]
    ctx.switchbench("kernel-bench", "--sizes", *sizes, *where, *extra)
    if ctx.gpu:
        ctx.switchbench("kernel-bench", "--sizes", "262m", "--cuda-graphs", *where)


# Each GPU speed group is a step of its own (saved when it ends); the rehearsal stands in a tiny group for it.
REHEARSAL_GROUP = {"47m": "tiny", "45m-rope": "tiny-rope", "262m": "tiny", "244m-rope": "tiny-rope"}


# The pair a node with several GPUs also times data-parallel, at the paper's batch of 64 over its GPUs (Table 5)
DDP_PAIR = ("c4-262m-transformer-h16", "c4-262m-switchhead-h4")


def _speed(group: str, compiled: bool = False) -> Callable[[Context], object]:
    def run(ctx: Context):
        gpus = torch.cuda.device_count() if ctx.gpu else 0
        if group == "262m" and not compiled and gpus > 1:
            argv = ["speed", "--device", "cuda", "--presets", *DDP_PAIR, "--scopes", "model", "--batch", "64"]
            launch = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={gpus}",
            ]
            ctx.command([*launch, "-m", "switchbench", *argv, "--out", str(ctx.results / "speed")])
        # the rehearsal compiles with the 'eager' backend: Dynamo's capture without Inductor's minutes. Eager is
        # the paper-like setting, with the authors' explicit softmax (auto would take SDPA on a GPU: an H200 did)
        if not compiled:
            flags = ["--attention", "explicit"]
        else:
            flags = ["--compile"] if ctx.gpu else ["--compile", "eager"]
        _speed_group(ctx, group, *flags)

    return run


def _speed_practitioner(group: str) -> Callable[[Context], object]:
    """The group's training steps as a practitioner runs them: fused attention (SDPA) and each step replayed from
    one CUDA graph, at the paper's whole batch of 64 on one GPU (halved until the group fits, the halves' gradients
    accumulated); beside the eager, explicit-attention step of ``speed-<group>``, the paper-like setting."""

    def run(ctx: Context):
        _speed_group(ctx, group, "--attention", "sdpa", *(_PRACTITIONER_GPU if ctx.gpu else ()))

    return run


# How a practitioner's step runs on a GPU (the rehearsal has no CUDA graphs)
_PRACTITIONER_GPU = ("--cuda-graphs", "--scopes", "model", "--fit-from", "64")


CONTEXT_PAIR = ("wikitext103-244m-transformer-h16", "wikitext103-243m-switchhead-h4")
# Chunk lengths at a fixed number of tokens a step; the rehearsal's tiny pair at two short ones
CONTEXTS, CONTEXT_TOKENS = (512, 1024, 2048, 4096, 8192), 16384
REHEARSAL_PAIR = ("tiny-transformer-rope", "tiny-switchhead-rope")


def _speed_contexts(ctx: Context):
    """The 244M RoPE pair's training steps from 512 to 8192 tokens of context at 16,384 tokens a step, SDPA attention
    (a fused kernel with no bias to read: RoPE has none on its logits, where XL's relative term is an [L, L] tensor
    a head at any length) and CUDA graphs, each row beside the exact MAC ratio at its length: where MoE attention
    pays off."""
    pair, contexts, tokens = (
        (CONTEXT_PAIR, CONTEXTS, CONTEXT_TOKENS) if ctx.gpu else (REHEARSAL_PAIR, (16, 32), 64)
    )
    for T in contexts:
        # on a GPU as a practitioner trains: each step from one CUDA graph (eager, SwitchHead's step waits on the host)
        gpu = ["--scopes", "model", "--cuda-graphs"]
        flags = gpu if ctx.gpu else ["--scopes", "layer", "--rounds", "2", "--warmup", "1"]
        ctx.switchbench(
            "speed",
            "--device",
            ctx.device,
            "--out",
            str(ctx.results / "speed-context"),
            "--presets",
            *(f"{name}:T={T}" for name in pair),
            "--batch",
            str(tokens // T),
            "--attention",
            "sdpa",
            *flags,
        )


def _speed_flex(ctx: Context):
    """The 262M dense and SwitchHead pair as a practitioner trains it on FlexAttention, which reads XL's relative
    term inside its kernel where SDPA reads a [t, S] mask built for it: CUDA graphs, batch 64 where it fits. The
    rehearsal runs the tiny pair on SDPA (torch has no FlexAttention backward on the CPU)."""
    if ctx.gpu:
        _speed_group(ctx, None, "--presets", *GPU_PROFILE, "--attention", "flex", *_PRACTITIONER_GPU)
    else:
        _speed_group(ctx, None, "--presets", "tiny-transformer", "tiny-switchhead", "--attention", "sdpa")


def _flash(ctx: Context):
    """The 262M dense and SwitchHead pair on Triton's flash attention, which reads XL's term by distance inside
    the kernel and writes its gradient there (the memory-efficient kernel took 99 of dense's 298 ms of kernel time
    at batch 64 on an H200): its tests on this GPU, then the pair as a practitioner trains it, SwitchHead on
    all_experts routed by Triton, then where each step's kernel time goes. The rehearsal runs the tiny pair on
    SDPA (Triton runs on the CPU only in its interpreter)."""
    expert = _all_experts_sort_free(ctx)
    if not ctx.gpu:
        _speed_group(
            ctx, None, "--presets", "tiny-transformer", "tiny-switchhead", "--attention", "sdpa", *expert
        )
        return
    _needs_reportlog()
    # its fast tests first, on this GPU (bf16 against float64 and SDPA among them). Four workers compile their
    # kernels side by side (each case is a compilation here); the slow cases wait for the slow tests' steps.
    # A failure does not stop the timing, the call's headline figure: the step fails at its end, naming the
    # tests, and whether the times stand (a tolerance missed, or a wrong kernel) is read from them
    folder = ctx.results / "tests" / ctx.tag
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"flash-{fingerprint()}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    tests = [*pytest_command(workers=4), f"--report-log={log}", "-m", "not slow"]
    ctx.command([*tests, str(ROOT / "tests" / "test_flash_attention.py")], ok=(0, 1), cwd=ROOT)
    flags = ("--attention", "triton", *expert)
    _speed_group(ctx, None, "--presets", *GPU_PROFILE, *flags, *_PRACTITIONER_GPU)
    where = ("--device", ctx.device, "--out", str(ctx.results / "profile"), "--fit-from", "64", "--top", "60")
    ctx.switchbench("profile", *GPU_PROFILE, *flags, *where)
    failed = sorted(node for node, outcome in test_outcomes([log]).items() if outcome == "failed")
    if failed:
        raise FailedAtItsEnd(
            f"{len(failed)} flash tests failed, first {failed[0]} (the pair was timed all the same)"
        )
    if (status := session_status(log)) != 0:  # a failure the log names no test for
        raise StepFailed(f"the flash tests exited {status} (see {ctx.log}; the pair was timed all the same)")


def _flash_compiled(pair: tuple[str, str]) -> Callable[[Context], object]:
    """A dense and SwitchHead pair as a practitioner trains it at its best: Triton's flash attention, each block
    compiled by Inductor (its norms, casts and residual adds fused), the step replayed from one CUDA graph, batch
    64, SwitchHead on all_experts routed by Triton. The rehearsal compiles the tiny pair with the 'eager'
    backend."""

    def run(ctx: Context):
        expert = _all_experts_sort_free(ctx)
        if not ctx.gpu:
            tiny = ("--presets", "tiny-transformer", "tiny-switchhead")
            _speed_group(ctx, None, *tiny, "--attention", "sdpa", "--compile", "eager", *expert)
            return
        flags = ("--attention", "triton", "--compile", *expert, *_PRACTITIONER_GPU)
        _speed_group(ctx, None, "--presets", *pair, *flags)

    return run


def _speed_group(ctx: Context, group: str | None, *flags: str) -> None:
    """``speed`` of a group (None: the flags name the presets), in the rehearsal at a CPU's tiny settings."""
    cpu = ["--scopes", "layer", "--batch", "1", "--rounds", "2", "--warmup", "1"]
    where = [] if group is None else ["--groups", group if ctx.gpu else REHEARSAL_GROUP[group]]
    out = ["--out", str(ctx.results / "speed")]
    ctx.switchbench("speed", "--device", ctx.device, *out, *where, *([] if ctx.gpu else cpu), *flags)


def _decode(group: str) -> Callable[[Context], object]:
    """Inference over the default grid (batch 1, 16, 64 x context 512, 2048, 8192 where it fits), five rounds: the
    largest cell's prefill is the step's longest call. A run saves each cell as it ends and a stopped one is
    continued (``--resume``), so the grid can take several calls."""

    def run(ctx: Context):
        cpu = ["--batches", "1", "--contexts", "8", "--rounds", "1", "--warmup", "0"]
        where = [
            "--groups",
            group if ctx.gpu else REHEARSAL_GROUP[group],
            "--out",
            str(ctx.results / "decode"),
        ]
        rounds = ["--rounds", "5"] if ctx.gpu else cpu
        ctx.switchbench("decode", "--device", ctx.device, *where, *rounds, "--resume")

    return run


def _speed_per_implementation(ctx: Context):
    """The 262M dense and SwitchHead pair as a practitioner trains it (SDPA, CUDA graphs, batch 64 where it fits) on
    the fixed expert-matmul implementations, routed without a sort or torch's top-k by Triton's kernels: all_experts
    (never timed in a step on a GPU), grouped_mm, and Triton's matmul, which speed-practitioner-262m ran with the
    sort (``auto``). The rehearsal runs the tiny pair, the count for Triton's routing and the CPU's padded
    implementation for Triton's matmul."""
    sort_free = _sort_free_routing(ctx)
    runs = [
        ("all_experts", sort_free),
        ("grouped_mm", sort_free),
        ("triton" if ctx.gpu else "torch", sort_free),
    ]
    pair = GPU_PROFILE if ctx.gpu else ("tiny-transformer", "tiny-switchhead")
    practitioner = ("--attention", "sdpa", *(_PRACTITIONER_GPU if ctx.gpu else ()))
    for impl, routing in runs:
        flags = ("--expert-matmul", impl, "--routing", routing)
        _speed_group(ctx, None, "--presets", *pair, *flags, *practitioner)


def _profile(ctx: Context):
    presets = GPU_PROFILE if ctx.gpu else ("tiny-transformer", "tiny-switchhead")
    # On a GPU the paper's whole batch of 64 where it fits (where the MoE overhead's target stands), and enough
    # kernels to account for the routing share kernel by kernel (the top 15 left most of its 42.6 ms unnamed)
    extra = ["--fit-from", "64", "--top", "60"] if ctx.gpu else ["--steps", "1", "--warmup", "0"]
    where = ["--device", ctx.device, "--out", str(ctx.results / "profile"), *extra]
    ctx.switchbench("profile", *presets, "--forward", *where)
    # SwitchHead's step with neither a sort nor torch's top-k: every expert computed, the experts ranked by Triton's
    # one launch a router
    routing = ("--routing", _sort_free_routing(ctx))
    ctx.switchbench("profile", presets[1], "--expert-matmul", "all_experts", *routing, *where)


def _all_experts_sort_free(ctx: Context) -> tuple[str, ...]:
    """SwitchHead's expert matmul as the flash steps run it: every expert computed, routed without a sort."""
    return ("--expert-matmul", "all_experts", "--routing", _sort_free_routing(ctx))


def _sort_free_routing(ctx: Context) -> str:
    """Routing without a sort or torch's top-k: Triton's kernels on a GPU; the rehearsal's CPU counts in elementwise
    kernels instead (Triton runs there only in its interpreter)."""
    return "triton" if ctx.gpu else "count"


def _gate_baseline(ctx: Context):
    """Two quick runs of the gate's layers on this device, pooled into its own baseline; the rehearsal's of the
    tiny pair, at the fewest rounds a baseline is written from (an interval of the median needs 6)."""
    rounds = [] if ctx.gpu else ["--rounds", "6", "--presets", "tiny-transformer", "tiny-switchhead"]
    out = str(ctx.results / "speed-gate")
    runs = [
        ctx.switchbench("speed", "--quick", "--device", ctx.device, "--out", out, "--json", *rounds)["saved"]
        for _ in range(2)
    ]
    ctx.switchbench(
        "check", *runs, "--write", "--baseline", str(ctx.results / "baselines" / f"{ctx.tag}.json")
    )


def _quality(ctx: Context):
    extra = ["--quick"] if ctx.gpu else ["--steps", "2", "--seeds", "2", "--families", "dense", "switchhead"]
    ctx.switchbench("quality", "--device", ctx.device, "--out", str(ctx.results / "quality"), *extra)


def _listops_runs(ctx: Context) -> list[Path]:
    return [
        ctx.runs / run_name("listops", default_preset("listops", model), seed) for model, seed in LISTOPS_RUNS
    ]


def _listops(ctx: Context):
    """The pair and the second dense seed, trained side by side: three small models leave a GPU mostly idle.
    Training checkpoints every evaluation, so a call stopped by its budget is continued by the next one."""
    # On a GPU the authors' batch of 512 (ten million examples in 20,000 steps): on the CPU at batch 128 the three
    # needed 5.3 to 8.0 million to reach the 85% the analysis needs, and sum-modulo stayed under 70%
    steps = (
        ["--steps", "20000", "--batch", "512", "--eval-every", "500"]
        if ctx.gpu
        else ["--steps", "2", "--eval-every", "2", "--batch", "4"]
    )

    def start(folder: Path) -> str:
        # A model left by an earlier call (on this node, or brought back in its archive and unpacked) continues,
        # whatever code trained it: GPU time is too scarce to train it again, and train refuses a checkpoint of
        # another model or task
        return "--resume" if (folder / "checkpoint.pt").exists() else "--force"

    commands = [
        [
            sys.executable,
            "-m",
            "switchbench",
            "train",
            "--task",
            "listops",
            "--model",
            model,
            "--seed",
            str(seed),
            "--device",
            ctx.device,
            "--out",
            str(folder),
            start(folder),
            *steps,
        ]
        for (model, seed), folder in zip(LISTOPS_RUNS, _listops_runs(ctx), strict=True)
    ]
    failures = []
    # daemons: a chain stopped by a signal kills their commands (Context.stop) and exits without waiting on them
    threads = [
        threading.Thread(target=_collect, args=(ctx, argv, failures), daemon=True) for argv in commands
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def _collect(ctx: Context, argv: list[str], failures: list) -> None:
    try:
        ctx.command(argv)
    except (StepFailed, OutOfBudget) as error:
        failures.append(error)


def _analysis(ctx: Context):
    checkpoints = [str(folder / "checkpoint.pt") for folder in _listops_runs(ctx)]
    sample = [] if ctx.gpu else ["--sample", "16"]  # the rehearsal's models are two steps old
    ctx.switchbench("analyze", *checkpoints, "--out", str(ctx.results / "analysis" / "listops"), *sample)


def _report(ctx: Context):
    ctx.switchbench("report", "--results", str(ctx.results), "--out", str(ctx.results / "report.html"))


# Declared GPU seconds are estimates for an H100 (a step's last duration on the device replaces them); each
# non-resumable step fits one call's budget less the report's reserve with room to spare (the planner's test).
FAST_TEST_PARTS = 5  # the fast tests took about 570 s with 8 workers on an H100: parts of about 2 minutes


def _speed_step(group: str, seconds: float) -> Step:
    return Step(
        f"speed-{group}",
        f"training-step and layer times, memory and ratios of the {group} group (eager, explicit softmax)",
        seconds,
        _speed(group),
    )


def _practitioner_step(group: str, seconds: float) -> Step:
    return Step(
        f"speed-practitioner-{group}",
        f"the {group} group as a practitioner trains it: SDPA, CUDA graphs, batch 64 where it fits",
        seconds,
        _speed_practitioner(group),
    )


STEPS = (
    # Figures first: a node's first call must bring back the headline (the 262M and 47M groups as a practitioner
    # trains them, where the 262M step's time goes, then the paper-like setting) before anything long
    # 143 s on an H200 with three of its six members built; all six may take a second build at half the batch
    _practitioner_step("262m", 300),
    _practitioner_step("47m", 120),  # 88 s on an H200
    Step(
        "profile",
        "the 262M dense and SwitchHead steps in named shares at batch 64 where it fits, SwitchHead's on all_experts too",
        120,  # 46 s on an H100, 52 s on an H200; then SwitchHead alone on all_experts, never run on a GPU
        _profile,
    ),
    Step(
        "speed-practitioner-262m-triton",
        "the 262M dense and SwitchHead pair on Triton's flash attention (XL's term in the kernel): times and profile",
        # its tests, the pair at batch 64 (about 65 s on an H200), its profile (about 50 s), and the first launches'
        # timing of the kernels' block shapes (about 24 compilations): never run on a GPU
        250,
        _flash,
    ),
    Step(
        "speed-practitioner-262m-compiled",
        "the 262M dense and SwitchHead pair at its best: flash attention, compiled blocks, CUDA graphs, batch 64",
        200,  # two compilations of one block each (Inductor, fwd+bwd) and the pair's timing: 71 s on an H200
        _flash_compiled(GPU_PROFILE),
    ),
    Step(
        "speed-practitioner-47m-compiled",
        "the 47M dense and SwitchHead pair at its best: flash attention, compiled blocks, CUDA graphs, batch 64",
        # the 47M group's SDPA step runs XL's term through cuDNN, 6% of the matmul peak on an H200: no baseline a
        # practitioner would keep. Never run on a GPU: the 262M pair's took 71 s on an H200 with Triton's and
        # Inductor's caches warm, and the 47M pair's head widths compile kernels of their own
        120,
        _flash_compiled(GPU_47M),
    ),
    Step(
        "speed-expert-matmul",
        "the 262M dense and SwitchHead pair as a practitioner trains it on all_experts, grouped_mm and Triton, routed by Triton",
        200,  # three runs of the pair, never run on a GPU
        _speed_per_implementation,
    ),
    _speed_step("262m", 110),
    _speed_step("47m", 125),  # 124 s on an H100
    Step(
        "speed-practitioner-262m-flex",
        "the 262M dense and SwitchHead pair as a practitioner trains it on FlexAttention (XL's term in the kernel)",
        150,  # half the six-member step, and FlexAttention's compilation: never run on a GPU
        _speed_flex,
    ),
    # The fast tests in parts, each test's outcome kept as it ends: a part stopped by the budget goes on from there
    *(
        Step(
            f"tests-{i + 1}",
            f"the fast tests on this device, part {i + 1} of {FAST_TEST_PARTS}",
            120,
            _tests("not slow", REHEARSAL_TESTS, (i, FAST_TEST_PARTS)),
            resumable=True,
        )
        for i in range(FAST_TEST_PARTS)
    ),
    # stopped by the budget at 226 s on an H100
    Step("speed-compiled-262m", "the 262m group under torch.compile", 300, _speed("262m", compiled=True)),
    *(
        Step(
            f"kernel-tune-{size}",
            f"the shipped table of tuned Triton configurations at {size.upper()}",
            seconds,
            _kernel_tune(size),
            needs_gpu=True,
        )
        for size, seconds in (("47m", 140), ("262m", 180))  # 30 s each for flash attention's 24 compilations
    ),
    Step(
        "kernel-bench",
        "expert-matmul throughput at 47M and 262M against dense, and at 262M from CUDA graphs",
        180,  # 150 before the graphs' run was added
        _kernel_bench,
    ),
    # The 244M RoPE group as a practitioner trains it, in place of the RoPE groups' eager steps (no RoPE model is in
    # the paper's Table 5): RoPE's dense baseline is the one trained today, with no position bias for the kernel
    # to read
    _practitioner_step("244m-rope", 200),
    Step(
        "speed-context",
        "the 244M RoPE pair's step-time ratio from 512 to 8192 tokens of context, beside its MAC floor at each",
        200,
        _speed_contexts,
    ),
    *(
        # Resumable: each cell is saved as it ends and --resume continues the grid, though each start re-checks and
        # rebuilds its six models before its next cell (a start in a short leftover may do little more)
        Step(
            f"decode-{group}",
            f"KV cache, prefill and decode of the {group} group",
            seconds,
            _decode(group),
            resumable=True,
        )
        for group, seconds in (("262m", 300), ("47m", 150))
    ),
    Step("gate-baseline", "this GPU's gate baseline (two quick runs pooled)", 150, _gate_baseline),
    *(
        Step(
            f"tests-slow-{i + 1}",
            f"the slow tests on this device, part {i + 1} of 2",
            240,
            _tests("slow", REHEARSAL_TESTS, (i, 2)),
            resumable=True,
        )
        for i in range(2)
    ),
    *(
        Step(
            f"speed-compiled-{group}",
            f"the {group} group under torch.compile",
            seconds,
            _speed(group, compiled=True),
        )
        for group, seconds in (("47m", 110), ("45m-rope", 110), ("244m-rope", 150))
    ),
    Step("quality", "quality --quick at equal parameters on this device", 240, _quality),
    Step(
        "listops", "the ListOps analysis pair and a second dense seed, trained", 600, _listops, resumable=True
    ),
    Step("analysis", "routing analysis of the ListOps models", 120, _analysis, after=("listops",)),
    # 5 s over every committed result on 2 CPU cores
    Step(REPORT, "the report over all results", 20, _report),
)
