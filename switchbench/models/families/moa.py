"""MoA, Mixture of Attention heads (Zhang et al. 2022): one shared K and V head and a pool of E experts, each
owning a Q and an O projection; a router picks the H active experts of every token.
"""

import torch
from torch import Tensor, nn

from switchbench.core.precision import full_precision
from switchbench.models.config import MOA_GATINGS, ModelConfig, in_range, one_of
from switchbench.models.cost import Cost, layer_inputs, o_input, softmax_attention, symbols
from switchbench.models.family import BYTES, Family, register
from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.kv_cache import CacheEntry
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.positions import positional_attention
from switchbench.models.layers.projections import project
from switchbench.models.layers.router import sigmoid_topk
from switchbench.models.layers.window import Window, with_memory
from switchbench.ops.expert_matmul.cases import Case
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
        entries = self.cache_entries(with_memory(mem, x), window.k_pos)
        y, logits, gates, experts = self._attend(x, entries, window)
        return y, self._aux_loss(logits, gates, experts)

    def cache_entries(self, xs: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The one shared key and value head [B, 1, L, D] of the source tokens xs [B, L, d_model],
        both read from one cast of xs."""
        k, v = project(xs, self.k, self.v)
        return self.attention.keys(k[:, None], positions), v[:, None]

    def attend_cached(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window) -> Tensor:
        return self._attend(x, entries, window)[0]

    def _attend(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window):
        """-> (y, the router's logits, the chosen gates and experts) for the auxiliary losses."""
        # B batch, t current tokens, H active heads, E experts, D d_head
        cfg = self.cfg
        B, t, d = x.shape
        x, logits = project(x, self.router, share_input=True)  # the router and the experts read x once
        logits = full_precision(logits).view(B * t, cfg.n_experts)  # [N, E]
        if cfg.moa_gating == "softmax":
            scores = logits.softmax(-1)  # [N, E]
            experts = scores.topk(cfg.n_heads, dim=-1, sorted=False).indices  # [N, H]
        else:
            scores, experts = sigmoid_topk(logits, cfg.n_heads)
        routing = route(experts, cfg.n_experts)
        q = expert_matmul(x.reshape(B * t, 1, d), self.q_experts, routing)  # [N, H, D]
        q = q.view(B, t, cfg.n_heads, cfg.d_head).transpose(1, 2)  # [B, H, t, D]
        out, maps = self.attention(q, *entries, window, self.observing, keys_ready=True)  # [B, H, t, D]
        out = (
            out.transpose(1, 2).contiguous().view(B * t, cfg.n_heads, cfg.d_head)
        )  # one layout for any kernel
        y = expert_matmul(out, self.o_experts, routing, scores, 1).view(B, t, d)
        gates = scores.gather(1, experts)  # [N, H]
        if self.observing:
            self.record(maps=maps, experts=experts.view(B, t, -1), gates=gates.detach().view(B, t, -1))
        return y, logits, gates, experts

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
    # A scatter, not bincount: on CUDA bincount reads its largest value back to size its output. A token's experts
    # are distinct, so each of them counts it once
    counts = torch.zeros_like(logits).scatter_(1, experts, 1.0).sum(0)  # [E]
    switch = n_experts * (logits.softmax(-1).mean(0) * counts / experts.numel()).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return {"cv": cv, "switch": switch, "z": z}


def validate(cfg: ModelConfig) -> None:
    in_range("n_experts", cfg.n_experts, 1)
    in_range("n_heads", cfg.n_heads, 1, cfg.n_experts)
    one_of("moa_gating", cfg.moa_gating, MOA_GATINGS)


def kv_cache(cfg: ModelConfig) -> tuple[CacheEntry, ...]:
    """One key and one value head, shared by every expert: MQA's cache."""
    return (
        CacheEntry("k", 1, cfg.d_head, "the shared key"),
        CacheEntry("v", 1, cfg.d_head, "the shared value"),
    )


def exact_cost(cfg: ModelConfig) -> Cost:
    """Router, Q through H of E experts, one K and one V head over the window, O through the same experts; the
    T x E router probabilities kept; attention over one key head, its learned scale keeping the query."""
    H, dh, dm, T, C = symbols(cfg)
    S, E = C * T, cfg.n_experts
    macs = T * dm * E + T * H * dm * dh + 2 * S * dm * dh + T * H * dh * dm
    kept = 1 if cfg.pos == "xl" and cfg.xl_bias_and_scale else 0
    return Cost(macs, layer_inputs(cfg) + T * E + o_input(cfg)) + softmax_attention(cfg, 1, kept)


def printed_moa(H: int, d_head: int, d_model: int, T: int, C: int) -> Cost:
    """SwitchHead paper, appendix A.2, MoA: MACs = (2H + 2) T dh dm + 2H C T^2 dh + 2 C T dh dm,
    mem = (2H + 2) T dh + 2H C T^2 + 2 C T dh."""
    return Cost(
        (2 * H + 2) * T * d_head * d_model + 2 * H * C * T * T * d_head + 2 * C * T * d_head * d_model,
        (2 * H + 2) * T * d_head + 2 * H * C * T * T + 2 * C * T * d_head,
    )


def paper_moa(H: int, d_head: int, d_model: int, T: int, C: int, E: int) -> Cost:
    """The convention behind the paper's tables, H active heads of E experts: MACs = 2 H dh T^2 C + (2H + 2) dm
    dh T + 2 H T dh + E dm T + 2 dm T dh C; mem = 2 H T^2 C + (2H + 2) dh T + 2 T dh + E T C."""
    return Cost(
        2 * H * d_head * T * T * C
        + (2 * H + 2) * d_model * d_head * T
        + 2 * H * T * d_head
        + E * d_model * T
        + 2 * d_model * T * d_head * C,
        2 * H * T * T * C + (2 * H + 2) * d_head * T + 2 * T * d_head + E * T * C,
    )


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    H, dh, dm, T, C_cfg = symbols(cfg)
    return paper_moa(H, dh, dm, T, C_cfg if C is None else C, cfg.n_experts)


def expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[Case, ...]:
    """Q: each token's H slots from the pool of E; O: the slots summed, weighted by the router; one routing."""
    H, E, d, D, tokens = cfg.n_heads, cfg.n_experts, cfg.d_model, cfg.d_head, batch * cfg.T
    return (
        Case("moa-q", tokens, 1, H, H, E, 1, d, D, False, shared_by=2),
        Case("moa-o", tokens, H, H, 1, E, 1, D, d, True, shared_by=2),
    )


FAMILY = register(
    Family(
        name="moa",
        label="MoA",
        attention=MoAAttention,
        exact_cost=exact_cost,
        kv_cache=kv_cache,
        validate=validate,
        describe=lambda cfg: f"E{cfg.n_experts} {cfg.moa_gating}",
        routing="heads",
        reads=(
            "n_experts",
            "moa_gating",
            "moa_cv_coef",
            "moa_switch_coef",
            "moa_z_coef",
            "xl_bias_and_scale",
        ),
        head_slots=True,
        expert_matmuls=expert_matmuls,
        paper_cost=paper_cost,
        printed_cost=lambda cfg: printed_moa(*symbols(cfg)) if cfg.pos == "xl" else None,
        # the byte-level model: 4 active of 8 query experts
        presets=lambda declared: {
            "bytes-920k-moa-h4": ModelConfig(
                **BYTES, model="moa", n_heads=4, d_head=32, n_experts=8, d_ff=524
            )
        },
        roles={
            "47m": "wikitext103-47m-moa-h4",
            "262m": "wikitext103-262m-moa-h8",
            "tiny": "tiny-moa",
            "listops": "listops-moa-h4",
            "bytes": "bytes-920k-moa-h4",
            "quality": "wikitext103-47m-moa-h4",
        },
    )
)
