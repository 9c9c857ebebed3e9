"""SwitchHead (Csordás et al., NeurIPS 2024): a few heads whose V and O projections (by default) are mixtures of
experts, chosen per token by sigmoid routers on the source and destination side.

Each head has a source-side router over the tokens attended to and a destination-side router over the current
tokens: ``s = sigmoid(x W^h)``, top-k, gates not renormalised. K experts use the source router, Q experts the
destination one; with ``shared_selection`` one router per head serves both sides.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn

from switchbench.core.precision import full_precision
from switchbench.models.config import ModelConfig, in_range
from switchbench.models.cost import Cost, layer_inputs, o_input, printed_xl, softmax_attention, symbols
from switchbench.models.family import BYTES, Family, register
from switchbench.models.layers.initialization import init_projection_
from switchbench.models.layers.kv_cache import CacheEntry
from switchbench.models.layers.observe import Observable
from switchbench.models.layers.positions import positional_attention
from switchbench.models.layers.projections import project
from switchbench.models.layers.router import entropy_regularizer, sigmoid_topk
from switchbench.models.layers.window import Window, with_memory
from switchbench.ops.expert_matmul.cases import Case
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
        # B batch, t current tokens, S memory + current tokens
        entries, src = self._source(with_memory(mem, x), window.k_pos)  # over [B, S, d_model]
        q, dst = self._destination(x, src)
        y = self._attend(q, dst, entries, window)
        if self.observing:
            self.record(**_selection_record("src", src))
        return y, self._regularizer(src, dst)

    def cache_entries(self, xs: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """K and V [B, H, L, D] of the source tokens xs [B, L, d_model]: the experts are picked by the source token,
        so its entries, V after the expert mix, hold for every later query."""
        return self._source(xs, positions)[0]

    def attend_cached(self, x: Tensor, entries: tuple[Tensor, Tensor], window: Window) -> Tensor:
        return self._attend(*self._destination(x, None), entries, window)

    def _source(self, xs: Tensor, positions: Tensor) -> tuple[tuple[Tensor, Tensor], Selection | None]:
        """K and V [B, H, L, D] of the source tokens xs [B, L, d_model] and their selection. The source router, K
        and V read xs once (:func:`project`)."""
        xs, *dense, logits = project(xs, *self._dense("kv"), self._router("src"), share_input=True)
        src = None if logits is None else self._select(logits, xs.shape[0])
        k, v = (self._project(name, xs, y, src).transpose(1, 2) for name, y in zip("kv", dense, strict=True))
        return (self.attention.keys(k, positions), v), src

    def _destination(self, x: Tensor, src: Selection | None) -> tuple[Tensor, Selection | None]:
        """Q [B, t, H, D] of the current tokens x [B, t, d_model] and the destination side's selection. The router
        and Q read x once (:func:`project`). With ``shared_selection`` the selection is the source side's, taken
        from ``src`` (over the window) when given."""
        cfg, B, t = self.cfg, x.shape[0], x.shape[1]
        from_src = self.uses_dst and cfg.shared_selection and src is not None
        x, q, logits = project(
            x, *self._dense("q"), None if from_src else self._router("dst"), share_input=True
        )
        if from_src:
            logits = src.logits.view(B, -1, src.logits.shape[1] * src.logits.shape[2])[:, -t:]
        dst = None if logits is None else self._select(logits, B)
        return self._project("q", x, q, dst), dst

    def _attend(
        self, q: Tensor, dst: Selection | None, entries: tuple[Tensor, Tensor], window: Window
    ) -> Tensor:
        # B batch, t current tokens, H heads, D d_head
        cfg = self.cfg
        B, t = q.shape[:2]
        q = q.transpose(1, 2)  # [B, H, t, D]
        # Q's experts gate in float32 whatever the weights' dtype: brought to the cache's (bf16 when served). Only
        # when they differ: even a no-op .to is one more operator in the gate's op_calls count
        if q.dtype != entries[0].dtype:
            q = q.to(entries[0].dtype)
        out, maps = self.attention(q, *entries, window, self.observing, keys_ready=True)  # [B, H, t, D]
        out = out.transpose(1, 2).contiguous()  # [B, t, H, D], one layout whatever the attention kernel
        if "o" in cfg.experts:
            y = expert_matmul(out.reshape(B * t, cfg.n_heads, cfg.d_head), self.o, dst.routing, dst.scores, 1)
        else:
            y = self.o(out.reshape(B * t, -1))
        if self.observing:
            self.record(maps=maps, **_selection_record("dst", dst))
        return y.view(B, t, -1)

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

    def _router(self, side: str) -> nn.Linear | None:
        """The router of ``side`` ("src" or "dst"), None where that side has no experts; with
        ``shared_selection`` both sides' is ``src_router``."""
        if not (self.uses_src if side == "src" else self.uses_dst):
            return None
        return self.src_router if side == "src" or self.cfg.shared_selection else self.dst_router

    def _dense(self, names: str) -> tuple[nn.Linear | None, ...]:
        """The projections ``names`` that have no experts (None for those that do)."""
        return tuple(None if name in self.cfg.experts else getattr(self, name) for name in names)

    def _project(self, name: str, x: Tensor, y: Tensor | None, selection: Selection | None) -> Tensor:
        """Q, K or V [B, L, H, D] of x [B, L, d_model]: through the experts where ``name`` has them, else ``y``, its
        projection computed already (by :func:`project`)."""
        B, L, d = x.shape
        if name in self.cfg.experts:
            weight = getattr(self, name)
            y = expert_matmul(
                x.reshape(B * L, 1, d), weight, selection.routing, selection.scores, self.cfg.n_heads
            )
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


def validate(cfg: ModelConfig) -> None:
    in_range("n_experts", cfg.n_experts, 1)
    in_range("k", cfg.k, 1, cfg.n_experts)
    if not cfg.experts or set(cfg.experts) - set("qkvo") or len(set(cfg.experts)) != len(cfg.experts):
        raise ValueError(f"experts must be a non-empty subset of 'qkvo', got {cfg.experts!r}")


def kv_cache(cfg: ModelConfig) -> tuple[CacheEntry, ...]:
    """K and V of the H heads, each after its expert mix where it has experts: a GQA-sized cache for its few heads."""
    H, D = cfg.n_heads, cfg.d_head
    return tuple(
        CacheEntry(
            p,
            H,
            D,
            f"{'keys' if p == 'k' else 'values'}{' after the expert mix' if p in cfg.experts else ''}",
        )
        for p in "kv"
    )


def describe(cfg: ModelConfig) -> str:
    return f"E{cfg.n_experts} k{cfg.k} {cfg.experts}" + (" shared" if cfg.shared_selection else "")


def exact_cost(cfg: ModelConfig) -> Cost:
    """Routers (sigmoids of every expert kept, each side), the Q, K, V, O projections (k expert matmuls for the
    expert ones), then attention over H key heads with a fixed scale."""
    H, dh, dm, T, C = symbols(cfg)
    S = C * T
    E, k, experts = cfg.n_experts, cfg.k, cfg.experts
    src, dst = bool(set(experts) & set("kv")), bool(set(experts) & set("qo"))
    router_tokens = (S if src else 0) + (T if dst and not (cfg.shared_selection and src) else 0)
    scores = ((S if src else 0) + (T if dst else 0)) * H * E
    macs = router_tokens * dm * H * E
    for name, tokens, d_in, d_out in (("q", T, dm, dh), ("k", S, dm, dh), ("v", S, dm, dh), ("o", T, dh, dm)):
        macs += tokens * H * (k if name in experts else 1) * d_in * d_out
    return Cost(macs, layer_inputs(cfg) + scores + o_input(cfg)) + softmax_attention(cfg, H)


def printed_switchhead(H: int, d_head: int, d_model: int, T: int, C: int, k: int) -> Cost:
    """SwitchHead paper, appendix A.2 (V, O experts): MACs = H(2 T dh dm + 2 T k dh (dm + 1) + 2 C T^2 dh
    + 2 C T dh dm); memory as dense XL."""
    macs = H * (
        2 * T * d_head * d_model
        + 2 * T * k * d_head * (d_model + 1)
        + 2 * C * T * T * d_head
        + 2 * C * T * d_head * d_model
    )
    return Cost(macs, printed_xl(H, d_head, d_model, T, C).mem)


def paper_switchhead(
    H: int, d_head: int, d_model: int, T: int, C: int, E: int, k: int, experts: str, xl: bool
) -> Cost:
    """The convention behind the paper's tables. With n_exp = number of expert projections among Q, K, V, O and
    n_sel = [K or V expert] + [Q or O expert]:
    MACs = 2 H dh T^2 C + (n_exp k + 4 - n_exp) dm H dh T + n_exp H k T dh + n_sel E dm T C [+ 2 H dm T dh for XL];
    mem = 2 H T^2 C + 4 H dh T + n_sel E T C [+ 2 H T dh for XL]. The router counts d_model x E for all heads and
    the XL position term has no factor C, as in the authors' script."""
    n_exp = len(experts)
    n_sel = bool(set(experts) & set("kv")) + bool(set(experts) & set("qo"))
    macs = (
        2 * H * d_head * T * T * C
        + (n_exp * k + 4 - n_exp) * d_model * H * d_head * T
        + n_exp * H * k * T * d_head
        + n_sel * E * d_model * T * C
    )
    mem = 2 * H * T * T * C + 4 * H * d_head * T + n_sel * E * T * C
    if xl:
        macs += 2 * H * d_model * T * d_head
        mem += 2 * H * T * d_head
    return Cost(macs, mem)


def paper_cost(cfg: ModelConfig, C: int | None = None) -> Cost:
    H, dh, dm, T, C_cfg = symbols(cfg)
    C = C_cfg if C is None else C
    return paper_switchhead(H, dh, dm, T, C, cfg.n_experts, cfg.k, cfg.experts, cfg.pos == "xl")


def printed_cost(cfg: ModelConfig) -> Cost | None:
    """The printed equation covers XL with V and O experts only."""
    if cfg.pos != "xl" or sorted(cfg.experts) != ["o", "v"]:
        return None
    return printed_switchhead(*symbols(cfg), cfg.k)


def expert_matmuls(cfg: ModelConfig, batch: int) -> tuple[Case, ...]:
    """Each expert projection: K and V over the window (the source side sees the memory too), Q and O over the
    current tokens; H routers of E experts, k slots each; O sums its heads' slots, gated."""
    H, E, k, d, D = cfg.n_heads, cfg.n_experts, cfg.k, cfg.d_model, cfg.d_head
    window, tokens = batch * cfg.T * (1 + cfg.context_blocks), batch * cfg.T
    shapes = {
        "q": (tokens, 1, H * k, H, E, H, d, D, True),
        "k": (window, 1, H * k, H, E, H, d, D, True),
        "v": (window, 1, H * k, H, E, H, d, D, True),
        "o": (tokens, H, H * k, 1, E, H, D, d, True),
    }
    # K and V share the source side's routing, Q and O the destination side's (with shared_selection too: the
    # destination routes its own tokens again)
    side = {p: len(set(cfg.experts) & set(s)) for s in ("kv", "qo") for p in s}
    return tuple(Case(f"switchhead-{p}", *shapes[p], shared_by=side[p]) for p in "qkvo" if p in cfg.experts)


FAMILY = register(
    Family(
        name="switchhead",
        label="SwitchHead",
        attention=SwitchHeadAttention,
        exact_cost=exact_cost,
        kv_cache=kv_cache,
        validate=validate,
        describe=describe,
        routing="experts",
        reads=("n_experts", "k", "experts", "shared_selection", "entropy_reg", "expert_dropout"),
        expert_matmuls=expert_matmuls,
        paper_cost=paper_cost,
        printed_cost=printed_cost,
        presets=lambda declared: {
            "bytes-920k-switchhead-h2": ModelConfig(
                **BYTES, model="switchhead", n_heads=2, d_head=32, n_experts=4, k=2, d_ff=472
            )
        },
        roles={
            "47m": "c4-47m-switchhead-h2",
            "262m": "c4-262m-switchhead-h4",
            "45m-rope": "wikitext103-45m-switchhead-h2",
            "244m-rope": "wikitext103-243m-switchhead-h4",
            "tiny": "tiny-switchhead",
            "tiny-rope": "tiny-switchhead-rope",
            "listops": "listops-switchhead-h2",
            "bytes": "bytes-920k-switchhead-h2",
            "quality": "wikitext103-47m-switchhead-h2",
        },
    )
)
