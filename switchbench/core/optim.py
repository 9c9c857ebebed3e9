"""The one optimizer of everything timed or trained: AdamW without weight decay, as the authors train, in the
implementation a practitioner runs on a GPU. torch's default there is ``foreach`` (several launches per step for
every group of tensors); the fused kernel, which nanoGPT and torchtitan pick, updates them all in one."""

from collections.abc import Iterable

import torch


def fused(device: str) -> bool:
    """Whether the fused kernel runs on ``device``: on CUDA. Elsewhere torch's default stays, so the CPU's numbers
    remain those of the runs already kept."""
    return torch.device(device).type == "cuda"


def adamw(
    params: Iterable[torch.nn.Parameter], lr: float, device: str, capturable: bool = False
) -> torch.optim.AdamW:
    """AdamW at ``lr`` for parameters on ``device``. ``capturable`` keeps the step counts on the device, which a
    step captured in a CUDA graph needs."""
    # fused=None: torch's default implementation for the device
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=0.0, fused=fused(device) or None, capturable=capturable
    )


def describe(device: str) -> str:
    """The optimizer a run on ``device`` uses, for its metadata."""
    return "AdamW, fused" if fused(device) else "AdamW, torch's default implementation"
