"""Rotary position attention: the first half of each head's channels rotated by absolute position."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from switchbench.models.layers.window import Window, attend, grouped_matmul

ROTATE_FRACTION = 0.5
BASE = 10000.0


def rotate(x: Tensor, positions: Tensor) -> Tensor:
    """Rotate the first ROTATE_FRACTION of the channels of x [B, H, L, d_head] by positions [L]."""
    n_rot = int(x.shape[-1] * ROTATE_FRACTION) // 2 * 2
    half = n_rot // 2
    dtype = torch.promote_types(x.dtype, torch.float32)
    inv_freq = BASE ** (-torch.arange(0, n_rot, 2, device=x.device, dtype=dtype) / n_rot)
    angles = positions[:, None].to(dtype) * inv_freq[None, :]  # [L, n_rot / 2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class RoPEAttention(nn.Module):
    """Attention with rotary positions; scaled-dot-product attention unless the maps are wanted."""

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
        if return_maps:
            logits = grouped_matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
            return attend(logits, v, window.mask, return_maps)
        return padded_sdpa(q, k, v, window.mask), None


def sdpa_width(d_head: int) -> int:
    """The head width scaled-dot-product attention runs at: d_head rounded up to a multiple of 8."""
    return -(-d_head // 8) * 8


def padded_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled-dot-product attention of q [B, H, t, d_head] over k, v [B, Hk, S, d_head] -> [B, H, t, d_head].

    The heads are zero-padded to a multiple of 8 channels: with a mask and any other width the fused GPU kernels
    refuse them and SDPA falls back to its math kernel (the full [t, S] scores in float32). Zero channels add
    nothing to q k^T, the scale stays that of the true width, and the output's zero channels are dropped.
    """
    d_head = q.shape[-1]
    pad = sdpa_width(d_head) - d_head
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    B, H = q.shape[:2]  # MoA has one key head, shared by the H query heads
    k, v = k.expand(B, H, -1, -1), v.expand(B, H, -1, -1)  # [B, H, S, d_head + pad]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d_head))
    return out[..., :d_head] if pad else out
