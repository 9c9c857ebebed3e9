"""MoH, Mixture-of-Head attention (Jin, Zhu, Yuan and Yan, ICML 2025): multi-head attention whose heads are
experts, in the two forms the authors published. Of H heads the first ``shared_heads`` are always on; each token
picks ``routed_k`` of the other H - h_s.

``moh_router="softmax"`` (their ViT code): each token picks its routed heads with a softmax router, their weights
renormalised over the chosen ones and scaled by k (a chosen head's weight averages one). The shared heads are
weighted by a softmax of their own, times h_s (one when h_s = 1), and a two-way softmax, times two, mixes the
shared and the routed group. Each head's attention output is multiplied by its weight before the output
projection; unchosen heads weigh zero. Training adds the load-balancing loss E_r^2 mean_e(f_e P_e) (f_e the
fraction of tokens choosing routed head e, P_e its mean router probability) as the MoH-ViT training does:
``balance_coef`` times the mean of the layers' losses, each layer adding its share.

``moh_router="norm"`` (their LLaMA3 code): no router weights. Each token keeps the routed heads whose queries have
the largest L2 norms; shared and chosen heads weigh one, the others zero; no mix, no balance loss.

As in the published code, every head's Q, K, V and attention are computed and then weighted, so its MACs are the
dense model's plus the routers' (or the norms'). Presets are parameter-matched to the dense rows: the routers'
weights come out of the MLP; the norm router has none, and its presets keep the dense MLP.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from switchbench.core.precision import full_precision
from switchbench.models.config import ModelConfig, in_range, one_of
from switchbench.models.cost import Cost, layer_inputs, softmax_attention, symbols
from switchbench.models.family import Family, register
from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.kv_cache import CacheEntry, keys_values
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.positions import positional_attention
from switchbench.models.layers.projections import project
from switchbench.models.layers.window import Window, with_memory

ROUTERS = ("softmax", "norm")


@dataclass(frozen=True)
class Options:
    # metadata: the command line's help and choices
    shared_heads: int = field(default=1, metadata={"help": "h_s: always-on heads, the first ones"})
    routed_k: int = field(
        default=1, metadata={"help": "routed heads each token picks among the H - h_s others"}
    )
    balance_coef: float = field(  # MoH-ViT's training
        default=0.01, metadata={"help": "weight of the mean of the layers' balance losses"}
    )
    moh_router: str = field(
        default="softmax",
        metadata={
            "choices": ROUTERS,
            "help": "softmax: MoH-ViT's router matrices; norm: MoH-LLaMA3's query norms",
        },
    )

    def __post_init__(self):
        in_range("shared_heads", self.shared_heads, 0)
        in_range("routed_k", self.routed_k, 0)
        in_range("balance_coef", self.balance_coef, 0.0)
        one_of("moh_router", self.moh_router, ROUTERS)


def validate(cfg: ModelConfig) -> None:
    routed = cfg.n_heads - cfg.opts.shared_heads
    if routed < 0:
        raise ValueError(f"shared_heads ({cfg.opts.shared_heads}) must be at most n_heads ({cfg.n_heads})")
    if routed == 0 and cfg.opts.routed_k != 0:
        raise ValueError(f"routed_k must be 0: every head is shared, none is routed; got {cfg.opts.routed_k}")
    if routed and not 1 <= cfg.opts.routed_k <= routed:
        raise ValueError(f"routed_k must be in [1, {routed}] (the routed heads); got {cfg.opts.routed_k}")
    if cfg.opts.moh_router == "norm" and cfg.opts.balance_coef:
        raise ValueError(
            "the norm router has no balance loss (MoH-LLaMA3 has none, and its 0/1 choice has no gradient): "
            f"set balance_coef to 0; got {cfg.opts.balance_coef}"
        )


class MoHAttention(Observable, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        opts = cfg.opts
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.shared, self.routed, self.top_k = (
            opts.shared_heads,
            cfg.n_heads - opts.shared_heads,
            opts.routed_k,
        )
        # Each layer adds coef / L times its loss, so that the stack's sum is coef times the mean over the layers
        self.balance_weight = opts.balance_coef / cfg.n_layers
        inner = cfg.n_heads * cfg.d_head
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        for proj in (self.q, self.k, self.v, self.o):
            init_projection_(proj.weight, proj.in_features, cfg.n_layers)
        # W_r over the routed heads, W_s over the shared ones (none for one: its weight is 1), W_0 mixing the two;
        # the norm router has none of them
        self.norm_router = opts.moh_router == "norm"
        routed, shared = (0, 0) if self.norm_router else (self.routed, self.shared)
        self.router = nn.Linear(cfg.d_model, routed, bias=False) if routed else None
        self.shared_router = nn.Linear(cfg.d_model, shared, bias=False) if shared > 1 else None
        self.mix = nn.Linear(cfg.d_model, 2, bias=False) if shared and routed else None
        for router in (self.router, self.shared_router, self.mix):
            if router is not None:
                init_projection_(router.weight, cfg.d_model, cfg.n_layers)
        self.attention = positional_attention(cfg, cfg.n_heads, global_biases=True, learned_scale=True)

    def forward(self, x: Tensor, mem: Tensor | None, window: Window) -> tuple[Tensor, Tensor | float]:
        entries = self.cache_entries(with_memory(mem, x), window.k_pos)
        y, chosen, probs = self._attend(x, entries, window)
        return y, self._balance_loss(probs, chosen)

    def cache_entries(self, xs: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """K and V [B, H, L, D] of every head: as published, every head is computed (and cached), then weighted."""
        return keys_values(self.k, self.v, self.attention, xs, positions, self.n_heads, self.d_head)

    def attend_cached(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window) -> Tensor:
        return self._attend(x, entries, window)[0]

    def _attend(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window):
        """-> (y, the chosen routed heads, the routed probabilities) for the balance loss."""
        # B batch, t current tokens, H heads, D d_head
        B, t, _ = x.shape
        q, *routers = project(x, self.q, self.mix, self.shared_router, self.router)  # x read once
        q = q.view(B, t, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, t, D]
        out, maps = self.attention(q, *entries, window, self.observing, keys_ready=True)  # [B, H, t, D]
        # every head's weight [B, t, H], the chosen routed heads [B, t, k], the routed probabilities [B, t, H - h_s]
        weights, chosen, probs = (
            self.norm_weights(q) if self.norm_router else self.softmax_weights(x, *routers)
        )
        out = out * weights.transpose(1, 2)[..., None].to(out.dtype)  # each head's output times its weight
        y = self.o(out.transpose(1, 2).contiguous().view(B, t, -1))
        if self.observing:
            # the analysis counts what the router chooses among: the routed heads, numbered from 0 (the shared
            # heads, always on, would read as experts never chosen); with every head shared there is no choice
            routing = (
                {}
                if chosen is None
                else {"experts": chosen - self.shared, "gates": weights.detach().gather(-1, chosen)}
            )
            self.record(maps=maps, head_weights=weights.detach(), **routing)
        return y, chosen, probs

    def softmax_weights(
        self, x: Tensor, mix_logits: Tensor | None, shared_logits: Tensor | None, routed_logits: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x [B, t, d_model] and the logits its ``mix``, ``shared_router`` and ``router`` give (None where the layer
        has no such router) -> every head's weight [B, t, H] (shared heads first), the routed heads each token chose
        [B, t, k] (as head indices) and the routed heads' probabilities [B, t, H - h_s]."""
        B, t, _ = x.shape
        parts, chosen, probs = [], None, None
        mix = 2 * full_precision(mix_logits).softmax(-1) if mix_logits is not None else None  # [B, t, 2]
        if self.shared:
            if shared_logits is None:
                shared = x.new_ones(B, t, 1, dtype=torch.promote_types(x.dtype, torch.float32))
            else:
                shared = full_precision(shared_logits).softmax(-1) * self.shared
            parts.append(shared if mix is None else shared * mix[..., :1])
        if self.routed:
            probs = full_precision(routed_logits).softmax(-1)  # [B, t, H - h_s]
            top = probs.topk(self.top_k, dim=-1, sorted=False)
            kept = top.values / top.values.sum(-1, keepdim=True) * self.top_k
            routed = torch.zeros_like(probs).scatter(-1, top.indices, kept)
            parts.append(routed if mix is None else routed * mix[..., 1:])
            chosen = top.indices + self.shared
        return torch.cat(parts, -1), chosen, probs

    def norm_weights(self, q: Tensor) -> tuple[Tensor, Tensor | None, None]:
        """q [B, H, t, D] (before positions) -> every head's weight [B, t, H], 0 or 1, and the chosen routed heads
        [B, t, k]; no probabilities.

        The published code takes the top-k of a softmax of the norms divided by their standard deviation over the
        routed heads; both steps keep the order, so the same heads win (up to ties). The weights are constants (no
        gradient reaches the choice there either), so the choice runs on detached queries and keeps nothing."""
        B, _, t, _ = q.shape
        dtype = torch.promote_types(q.dtype, torch.float32)
        parts = [q.new_ones(B, t, self.shared, dtype=dtype)] if self.shared else []
        chosen = None
        if self.routed:
            routed_q = full_precision(q.detach()[:, self.shared :])  # [B, H - h_s, t, D]
            norms = torch.linalg.vector_norm(routed_q, dim=-1).transpose(1, 2)  # [B, t, H - h_s]
            top = norms.topk(self.top_k, dim=-1, sorted=False).indices  # [B, t, k]
            parts.append(q.new_zeros(B, t, self.routed, dtype=dtype).scatter(-1, top, 1.0))
            chosen = top + self.shared
        return torch.cat(parts, -1) if len(parts) > 1 else parts[0], chosen, None

    def _balance_loss(self, probs: Tensor | None, chosen: Tensor | None) -> Tensor | float:
        if not (self.training and self.balance_weight and self.routed):
            return 0.0
        return self.balance_weight * balance_loss(probs.flatten(0, 1), (chosen - self.shared).flatten(0, 1))


def balance_loss(probs: Tensor, chosen: Tensor) -> Tensor:
    """E_r^2 mean_e(f_e P_e) over tokens: probs [N, E_r], chosen [N, k] routed heads."""
    n_routed = probs.shape[1]
    f = torch.zeros_like(probs).scatter(1, chosen, 1.0).mean(0)  # fraction of tokens choosing each head
    return n_routed * n_routed * (f * probs.mean(0)).mean()


def kv_cache(cfg: ModelConfig) -> tuple[CacheEntry, ...]:
    """Every head's keys and values, as dense: a token's choice of heads is its query's, and a later query may
    choose any head, so no head's entries can be left out."""
    H, D = cfg.n_heads, cfg.d_head
    return (CacheEntry("k", H, D, "keys of every head"), CacheEntry("v", H, D, "values of every head"))


def describe(cfg: ModelConfig) -> str:
    routed = f"top-{cfg.opts.routed_k} of {cfg.n_heads - cfg.opts.shared_heads}"
    by_norm = " by query norm" if cfg.opts.moh_router == "norm" else ""
    return f"{cfg.opts.shared_heads} shared, {routed}{by_norm}"


def exact_cost(cfg: ModelConfig) -> Cost:
    """The dense layer's MACs (every head computed, as published) plus the routing's. Memory: the layer inputs, the
    weighted heads (a new tensor, the O projection's input), the weights kept by their product, and what the
    routing keeps."""
    H, dh, dm, T, C = symbols(cfg)
    macs = (T + 2 * C * T) * dm * H * dh + T * H * dh * dm
    mem = layer_inputs(cfg) + T * H * dh + T * H
    routing = _norm_routing(cfg) if cfg.opts.moh_router == "norm" else _softmax_routing(cfg)
    kept = 2 if cfg.pos == "xl" and cfg.xl_bias_and_scale else 0
    return Cost(macs, mem) + routing + softmax_attention(cfg, H, kept)


def _norm_routing(cfg: ModelConfig) -> Cost:
    """The routed queries' L2 norms, one multiply-add per element. The choice runs detached and its 0/1 weights are
    constants, so it keeps nothing and their product keeps only the weights, not the heads' outputs."""
    H, dh, _, T, _ = symbols(cfg)
    return Cost(T * (H - cfg.opts.shared_heads) * dh, 0)


def _softmax_routing(cfg: ModelConfig) -> Cost:
    """The routers' MACs. Memory: (XL) the heads' outputs kept by their product with learned weights (with RoPE,
    SDPA keeps its output already; constant weights keep none); the routers' softmaxes and what their products
    keep; the chosen weights and their sum; the balance loss's token fractions when it trains."""
    H, dh, dm, T, _ = symbols(cfg)
    opts = cfg.opts
    hs, Er, k = opts.shared_heads, H - opts.shared_heads, opts.routed_k
    routers = Er + (hs if hs > 1 else 0) + (2 if hs and Er else 0)
    learned = hs > 1 or Er > 0  # else every weight is a constant one, and the product keeps only the weights
    mem = T * H * dh if cfg.pos == "xl" and learned else 0
    if hs and Er:
        mem += 2 * T + 2 * T  # the mix's softmax, and the mix (twice it) read by both groups' products
        mem += (
            2 * T * hs if hs > 1 else T
        )  # the shared softmax and its h_s multiple (one shared head: its ones)
        mem += T * Er  # the routed weights before the mix
    elif hs > 1:
        mem += T * hs  # the shared softmax
    if Er:
        mem += T * Er + T * k + T  # the routed softmax, the chosen values and their sum
        if opts.balance_coef:
            mem += Er  # the fractions of tokens, kept by their product with the mean probabilities
    return Cost(T * dm * routers, mem)


# Parameter-matched presets of the softmax routers: the dense row, and its shared heads and routed choice (active
# heads 50-75%, as the published settings); the routers' d_model (H - h_s + h_s [h_s > 1] + 2) weights come out of
# the MLP. Each row also has a norm-router preset (``-moh-norm-``) with MoH-LLaMA3's split of the heads.
SETTINGS = {
    "c4-47m-transformer-h10": (2, 4),
    "c4-262m-transformer-h16": (4, 8),
    "wikitext103-45m-transformer-h10": (2, 4),
    "wikitext103-244m-transformer-h16": (4, 8),
    "tiny-transformer": (2, 1),
    "tiny-transformer-rope": (2, 1),
    "listops-transformer-h8": (2, 3),
    "bytes-920k-transformer-h4": (2, 1),
}


def norm_split(n_heads: int) -> tuple[int, int]:
    """MoH-LLaMA3's heads: half shared, and each token picks a quarter of all heads from the other half (rounded
    down, as its code does: 16 and 8 of LLaMA3-8B's 32; 5 and 2 of 10)."""
    return n_heads // 2, n_heads // 4


def router_weights(cfg: ModelConfig) -> int:
    if cfg.opts.moh_router == "norm":
        return 0
    hs, Er = cfg.opts.shared_heads, cfg.n_heads - cfg.opts.shared_heads
    return cfg.d_model * (Er + (hs if hs > 1 else 0) + (2 if hs and Er else 0))


def matched(dense: ModelConfig, **options) -> ModelConfig:
    """MoH of ``options`` with the attention + MLP weights per layer of ``dense`` (to the nearest MLP unit;
    exactly, without router weights)."""
    moh = dense.replace(model="moh", options=options)
    return moh.replace(d_ff=dense.d_ff - round(router_weights(moh) / (2 * dense.d_model)))


def presets(declared: Mapping[str, ModelConfig]) -> dict[str, ModelConfig]:
    out = {}
    for name, (shared, k) in SETTINGS.items():
        dense = declared[name]
        out[name.replace("transformer", "moh")] = matched(dense, shared_heads=shared, routed_k=k)
        shared, k = norm_split(dense.n_heads)
        out[name.replace("transformer", "moh-norm")] = matched(
            dense, shared_heads=shared, routed_k=k, balance_coef=0.0, moh_router="norm"
        )
    return out


FAMILY = register(
    Family(
        name="moh",
        label="MoH",
        attention=MoHAttention,
        exact_cost=exact_cost,
        kv_cache=kv_cache,
        options=Options,
        validate=validate,
        describe=describe,
        routing="heads",
        reads=("xl_bias_and_scale",),
        choices=lambda cfg: cfg.n_heads - cfg.opts.shared_heads,  # the routed heads
        presets=presets,
        roles={
            "47m": "c4-47m-moh-h10",
            "262m": "c4-262m-moh-h16",
            "45m-rope": "wikitext103-45m-moh-h10",
            "244m-rope": "wikitext103-244m-moh-h16",
            "tiny": "tiny-moh",
            "tiny-rope": "tiny-moh-rope",
            "listops": "listops-moh-h8",
            "bytes": "bytes-920k-moh-h4",
            "quality": "c4-47m-moh-h10",
        },
    )
)
