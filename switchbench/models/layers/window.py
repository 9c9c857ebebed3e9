"""Which keys each query sees: causal attention over the current chunk and ``context_blocks`` cached chunks.

Positions are absolute, so a sequence gives the same outputs whether it is fed a chunk or a token at a time.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Window:
    q_pos: Tensor  # [t] absolute positions of the current tokens
    k_pos: Tensor  # [S] absolute positions of memory + current tokens
    mask: Tensor | None  # [t, S] True where attention is allowed; None: everything (not causal)
    causal: bool
    # Decoding: what layers compute once per sequence and keep (by the layer's id; "capacity": the longest window)
    tables: dict | None = None


def make_window(
    offset: int, mem_len: int, t: int, T: int, context_blocks: int, causal: bool, device
) -> Window:
    """Window of ``t`` tokens starting at ``offset``, after ``mem_len`` cached tokens."""
    k_pos = torch.arange(offset - mem_len, offset + t, device=device)
    q_pos = k_pos[mem_len:]
    mask = None
    if causal:
        q, k = q_pos[:, None], k_pos[None, :]
        mask = (k <= q) & (k // T >= q // T - context_blocks)
    return Window(q_pos, k_pos, mask, causal)


def next_memory(window_inputs: Tensor, end: int, T: int, context_blocks: int) -> Tensor | None:
    """What a layer keeps of its inputs [B, S, d] once ``end`` tokens are done: the cached chunks and the
    tokens of the unfinished chunk, detached."""
    keep = min(context_blocks * T + end % T, window_inputs.shape[1])
    return window_inputs[:, window_inputs.shape[1] - keep :].detach() if keep else None


def with_memory(mem: Tensor | None, x: Tensor) -> Tensor:
    """The window's inputs [B, S, d]: cached layer inputs followed by the current ones."""
    return x if mem is None else torch.cat([mem, x], dim=1)
