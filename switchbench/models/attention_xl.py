"""Transformer-XL relative-position attention: logits = (q·k_j + q·r(i - j)) / sqrt(d_head), where r is a
learned projection of sinusoidal encodings of the distance i - j."""

import math

import torch
from torch import Tensor, nn

from .initialization import init_projection_
from .window import Window, attend


def sinusoids(distances: Tensor, d_model: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Sinusoidal encodings [D, d_model] of integer distances [D], computed in ``dtype``."""
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, device=distances.device, dtype=dtype) / d_model)
    angles = distances[:, None].to(dtype) * inv_freq[None, :]
    return torch.cat([angles.sin(), angles[:, : d_model // 2].cos()], dim=-1)  # exactly d_model columns


class XLAttention(nn.Module):
    """Attention with relative positions; ``n_kv_heads`` (H, or 1 for MoA) heads of projected positions."""

    def __init__(self, d_model: int, n_kv_heads: int, d_head: int, n_layers: int):
        super().__init__()
        self.d_model, self.d_head = d_model, d_head
        self.pos_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=False)
        init_projection_(self.pos_proj.weight, d_model, n_layers)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, window: Window, return_maps: bool = False):
        # B batch, H query heads, Hk key heads (H or 1), t queries, S keys, D distances
        t, S = q.shape[2], k.shape[2]
        lowest = 0 if window.causal else 1 - t  # causal: negative distances are masked anyway
        distances = torch.arange(lowest, S, device=q.device)  # [D]; the largest is S - 1
        encodings = sinusoids(distances, self.d_model, torch.promote_types(q.dtype, torch.float32))
        r = self.pos_proj(encodings.to(q.dtype))  # [D, Hk * d_head]
        r = r.view(len(distances), -1, self.d_head).permute(1, 2, 0)  # [Hk, d_head, D]
        index = (window.q_pos[:, None] - window.k_pos[None, :] - lowest).clamp_(min=0)  # [t, S]
        rows = torch.arange(t, device=q.device)[:, None]
        # Indexing rather than gather: its backward keeps only the indices, not the [B, H, t, D] scores.
        pos = (q @ r)[:, :, rows, index]  # [B, H, t, S]
        logits = (q @ k.transpose(-1, -2) + pos) * (1.0 / math.sqrt(self.d_head))
        return attend(logits, v, window.mask, return_maps)
