"""Rotary position attention: the first half of each head's channels rotated by absolute position."""

import torch
from torch import Tensor, nn

from switchbench.models.layers.window import Window
from switchbench.ops.attention.kernels import attention

ROTATE_FRACTION = 0.5
BASE = 10000.0


def rotate(x: Tensor, positions: Tensor) -> Tensor:
    """Rotate the first ROTATE_FRACTION of the channels of x [B, H, L, d_head] by positions [L]."""
    n_rot = int(x.shape[-1] * ROTATE_FRACTION) // 2 * 2
    half = n_rot // 2
    # Angles in float64 whatever x's dtype: positions are absolute and a training stream's grow without end, and
    # in float32 a position's angle is off by half its ulp (0.03 rad at 2**20, whole radians past 2**24, where
    # neighbouring positions round to one angle), so a model's outputs drifted with the step it was on (1.2 in
    # its logits at 2**24). The table is [L, n_rot / 2]: its cost is nothing beside the attention it feeds.
    dtype = torch.float64
    inv_freq = BASE ** (-torch.arange(0, n_rot, 2, device=x.device, dtype=dtype) / n_rot)
    angles = positions[:, None].to(dtype) * inv_freq[None, :]  # [L, n_rot / 2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class RoPEAttention(nn.Module):
    """Attention with rotary positions: no bias on the logits, so SDPA runs it on a flash kernel."""

    def keys(self, k: Tensor, positions: Tensor) -> Tensor:
        """Keys [B, Hk, L, d_head] as attention reads them: rotated by their positions [L] (a decoder caches these,
        so no step rotates a key twice)."""
        return rotate(k, positions)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: Window,
        return_maps: bool = False,
        keys_ready: bool = False,
    ):
        """``keys_ready``: k went through :meth:`keys` already."""
        # B batch, H query heads, Hk key heads (H or 1), t queries, S keys
        q, k = rotate(q, window.q_pos), k if keys_ready else rotate(k, window.k_pos)
        return attention(q, k, v, window.mask, return_maps=return_maps)
