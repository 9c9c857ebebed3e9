"""Which implementation runs the expert matmul: one process-wide choice, ``auto`` or a named one.

A call's implementation is, first to last: the ``impl=`` it is given; the choice in force (:func:`selected`, which
the command line's ``--expert-matmul`` sets); ``SWITCHBENCH_EXPERT_MATMUL``; ``auto``. ``auto`` looks the call up
in a table of measured winners kept as package data (``data/expert_matmul_auto.json``, written by ``switchbench
kernel-tune``), by device name and shape bucket; the same table holds each GPU's fastest routing method. Without an entry it falls back to the rule that held before the
table: Triton on CUDA (PyTorch for float64), PyTorch elsewhere, and records that it fell back.

Every resolution is recorded in the logs opened by :func:`recording`, so a run can say what it ran on. Nothing
here touches a tensor's data: choosing costs no operator call and no sync.
"""

import functools
import importlib.resources
import json
import platform
from dataclasses import dataclass

import torch

from switchbench.core.choice import Choice, traced_once
from switchbench.ops.expert_matmul.cases import Case

IMPLS = ("torch", "triton", "grouped_mm", "all_experts")
CHOICES = ("auto", *IMPLS)
ENV_IMPL = "SWITCHBENCH_EXPERT_MATMUL"
AUTO_FILE = "expert_matmul_auto.json"
SHIPPED = importlib.resources.files("switchbench.ops.expert_matmul").joinpath("data", AUTO_FILE)
FALLBACK_RULE = "triton on CUDA (torch for float64), torch elsewhere"
_BUCKET_CAP = 1 << 18  # slots; past this every batch is "large" (as the Triton kernels' tuning keys)
TRACED = "traced shape"


@dataclass(frozen=True)
class Resolution:
    """What one call ran on, and why: ``named`` (a choice, an ``impl=`` or the environment), ``measured`` (auto:
    the table's fastest for this device and bucket), ``fallback`` (auto: no table entry)."""

    impl: str
    reason: str

    def describe(self) -> str:
        if self.reason == "fallback":
            return f"{self.impl} (auto fell back: no measured entry; {FALLBACK_RULE})"
        return f"{self.impl} ({'auto: measured fastest' if self.reason == 'measured' else 'named'})"


_CHOICE = Choice("expert matmul", ENV_IMPL, CHOICES)
selected = _CHOICE.selected
choice = _CHOICE.choice
resolutions = _CHOICE.resolutions  # {"device | bucket": Resolution}
recording = _CHOICE.recording


def shape_bucket(
    slots: int, d_in: int, d_out: int, dtype: torch.dtype, gated: bool, per_token: int, experts: int
) -> str:
    """``65536x1024x112 8of16 bfloat16 gates``: the token slots rounded up to a power of two (capped), the widths,
    the slots a token fills of how many experts (computing every expert costs experts / per_token times the routed
    MACs: MoA's 8 of 16 and 12 of 16 are two buckets), the compute dtype, and whether the slots are gated. Sizes that
    are not numbers yet (a torch.jit trace, symbolic shapes under torch.compile) make the bucket TRACED, which no
    table holds: auto falls back there."""
    if not all(type(n) is int for n in (slots, d_in, d_out, per_token, experts)):
        return TRACED
    bucket = min(1 << max(slots - 1, 0).bit_length(), _BUCKET_CAP)
    name = f"{bucket}x{d_in}x{d_out} {per_token}of{experts} {str(dtype).removeprefix('torch.')}"
    return name + (" gates" if gated else "")


def case_bucket(case: Case, dtype: torch.dtype) -> str:
    """The shape bucket an expert matmul of ``case`` in ``dtype`` resolves ``auto`` by."""
    return shape_bucket(
        case.tokens * case.slots, case.d_in, case.d_out, dtype, case.gated, case.slots, case.n_experts
    )


@functools.cache
def device_name(device: torch.device) -> str:
    """The name the table is keyed by: the GPU's, or the CPU's architecture."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


@functools.cache
def auto_tables() -> tuple[dict, ...]:
    return checked(json.loads(SHIPPED.read_text())["tables"])


def checked(tables: list[dict]) -> tuple[dict, ...]:
    """``tables``, each of whose choices is one of IMPLS: an entry edited by hand fails as the table loads, by its
    GPU's name, rather than inside a training step."""
    for table in tables:
        unknown = sorted(set(table["choices"].values()) - set(IMPLS))
        if unknown:
            raise ValueError(
                f"{AUTO_FILE}: {table['device']} chooses {', '.join(unknown)}; each choice is one of {', '.join(IMPLS)}"
            )
    return tuple(tables)


def measured_entries(device: torch.device) -> int:
    """How many shape buckets the table holds for ``device``."""
    name = device_name(device)
    return sum(len(t["choices"]) for t in auto_tables() if t["device"] == name)


def measured_routing(device: torch.device) -> str | None:
    """The routing method ``kernel-tune`` measured fastest on ``device``'s GPU (the table's ``routing``), or None."""
    name = device_name(device)
    return next((t["routing"] for t in auto_tables() if t["device"] == name and "routing" in t), None)


def lookup(device: torch.device, bucket: str, named: str | None = None) -> Resolution:
    """The implementation ``named`` (default: the choice in force) gives a call of ``bucket`` on ``device``."""
    named = named or choice()
    if named != "auto":
        return Resolution(named, "named")
    gpu = device_name(device)
    for table in auto_tables():
        impl = table["choices"].get(bucket) if table["device"] == gpu else None
        if impl:
            return Resolution(impl, "measured")
    return Resolution("triton" if device.type == "cuda" and not _float64(bucket) else "torch", "fallback")


def _float64(bucket: str) -> bool:
    """Whether a bucket of :func:`shape_bucket` is of float64 calls (the suite's exact checks, on a GPU too)."""
    return bucket != TRACED and "float64" in bucket.split(" ")


@traced_once
def resolve(device: torch.device, bucket: str, named: str | None = None) -> str:
    """:func:`lookup`, recorded in every open recording. Under torch.compile it runs once, as the graph is traced,
    and its answer is part of the graph."""
    resolution = lookup(device, bucket, named)
    _CHOICE.record(f"{device_name(device)} | {bucket}", resolution)
    return resolution.impl
