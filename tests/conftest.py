import os

import pytest
from hypothesis import settings

from switchbench.core.versions import triton_interpreter_problem
from switchbench.jobs.processes import die_with_parent

# The same examples on every run and machine: a property that fails in CI fails here too, from its seed alone.
settings.register_profile("switchbench", derandomize=True, database=None)
settings.load_profile("switchbench")


def pytest_configure(config):
    """The process that runs tests chooses Triton's interpreter where there is no GPU, before triton.jit runs,
    and under pytest-xdist takes one intra-op thread. pytest-xdist's controller runs none, so it leaves torch
    unimported (3 s before its workers start) unless the installed Triton and numpy cannot interpret: then the run
    stops before any test, in one line."""
    # where it interprets, a hundred tests would fail with a TypeError
    if reason := triton_interpreter_problem():
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"the test suite {reason}")
    if config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # triton.jit reads TRITON_INTERPRET where a kernel is defined: defined later, under a test that unsets it
        # to check a refusal, a module's kernels stayed compiled ones ("0 active drivers") for the rest of the
        # process
        from switchbench.ops.attention import flash, position_kernels  # noqa: F401
        from switchbench.ops.expert_matmul import routing_kernels, slot_kernels, triton_kernels  # noqa: F401
    # Each worker, and each process its tests start, gets one intra-op thread: with PyTorch's default of one per
    # core the workers' thread pools spun against each other, and two workers on two cores took as long as one
    # (the fast tests: 145 s against 138 s serial; 75 s with one thread each).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # A worker dies with its controller: the evidence chain stops a test step by killing its session, but a
        # chain killed from outside (a node's time limit) takes only the controller with it, and a worker left in
        # a long GPU test would hold the device into the node's next call
        die_with_parent()


def pytest_collection_modifyitems(items):
    """Under pytest-xdist's worksteal, which hands each of N workers a contiguous Nth of this order, every share
    starts with an equal deal of the slow tests: the longest start at once on every worker, the short ones fill the
    gaps after (with the slow tests first in one block, one worker ran them all while the other ran out of work)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = [item for w in range(workers) for item in slow[w::workers] + fast[w::workers]]


def pytest_collection_finish(session):
    """What collection imported (torch, the package, every test module) exempted from the garbage collector, as the
    command line does for its imports: the benchmarks under test collect between members, and over a worker's heap
    one full collection took a fifth of a second."""
    # imported here: TRITON_INTERPRET, set above, must come before any kernel is defined
    from switchbench.cli import _settle_heap

    _settle_heap()


@pytest.fixture(autouse=True)
def flash_block_shapes_untimed(monkeypatch):
    """On a GPU the flash kernels run their first candidate block shapes, as in the interpreter, unless a test
    times them itself: timing every candidate at each new shape would compile four of each kernel for every shape
    the suite meets (``tests/test_flash_attention.py`` tests the timing)."""
    from switchbench.ops.attention import flash

    monkeypatch.setattr(flash, "_time", lambda call: 0.0)  # every candidate ties: the first is kept
