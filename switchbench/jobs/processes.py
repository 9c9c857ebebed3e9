"""Running a step's command to a deadline: its output read whatever its descendants do with the pipe, and a stop
that reaches its whole session and every process it started.

On the CPU the evidence chain's rehearsal forks its ``python -m switchbench`` and ``python -m pytest`` commands from
a server that has already imported torch, the command line and pytest (multiprocessing's forkserver): each of its
~35 commands starts without the 2.5 s an interpreter takes to import them, nor the 1.6 s of torch._dynamo, which the
first call of any custom op (the expert matmul) imports. A GPU node starts each in a fresh interpreter, as a user
would.
"""

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# The modules whose `python -m` commands the rehearsal forks, and what the server imports before any fork
FORKED = ("switchbench", "pytest")
PRELOAD = ["torch", "torch._dynamo", "switchbench.cli", "pytest"]  # one that is not installed is passed over
_FORKS = multiprocessing.get_context("forkserver")
# A forked child's exit status is read once, from the server's pipe, by whichever poll comes first: each start
# polls every other child (Process.start's clean-up), and a poll that lost the read to another thread's took the
# status for 255 (12 in 1,000 quick commands from four threads; ListOps starts three at once). Starts and polls
# take turns.
_POLLING = threading.Lock()


class _Forked:
    """``python -m MODULE ARGS`` in a process forked from the server, with what ``output`` and ``kill`` use of a
    Popen: its pid (a session of its own), its stdout pipe, wait() and returncode. The server imported its modules
    under the environment of its start; each command gets ``env`` for what it reads while it runs."""

    def __init__(self, module: str, args: list[str], env: dict, cwd: Path | None, stderr: Path):
        # set here, not at import: the preload is the process's one forkserver's, which other code may use too
        _FORKS.set_forkserver_preload(PRELOAD)
        self.stdout, writer = _FORKS.Pipe(duplex=False)
        target, options = _module_forked, (module, args, env, cwd, writer, stderr)
        self._process = _FORKS.Process(target=target, args=options, name=f"python -m {module}")
        with _POLLING:
            self._process.start()
        writer.close()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        with _POLLING:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        multiprocessing.connection.wait([self._process.sentinel], timeout)  # the waiting, without a poll
        with _POLLING:
            self._process.join(0)  # the reading of its status, and its removal from the children polled
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode


def _module_forked(module: str, args: list[str], env: dict, cwd: Path | None, stdout, stderr: Path) -> None:
    os.setsid()  # as start_new_session: a stop kills the command's whole session
    die_with_parent()  # the server, which ends with the chain
    os.dup2(stdout.fileno(), 1)
    stdout.close()
    err = os.open(stderr, os.O_WRONLY | os.O_APPEND)
    os.dup2(err, 2)
    os.close(err)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED's promise: what it printed survives a stop
    sys.argv = [module, *args]
    sys.path.insert(0, os.getcwd())  # as `python -m` puts the folder it starts in first
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def start(
    argv: list[str], env: dict, cwd: Path | None, stderr: Path, forked: bool
) -> "subprocess.Popen | _Forked":
    """``argv`` started in a session of its own, its stdout a pipe and its stderr appended to ``stderr``; with
    ``forked``, a ``python -m`` command of FORKED is forked from the preloaded server instead."""
    if forked and argv[:2] == [sys.executable, "-m"] and argv[2] in FORKED:
        return _Forked(argv[2], argv[3:], env, cwd, stderr)
    with stderr.open("a") as log:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# resolved here, once: a child between fork and exec must not load libraries (threads may hold the loader's lock)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that started it ends. A step runs in a session of its own
    (so that a stop reaches its workers), which a kill of the chain does not reach: a chain killed from outside (a
    node's time limit) left its step running, holding the GPU's memory into the next call on the same machine."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def print_nothing(data: bytes) -> None:
    pass


class Echo:
    """Bytes copied to ``stream`` as they come, until its reader is gone (a node's `tee`, killed with the chain's
    pipeline at its time limit): then let go, as the pipe it copies must still be read or the step would block."""

    def __init__(self, stream: BinaryIO):
        self.stream: BinaryIO | None = stream

    def __call__(self, data: bytes) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):  # a broken pipe, or a stream closed
            self.stream = None


# Seconds the output pipe may stay open after the step's process ended, or after it was killed
STRAY_GRACE = 5.0


def output(
    process: "subprocess.Popen | _Forked",
    seconds: float,
    log: Path,
    echo: Callable[[bytes], object] = print_nothing,
) -> tuple[str, bool]:
    """What ``process`` printed, appended to ``log`` and handed to ``echo`` as it comes (a chain killed mid-step
    keeps it), and whether it had to be killed at the end of ``seconds``. The pipe is read on a thread of its own:
    a descendant that outlives the process (or escaped the kill) may hold it open, and the call must end anyway;
    it is given STRAY_GRACE seconds, then killed if it can be found, then the pipe is let go. Stopped itself (a
    signal's exception), it kills the process before it lets the exception go on."""
    chunks: list[bytes] = []
    fd, stop = process.stdout.fileno(), threading.Event()

    def drain():
        with log.open("ab") as sink:
            while not stop.is_set():
                if select.select([fd], [], [], 0.1)[0]:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        return
                    chunks.append(data)
                    sink.write(data)
                    sink.flush()
                    echo(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    killed = False
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        killed = True
        kill(process)
        _reap(process)
    except BaseException:
        kill(process)
        _reap(process)
        stop.set()
        raise
    reader.join(STRAY_GRACE)
    if reader.is_alive():  # a stray holds the pipe: stop it if it is still in the step's session or tree
        kill(process)
        reader.join(STRAY_GRACE)
    stop.set()
    reader.join()
    process.stdout.close()
    return b"".join(chunks).decode(errors="replace"), killed


def _reap(process: "subprocess.Popen | _Forked") -> None:
    """Wait for a killed process, for STRAY_GRACE seconds at most: one stuck in the kernel (a GPU driver's teardown)
    must not hold the chain past its own deadline."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STRAY_GRACE)


def kill(process: "subprocess.Popen | _Forked") -> None:
    """SIGKILL the step's whole session (pytest and compile workers) and every descendant of its process: one that
    left the session (setsid) is still found through its parent, so every target is found before any is killed.
    SIGKILL, since a process may ignore SIGTERM."""
    targets = _session_and_descendants(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _session_and_descendants(root: int) -> set[int]:
    """The processes in ``root``'s session (started with a session of its own, its id is ``root``) and every
    descendant of ``root``, from /proc (empty where there is none)."""
    parents, sessions = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the fields after the command's name, which may hold spaces
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        pid = int(stat.parent.name)
        parents[pid], sessions[pid] = int(fields[1]), int(fields[3])
    found = {pid for pid, session in sessions.items() if session == root}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    found.discard(os.getpid())
    return found
