"""MoA, Mixture of Attention heads (Zhang et al. 2022): one shared K and V head and a pool of E experts, each
owning a Q and an O projection; a router picks the H active experts of every token."""

import torch
from torch import Tensor, nn

from switchbench.models.config import ModelConfig
from switchbench.models.initialization import init_projection_
from switchbench.models.observe import Observable
from switchbench.models.positions import positional_attention
from switchbench.models.router import full_precision, sigmoid_topk
from switchbench.models.window import Window, with_memory
from switchbench.ops.expert_matmul.op import expert_matmul, route


class MoAAttention(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E, d, D = cfg.n_experts, cfg.d_model, cfg.d_head
        self.k, self.v = nn.Linear(d, D, bias=False), nn.Linear(d, D, bias=False)
        self.q_experts = nn.Parameter(torch.empty(E, d, D))
        self.o_experts = nn.Parameter(torch.empty(E, D, d))
        self.router = nn.Linear(d, E, bias=False)
        for weight, fan_in in ((self.k.weight, d), (self.v.weight, d), (self.q_experts, d)):
            init_projection_(weight, fan_in, cfg.n_layers)
        init_projection_(self.o_experts, cfg.n_heads * D, cfg.n_layers)
        init_projection_(self.router.weight, d, cfg.n_layers)  # rows keep unequal norms, as the authors' do
        self.attention = positional_attention(cfg, 1, learned_scale=True)

    def forward(self, x: Tensor, mem: Tensor | None, window: Window) -> tuple[Tensor, Tensor | float]:
        # B batch, t current tokens, S memory + current tokens, H active heads, E experts, D d_head
        cfg = self.cfg
        B, t, d = x.shape
        xs = with_memory(mem, x)  # [B, S, d_model]
        logits = full_precision(self.router(x)).view(B * t, cfg.n_experts)  # [N, E]
        if cfg.moa_gating == "softmax":
            scores = logits.softmax(-1)  # [N, E]
            experts = scores.topk(cfg.n_heads, dim=-1, sorted=False).indices  # [N, H]
        else:
            scores, experts = sigmoid_topk(logits, cfg.n_heads)
        routing = route(experts, cfg.n_experts)
        q = expert_matmul(x.reshape(B * t, 1, d), self.q_experts, routing)  # [N, H, D]
        q = q.view(B, t, cfg.n_heads, cfg.d_head).transpose(1, 2)  # [B, H, t, D]
        k, v = self.k(xs)[:, None], self.v(xs)[:, None]  # [B, 1, S, D]
        out, maps = self.attention(q, k, v, window, self.observing)  # [B, H, t, D]
        out = (
            out.transpose(1, 2).contiguous().view(B * t, cfg.n_heads, cfg.d_head)
        )  # one layout for any kernel
        y = expert_matmul(out, self.o_experts, routing, scores, 1).view(B, t, d)
        gates = scores.gather(1, experts)  # [N, H]
        if self.observing:
            self.record(maps=maps, experts=experts.view(B, t, -1), gates=gates.detach().view(B, t, -1))
        return y, self._aux_loss(logits, gates, experts)

    def _aux_loss(self, logits: Tensor, gates: Tensor, experts: Tensor) -> Tensor | float:
        cfg = self.cfg
        coefs = {"cv": cfg.moa_cv_coef, "switch": cfg.moa_switch_coef, "z": cfg.moa_z_coef}
        if cfg.moa_gating != "softmax" or not any(coefs.values()):
            return 0.0
        losses = moa_losses(logits, gates, experts)
        return sum(coef * losses[name] for name, coef in coefs.items() if coef)


def moa_losses(logits: Tensor, gates: Tensor, experts: Tensor) -> dict[str, Tensor]:
    """MoA's auxiliary losses from router logits [N, E] and the chosen gates/experts [N, H].

    cv: squared coefficient of variation of per-expert importance (summed gates); switch: E * sum_e of
    the mean router probability times the fraction of selections; z: mean squared logsumexp of the logits.
    Per-expert quantities are accumulated along the expert axis.
    """
    n_experts = logits.shape[1]
    importance = torch.zeros_like(logits).scatter_(1, experts, gates).sum(0)  # [E]
    cv = importance.var() / (importance.mean() ** 2 + 1e-10) if n_experts > 1 else importance.new_zeros(())
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(logits.dtype)  # [E]
    switch = n_experts * (logits.softmax(-1).mean(0) * counts / experts.numel()).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return {"cv": cv, "switch": switch, "z": z}
