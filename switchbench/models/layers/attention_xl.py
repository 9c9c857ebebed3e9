"""Transformer-XL relative-position attention: logits = s ((q + u)·k_j + (q + v)·r(i - j)), where r is a learned
projection of sinusoidal encodings of the distance i - j.

Optional, as the authors' models have them: the global content and position biases u, v (one d_head vector per
head, zero at init) and a learned logit scale s (a scalar, 1/sqrt(d_head) at init). Without them s is that
constant and u = v = 0.
"""

import math

import torch
from torch import Tensor, nn

from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.window import Window
from switchbench.ops.attention.kernels import attention
from switchbench.ops.attention.relative import RelativeBias

# Learned per-layer parameters that are not among the weights the paper matches (listed apart, like LayerNorm).
UNMATCHED = ("content_bias", "position_bias", "logit_scale")


def sinusoids(distances: Tensor, d_model: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Sinusoidal encodings [D, d_model] of integer distances [D], computed in ``dtype``."""
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, device=distances.device, dtype=dtype) / d_model)
    angles = distances[:, None].to(dtype) * inv_freq[None, :]
    return torch.cat([angles.sin(), angles[:, : d_model // 2].cos()], dim=-1)  # exactly d_model columns


def scores_by_distance(q: Tensor, r: Tensor) -> Tensor:
    """The position term by distance: queries [B, H, t, d_head] against the projected encodings [Hk, d_head, D]
    (Hk = H, or 1 shared by every head) -> [B, H, t, D], laid out head by head.

    One product a head over its B * t rows, which a head-split view of the queries' projection gives as a view.
    The broadcast ``q @ r`` would copy r once a sequence, copy q into [B * H, t, d_head] and sum r's gradient over
    the sequences: at 262M, batch 64, a dense layer's r made 128 MiB a pass in bf16 where the term itself is 1 GiB.
    """
    B, H, t, _ = q.shape
    rows = q.transpose(0, 1).reshape(H, B * t, -1)
    return torch.bmm(rows, r.expand(H, -1, -1)).view(H, B, t, -1).transpose(0, 1)


class XLAttention(nn.Module):
    """Attention with relative positions; ``n_kv_heads`` (H, or 1 for MoA) heads of projected positions."""

    def __init__(
        self,
        d_model: int,
        n_kv_heads: int,
        d_head: int,
        n_layers: int,
        n_heads: int = 1,
        global_biases: bool = False,
        learned_scale: bool = False,
    ):
        super().__init__()
        self.d_model, self.d_head = d_model, d_head
        self.pos_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=False)
        init_projection_(self.pos_proj.weight, d_model, n_layers)
        self.content_bias = self.position_bias = self.logit_scale = None
        if global_biases:
            self.content_bias = nn.Parameter(torch.zeros(n_heads, d_head))  # u
            self.position_bias = nn.Parameter(torch.zeros(n_heads, d_head))  # v
        if learned_scale:
            self.logit_scale = nn.Parameter(torch.full((1,), 1.0 / math.sqrt(d_head)))

    def keys(self, k: Tensor, positions: Tensor) -> Tensor:
        """Keys as attention reads them: relative positions leave them as projected."""
        return k

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: Window,
        return_maps: bool = False,
        keys_ready: bool = False,
    ):
        # B batch, H query heads, Hk key heads (H or 1), t queries, S keys, D distances
        t, S = q.shape[2], k.shape[2]
        lowest = 0 if window.causal else 1 - t  # causal: negative distances are masked anyway
        r = self._position_keys(window, S - 1, lowest, q.dtype, q.device)  # [Hk, d_head, D]
        q_content, q_position = self._scaled_queries(q)  # [B, H, t, d_head] each
        pos = RelativeBias(scores_by_distance(q_position, r), S)  # [B, H, t, D]
        return attention(q_content, k, v, window.mask, bias=pos, scale=1.0, return_maps=return_maps)

    def _position_keys(self, window: Window, highest: int, lowest: int, dtype: torch.dtype, device) -> Tensor:
        """The projected encodings [Hk, d_head, D] of the distances highest, ..., lowest.

        A decoder's window carries a table per layer (``window.tables``): the distances up to the cache's length
        projected once and sliced at each step, where a decoded token would otherwise project every distance of
        its window again, as many MACs as projecting its keys."""
        if window.tables is None or lowest < 0:
            return self._project_distances(torch.arange(highest, lowest - 1, -1, device=device), dtype)
        table = window.tables.get(id(self))
        if table is None or table.shape[-1] <= highest:
            size = max(highest + 1, window.tables["capacity"])
            table = window.tables[id(self)] = self._project_distances(
                torch.arange(size - 1, -1, -1, device=device), dtype
            )
        return table[..., table.shape[-1] - 1 - highest :]

    def _project_distances(self, distances: Tensor, dtype: torch.dtype) -> Tensor:
        encodings = sinusoids(distances, self.d_model, torch.promote_types(dtype, torch.float32))
        r = self.pos_proj(encodings.to(dtype))  # [D, Hk * d_head]
        return r.view(len(distances), -1, self.d_head).permute(1, 2, 0)  # [Hk, d_head, D]

    def _scaled_queries(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """s (q + u) and s (q + v): the scale goes on the queries, so no [t, S] map is kept for its gradient."""
        if self.logit_scale is None:
            scaled = q * (1.0 / math.sqrt(self.d_head))
            return scaled, scaled
        scale = self.logit_scale.to(q.dtype)
        scaled = q * scale
        if self.content_bias is None:
            return scaled, scaled
        u = (self.content_bias * self.logit_scale)[:, None].to(q.dtype)  # [H, 1, d_head]
        v = (self.position_bias * self.logit_scale)[:, None].to(q.dtype)
        return scaled + u, scaled + v
