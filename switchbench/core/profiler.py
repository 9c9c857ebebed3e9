"""The PyTorch profiler over a block, without the lines its tracing library prints as it starts and stops.

Kineto in torch 2.13 writes ``USDT:<time> ... profiler_start`` and ``... profiler_stop`` to the process's standard
error (file descriptor 2, below Python) at every start and stop: a quick main job printed a dozen such lines between
its phases. Only those lines are dropped; anything else written while the profiler starts or stops (a CUPTI error
on a GPU node, say) is passed on, and what the profiled block itself prints is not touched.
"""

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

import torch

NOISE = "USDT:"  # how kineto's start and stop lines begin


@contextlib.contextmanager
def profiled(activities: list) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(activities=...)`` over the block; its start and stop keep kineto's lines off
    standard error."""
    prof = torch.profiler.profile(activities=activities)
    with _filtered_stderr():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _filtered_stderr():
            prof.__exit__(None, None, None)


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    """File descriptor 2 goes to a temporary file in the block; then its lines go back to standard error, but
    kineto's."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().splitlines(keepends=True)
                if not line.startswith(NOISE.encode())
            ]
            if kept:
                sys.stderr.flush()
                os.write(2, b"".join(kept))
