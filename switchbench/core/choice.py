"""A process-wide choice among named options (which kernel runs a concern), with a record of what each call made
of it: the innermost :meth:`Choice.selected` block, else an environment variable, else ``auto``.

The expert matmul's implementation and the attention kernel are each one such choice. A command line puts its flag
in force around the command's run; the calls resolve it as they come (``auto`` by what they know of themselves)
and :meth:`Choice.record` their answer in every open recording, so a run can say what it ran on.
"""

import contextlib
import os
from collections.abc import Callable, Iterator


def traced_once(resolve: Callable) -> Callable:
    """``resolve`` marked as torch.compiler.assume_constant_result marks a function (its one effect, this
    attribute), so that torch.compile calls it once as it traces and keeps its answer in the graph, without
    importing Dynamo as the decorator does: 1.6 s of every command's start. A test holds the two markings equal."""
    resolve._dynamo_marked_constant = True
    return resolve


class Choice:
    def __init__(self, what: str, env: str, options: tuple[str, ...]):
        self.what, self.env, self.options = what, env, options  # "auto" is always among the options
        self._selected: list[tuple[str, dict]] = []  # the choices in force, innermost last, each with its log
        self._logs: list[dict] = []  # open recordings

    @contextlib.contextmanager
    def selected(self, choice: str | None) -> Iterator[None]:
        """Run the block with ``choice`` in force, its resolutions recorded for :meth:`resolutions` (None: leave
        the choice as it is)."""
        if choice is None:
            yield
            return
        self.check(choice, f"{self.what} choice")
        with self.recording() as log:
            self._selected.append((choice, log))
            try:
                yield
            finally:
                self._selected.pop()

    def choice(self) -> str:
        """The choice in force: the innermost :meth:`selected`, else the environment variable, else auto."""
        if self._selected:
            return self._selected[-1][0]
        named = os.environ.get(self.env) or "auto"
        self.check(named, self.env)
        return named

    def as_named(self, flag: str) -> str:
        """The choice in force as the user made it, for a refusal to name: ``VARIABLE=VALUE`` where the environment
        names it (a command line's flag defaults to the variable), else ``--flag VALUE``."""
        named = self.choice()
        return f"{self.env}={named}" if os.environ.get(self.env) == named else f"{flag} {named}"

    def resolutions(self) -> dict:
        """What the calls made under the innermost :meth:`selected` resolved to, so far."""
        return dict(self._selected[-1][1]) if self._selected else {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict]:
        """Collect every resolution made in the block."""
        log: dict = {}
        self._logs.append(log)
        try:
            yield log
        finally:  # by identity: equal logs are not the same
            self._logs[:] = [other for other in self._logs if other is not log]

    def record(self, key: str, resolution) -> None:
        """One call's resolution, in every open recording."""
        for log in self._logs:
            log[key] = resolution

    def check(self, named: str, where: str) -> None:
        if named not in self.options:
            raise ValueError(
                f"{where}: the {self.what} must be one of {', '.join(self.options)}; got {named!r}"
            )
