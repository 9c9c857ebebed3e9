"""Triton configurations chosen by measurement on a GPU, shared by every kernel that tunes (the expert matmul's,
flash attention's).

A launch runs the configuration SWITCHBENCH_TRITON_CONFIG pins for its kernel, else the one tuned ahead of time
for this GPU's name (``switchbench kernel-tune``'s table, package data: a first training step then does not stall on
tuning), else the one its kernel measures fastest at the shape's first launch. Each measured choice is recorded for
the process; kernel-tune writes them out after measuring every shape afresh (:func:`retuning`).
"""

import contextlib
import functools
import importlib.resources
import json
import os

import torch

FILE = "tuned_configs.json"
ENV = "SWITCHBENCH_TRITON_CONFIG"  # kernel=label pairs joined by ";", e.g. "flash_forward=M128 N64 w8 s3"
_chosen: dict[tuple[str, str], str] = {}  # (kernel, shape key) -> label, of this process's measured launches
_retuning = False  # kernel-tune at work: every launch is measured, the table tuned ahead of time is not read


def pinned(kernel: str) -> str | None:
    """The label SWITCHBENCH_TRITON_CONFIG pins ``kernel`` to, or None."""
    for entry in os.environ.get(ENV, "").split(";"):
        name, _, label = entry.partition("=")
        if name.strip() == kernel:
            return label.strip()
    return None


@functools.cache
def tables() -> tuple[dict, ...]:
    """The package's tables, one per GPU name."""
    return tuple(
        json.loads(importlib.resources.files("switchbench.ops").joinpath("data", FILE).read_text())["tables"]
    )


@functools.cache
def ahead_of_time(kernel: str, key: str, device: torch.device) -> str | None:
    """The label of the configuration tuned ahead of time for ``kernel`` at ``key`` on this GPU, or None (on a
    CPU, on a GPU without a table, and while :func:`retuning`)."""
    if _retuning or device.type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(device)
    for table in tables():
        if table["device"] == gpu and (label := table["configs"].get(kernel, {}).get(key)):
            return label
    return None


def record(kernel: str, key: str, label: str) -> None:
    """Remember the configuration measured fastest for ``kernel`` at ``key`` in this process."""
    _chosen[kernel, key] = label


def measured(kernel: str, key: str) -> str | None:
    """The label this process measured fastest for ``kernel`` at ``key``, or None."""
    return _chosen.get((kernel, key))


def chosen() -> dict[tuple[str, str], str]:
    """What this process measured, by kernel and shape key (kernel-tune writes it out)."""
    return dict(_chosen)


@contextlib.contextmanager
def retuning():
    """Measure every launch in the block, as if this GPU had no table yet: kernel-tune records a choice for every
    shape it meets, including those the table already holds (reading them would record nothing)."""
    global _retuning
    _retuning = True
    ahead_of_time.cache_clear()
    try:
        yield
    finally:
        _retuning = False
        ahead_of_time.cache_clear()
