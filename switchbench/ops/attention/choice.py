"""Which kernel runs softmax attention: one process-wide choice, ``auto`` or a named backend.

The choice in force is, first to last: the innermost :func:`selected` (the command line's ``--attention``),
``SWITCHBENCH_ATTENTION``, ``auto``. A call resolves it with what it knows of itself: whether it adds a position
bias to the logits (Transformer-XL) and whether the caller wants the attention maps, which only the explicit kernel
has. Every resolution is recorded in the logs opened by :func:`recording`, so a run can say what it ran on.
"""

import contextlib
import os
from collections.abc import Iterator

import torch

BACKENDS = ("explicit", "sdpa", "flex")
CHOICES = ("auto", *BACKENDS)
ENV = "SWITCHBENCH_ATTENTION"
# auto on the CPU keeps Transformer-XL's logits explicit: SDPA with an additive bias takes the unfused math path
# there, and the exact memory counts (cost.softmax_attention) and the CPU gate's baseline describe the explicit one
AUTO_RULE = (
    "explicit for maps; SDPA on CUDA; on the CPU SDPA without a position bias (RoPE), explicit with one (XL)"
)

_selected: list[tuple[str, dict]] = []  # the choices in force, innermost last, each with its resolutions
_logs: list[dict] = []  # open recordings


@contextlib.contextmanager
def selected(choice: str | None) -> Iterator[None]:
    """Run the block with ``choice`` in force, its resolutions recorded for :func:`resolutions` (None: leave the
    choice as it is)."""
    if choice is None:
        yield
        return
    check(choice, "attention choice")
    with recording() as log:
        _selected.append((choice, log))
        try:
            yield
        finally:
            _selected.pop()


def choice() -> str:
    """The choice in force: the innermost :func:`selected`, else SWITCHBENCH_ATTENTION, else auto."""
    if _selected:
        return _selected[-1][0]
    named = os.environ.get(ENV) or "auto"
    check(named, ENV)
    return named


def resolutions() -> dict[str, str]:
    """What the calls made under the innermost :func:`selected` ran on, so far: {"device | bias": backend}."""
    return dict(_selected[-1][1]) if _selected else {}


@contextlib.contextmanager
def recording() -> Iterator[dict[str, str]]:
    """Collect every resolution made in the block: {"device | bias | maps": backend}."""
    log: dict[str, str] = {}
    _logs.append(log)
    try:
        yield log
    finally:
        _logs[:] = [other for other in _logs if other is not log]  # by identity: equal logs are not the same


def lookup(device_type: str, biased: bool, maps: bool, named: str | None = None) -> str:
    """The backend ``named`` (default: the choice in force) gives a call on ``device_type``."""
    named = named or choice()
    if maps:  # only the explicit kernel has the maps, whatever is named
        return "explicit"
    if named != "auto":
        return named
    return "explicit" if biased and device_type != "cuda" else "sdpa"


@torch.compiler.assume_constant_result
def resolve(device_type: str, biased: bool, maps: bool) -> str:
    """:func:`lookup`, recorded in every open recording. Under torch.compile it runs once, as the graph is traced."""
    backend = lookup(device_type, biased, maps)
    key = f"{device_type} | {'position bias' if biased else 'no bias'}{' | maps' if maps else ''}"
    for log in _logs:
        log[key] = backend
    return backend


def check(named: str, where: str) -> None:
    if named not in CHOICES:
        raise ValueError(f"{where}: the attention kernel must be one of {', '.join(CHOICES)}; got {named!r}")
