"""CUDA's synchronising calls made errors for a block: how a call is shown to run without waiting on the host, as
a CUDA graph needs to capture it."""

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def syncs_raise() -> Iterator[None]:
    """Any synchronisation with the host raises a RuntimeError inside the block. The mode is the process's, so it is
    put back whatever happens (left on, it failed every later CUDA test of an H200's pytest worker at their first
    ``.to("cuda")``); torch's warning that the mode is a prototype, given as it is set, is silenced."""
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
