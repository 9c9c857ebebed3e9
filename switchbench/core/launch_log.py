"""Kernel launches collected instead of run: ``kernel-check`` records a module's launches on meta tensors and
compiles them ahead of time, for a GPU it does not have."""

import contextlib
from collections.abc import Iterator


class LaunchLog:
    """A module's log: while :meth:`recording`, its launcher appends each launch's arguments to :attr:`launches`
    rather than running the kernel."""

    def __init__(self):
        self.launches: list | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list]:
        self.launches = []
        try:
            yield self.launches
        finally:
            self.launches = None
