"""Rotary position attention: the first half of each head's channels rotated by absolute position."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .window import Window, attend

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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, window: Window, return_maps: bool = False):
        # B batch, H query heads, Hk key heads (H or 1), t queries, S keys
        q, k = rotate(q, window.q_pos), rotate(k, window.k_pos)
        if return_maps:
            logits = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
            return attend(logits, v, window.mask, return_maps)
        k, v = k.expand(*q.shape[:2], *k.shape[2:]), v.expand(*q.shape[:2], *v.shape[2:])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window.mask), None
