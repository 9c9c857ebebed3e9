"""SwitchHead attention: a few heads whose V and O projections (by default) are mixtures of experts.

Each head has a source-side router over the tokens attended to and a destination-side router over the current
tokens: ``s = sigmoid(x W^h)``, top-k, gates not renormalised. K experts use the source router, Q experts the
destination one; with ``shared_selection`` one router per head serves both sides.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.initialization import init_projection_
from switchbench.models.observe import Observable
from switchbench.models.positions import positional_attention
from switchbench.models.router import entropy_regularizer, full_precision, sigmoid_topk
from switchbench.models.window import Window, with_memory
from switchbench.ops.expert_matmul.op import Routing, expert_matmul, route


class Selection(NamedTuple):
    experts: Tensor  # [B, L, H, K] expert of each head's choice
    scores: Tensor  # [B * L, H * E] sigmoid of every expert; a chosen expert's gate is its score
    routing: Routing  # over the flat (head, expert) axis
    logits: Tensor  # [B * L, H, E]

    @property
    def gates(self) -> Tensor:
        """[B, L, H, K] gates of the chosen experts."""
        scores = self.scores.detach().view(*self.experts.shape[:3], -1)
        return scores.gather(-1, self.experts)


class SwitchHeadAttention(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, E, d, D = cfg.n_heads, cfg.n_experts, cfg.d_model, cfg.d_head
        for name in "qkv":
            if name in cfg.experts:
                weight = nn.Parameter(torch.empty(H * E, d, D))
                init_projection_(weight, d, cfg.n_layers)
            else:
                weight = nn.Linear(d, H * D, bias=False)
                init_projection_(weight.weight, d, cfg.n_layers)
            setattr(self, name, weight)
        if "o" in cfg.experts:
            self.o = nn.Parameter(torch.empty(H * E, D, d))
            init_projection_(self.o, H * D, cfg.n_layers)
        else:
            self.o = nn.Linear(H * D, d, bias=False)
            init_projection_(self.o.weight, H * D, cfg.n_layers)
        src_used, dst_used = bool(set(cfg.experts) & set("kv")), bool(set(cfg.experts) & set("qo"))
        self.src_router = self.dst_router = None
        if src_used or cfg.shared_selection:
            self.src_router = nn.Linear(d, H * E, bias=False)
        if dst_used and not cfg.shared_selection:
            self.dst_router = nn.Linear(d, H * E, bias=False)
        self.uses_src, self.uses_dst = src_used, dst_used
        # Rows keep the unequal norms of a normal draw: the authors' row re-normalisation moves them by ~0.1%.
        for router in (self.src_router, self.dst_router):
            if router is not None:
                init_projection_(router.weight, d, cfg.n_layers)
        self.attention = positional_attention(cfg, H)

    def forward(self, x: Tensor, mem: Tensor | None, window: Window) -> tuple[Tensor, Tensor | float]:
        # B batch, t current tokens, S memory + current tokens, H heads, E experts, K active, D d_head
        cfg = self.cfg
        B, t, _ = x.shape
        xs = with_memory(mem, x)  # [B, S, d_model]
        src = dst = None
        if self.uses_src:
            src = self._select(self.src_router(xs), B)
        if self.uses_dst and src is not None and cfg.shared_selection:
            dst = self._select(src.logits.view(B, -1, src.logits.shape[1] * src.logits.shape[2])[:, -t:], B)
        elif self.uses_dst:
            dst = self._select((self.src_router if cfg.shared_selection else self.dst_router)(x), B)
        q = self._project("q", x, dst).transpose(1, 2)  # [B, H, t, D]
        k = self._project("k", xs, src).transpose(1, 2)  # [B, H, S, D]
        v = self._project("v", xs, src).transpose(1, 2)  # [B, H, S, D]
        out, maps = self.attention(q, k, v, window, self.observing)  # [B, H, t, D]
        out = out.transpose(1, 2).contiguous()  # [B, t, H, D], one layout whatever the attention kernel
        if "o" in cfg.experts:
            y = expert_matmul(out.reshape(B * t, cfg.n_heads, cfg.d_head), self.o, dst.routing, dst.scores, 1)
        else:
            y = self.o(out.reshape(B * t, -1))
        if self.observing:
            self.record(maps=maps, **_selection_record("src", src), **_selection_record("dst", dst))
        return y.view(B, t, -1), self._regularizer(src, dst)

    def _select(self, logits: Tensor, B: int) -> Selection:
        """Top-k of each head's router logits [B, L, H * E]."""
        cfg = self.cfg
        L = logits.shape[1]
        logits = full_precision(logits).reshape(B * L, cfg.n_heads, cfg.n_experts)  # [N, H, E]
        dropout = cfg.expert_dropout if self.training else 0.0
        scores, experts = sigmoid_topk(logits, cfg.k, dropout)  # [N, H, E], [N, H, K]
        flat = experts + torch.arange(cfg.n_heads, device=logits.device)[:, None] * cfg.n_experts
        routing = route(flat.view(B * L, -1), cfg.n_heads * cfg.n_experts)
        experts = experts.view(B, L, cfg.n_heads, cfg.k)
        return Selection(experts, scores.view(B * L, -1), routing, logits)

    def _project(self, name: str, x: Tensor, selection: Selection | None) -> Tensor:
        """Q, K or V of x [B, L, d_model] -> [B, L, H, D], through experts if ``name`` is one of them."""
        B, L, d = x.shape
        weight = getattr(self, name)
        if name in self.cfg.experts:
            y = expert_matmul(
                x.reshape(B * L, 1, d), weight, selection.routing, selection.scores, self.cfg.n_heads
            )
        else:
            y = weight(x)
        return y.view(B, L, self.cfg.n_heads, self.cfg.d_head)

    def _regularizer(self, src: Selection | None, dst: Selection | None) -> Tensor | float:
        if not self.cfg.entropy_reg:
            return 0.0
        # Each side's logits pooled per sequence over its tokens and heads: [B, L * H, E]
        pooled = [s.logits.view(len(s.experts), -1, self.cfg.n_experts) for s in (src, dst) if s is not None]
        return self.cfg.entropy_reg * sum(entropy_regularizer(logits) for logits in pooled)


def _selection_record(side: str, selection: Selection | None) -> dict:
    if selection is None:
        return {}
    return {f"{side}_experts": selection.experts, f"{side}_gates": selection.gates}
