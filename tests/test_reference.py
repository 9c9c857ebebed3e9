"""The MoE modules against naive float64 references written as loops over batch, heads, experts and tokens.

The references only read the modules' parameters; forward outputs and the gradients of a random linear
functional of them (w.r.t. the inputs and every parameter) must agree to float64 round-off.
"""

import functools
import math

import naive
import pytest

pytest.importorskip("hypothesis")  # a GPU node without it skips this module, naming it
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from small import TRITON_DEVICE

from switchbench.models.config import ModelConfig
from switchbench.models.families import switchhead as switchhead_module
from switchbench.models.families.dense import DenseAttention
from switchbench.models.families.moa import MoAAttention, moa_losses
from switchbench.models.families.switchhead import SwitchHeadAttention
from switchbench.models.layers import mlp as mlp_module
from switchbench.models.layers.attention_xl import sinusoids
from switchbench.models.layers.mlp import DenseMLP
from switchbench.models.layers.observe import observe
from switchbench.models.layers.router import FEW_EXPERTS, entropy_regularizer, sigmoid_topk, top_by_rank
from switchbench.models.layers.sigma_moe import SigmaMoE
from switchbench.models.layers.window import make_window
from switchbench.ops.expert_matmul.cases import Case, float64_inputs, indices, reference
from switchbench.ops.expert_matmul.op import expert_matmul, route, routing_selected, top_k_by_rank

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)

# name: (offset, mem_len, t, causal, context_blocks), with T = 4
WINDOWS = {
    # queries 6, 7 in chunk 1 see everything; query 8 starts chunk 2, so chunk 0 (keys 0..3) leaves its window
    "mem-block": (6, 6, 3, True, 1),
    "mem-full": (4, 4, 4, True, 1),
    "no-mem": (0, 0, 4, True, 1),
    "bidirectional": (0, 0, 4, False, 0),
    # the stacks keep no memory without a causal mask, but the modules (and the XL shift) take any S >= t
    "bidirectional-mem": (5, 5, 3, False, 0),
}
T = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(seed: int, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=F64) * scale


def _build(cls, cfg: ModelConfig, seed: int, scale: float = 0.5):
    """The module in float64 with every parameter redrawn, so router scores have no ties."""
    module = cls(cfg).double()
    gen = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * scale)
    return module


def _inputs(cfg: ModelConfig, window: str, seed: int, batch: int = 2):
    """x, mem (or None), the module's window and the reference's absolute positions."""
    offset, mem_len, t, causal, blocks = WINDOWS[window]
    x = _randn(seed, batch, t, cfg.d_model).requires_grad_()
    mem = _randn(seed + 1, batch, mem_len, cfg.d_model).requires_grad_() if mem_len else None
    win = make_window(offset, mem_len, t, T, blocks, causal, "cpu")
    q_pos = list(range(offset, offset + t))
    k_pos = list(range(offset - mem_len, offset + t))
    return x, mem, win, q_pos, k_pos


def _window_cfg(window: str, **changes) -> ModelConfig:
    _, _, _, causal, blocks = WINDOWS[window]
    base = dict(
        d_model=8, n_layers=2, n_heads=2, d_head=4, T=T, context_blocks=blocks, causal=causal, dropout=0.0
    )
    return ModelConfig(**{**base, **changes})


def _assert_matches(y, y_ref, wrt: dict, seed: int):
    """Same output, and the same gradients of <probe, y> w.r.t. every tensor of ``wrt``."""
    torch.testing.assert_close(y, y_ref, **TOL)
    probe = _randn(seed, *y.shape)
    grads = torch.autograd.grad((y * probe).sum(), list(wrt.values()), allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), list(wrt.values()), allow_unused=True)
    for name, g, g_ref in zip(wrt, grads, grads_ref, strict=True):
        assert g is not None and g_ref is not None, f"{name} does not reach the output"
        torch.testing.assert_close(g, g_ref, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def _leaves(x, mem, module) -> dict:
    wrt = {"x": x, **dict(module.named_parameters())}
    if mem is not None:
        wrt["mem"] = mem
    return wrt


# ---------------------------------------------------------------- naive reference pieces


def _topk(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(range(len(scores)), key=lambda e: -scores[e].item())[:k]


@functools.cache
def _encoding(distance: int, d_model: int) -> torch.Tensor:
    return sinusoids(torch.tensor([distance]), d_model, F64)[0]


def _rope(vec: torch.Tensor, pos: int) -> torch.Tensor:
    """GPT-NeoX half-split rotation of the first floor(d_head / 2), rounded down to even, channels."""
    n_rot = (vec.shape[0] // 2) // 2 * 2
    half = n_rot // 2
    out = list(vec.unbind())
    for c in range(half):
        angle = pos * 10000.0 ** (-2 * c / n_rot)
        out[c] = vec[c] * math.cos(angle) - vec[c + half] * math.sin(angle)
        out[c + half] = vec[c + half] * math.cos(angle) + vec[c] * math.sin(angle)
    return torch.stack(out)


def _allowed(qp: int, kp: int, cfg: ModelConfig) -> bool:
    if not cfg.causal:
        return True
    return kp <= qp and kp // cfg.T >= qp // cfg.T - cfg.context_blocks


def _ref_head(q, k, v, q_pos, k_pos, cfg, pos_weight, scale=None, u=None, v_bias=None):
    """One attention head over lists of vectors; pos_weight [d_head, d_model] for XL, None for RoPE.

    XL options: a learned logit scale (else 1/sqrt(d_head)) and the global content and position biases u, v.
    """
    scale = 1 / math.sqrt(cfg.d_head) if scale is None else scale
    u = 0 if u is None else u
    v_bias = 0 if v_bias is None else v_bias
    if cfg.pos == "rope":
        q = [_rope(vec, p) for vec, p in zip(q, q_pos, strict=True)]
        k = [_rope(vec, p) for vec, p in zip(k, k_pos, strict=True)]
    out = []
    for qi, qp in zip(q, q_pos, strict=True):
        logits, values = [], []
        for kj, vj, kp in zip(k, v, k_pos, strict=True):
            if not _allowed(qp, kp, cfg):
                continue
            logit = (qi + u) @ kj
            if cfg.pos == "xl":
                logit = logit + (qi + v_bias) @ (pos_weight @ _encoding(qp - kp, cfg.d_model))
            logits.append(logit * scale)
            values.append(vj)
        logits = torch.stack(logits)
        weights = torch.exp(logits - logits.max())
        weights = weights / weights.sum()
        out.append(sum(w * vj for w, vj in zip(weights, values, strict=True)))
    return out


def _ref_switchhead(m, x, mem, q_pos, k_pos, choices: list):
    cfg = m.cfg
    H, E, K, D = cfg.n_heads, cfg.n_experts, cfg.k, cfg.d_head
    B, t, _ = x.shape
    xs = x if mem is None else torch.cat([mem, x], 1)

    def choose(side, h, vec):
        router = m.src_router if side == "src" or cfg.shared_selection else m.dst_router
        scores = torch.sigmoid(router.weight[h * E : (h + 1) * E] @ vec)
        best = _topk(scores, K)
        choices.append((side, h, tuple(sorted(best))))
        return [(e, scores[e]) for e in best]

    def project(name, side, h, vec):
        weight = getattr(m, name)
        if name in cfg.experts:
            return sum(g * (vec @ weight[h * E + e]) for e, g in choose(side, h, vec))
        return weight.weight[h * D : (h + 1) * D] @ vec

    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            q = [project("q", "dst", h, x[b, i]) for i in range(t)]
            k = [project("k", "src", h, xs[b, j]) for j in range(xs.shape[1])]
            v = [project("v", "src", h, xs[b, j]) for j in range(xs.shape[1])]
            pos_weight = m.attention.pos_proj.weight[h * D : (h + 1) * D] if cfg.pos == "xl" else None
            heads.append(_ref_head(q, k, v, q_pos, k_pos, cfg, pos_weight))
        for i in range(t):
            y = 0
            for h in range(H):
                a = heads[h][i]
                if "o" in cfg.experts:
                    y = y + sum(g * (a @ m.o[h * E + e]) for e, g in choose("dst", h, x[b, i]))
                else:
                    y = y + m.o.weight[:, h * D : (h + 1) * D] @ a
            rows.append(y)
    return torch.stack(rows).view(B, t, -1)


def _hand_moa_losses(logits: list[list[float]], chosen: list[list[int]], gates: list[list[float]]):
    """cv, switch and z of MoA from plain numbers: per-expert sums run over tokens and their choices."""
    N, E = len(logits), len(logits[0])
    H = len(chosen[0])
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    importance, counts = [0.0] * E, [0] * E
    for n in range(N):
        for h in range(H):
            importance[chosen[n][h]] += gates[n][h]
            counts[chosen[n][h]] += 1
    mean = sum(importance) / E
    var = sum((v - mean) ** 2 for v in importance) / (E - 1)  # unbiased, as torch.var
    cv = var / mean**2
    switch = E * sum(sum(p[e] for p in probs) / N * counts[e] / (N * H) for e in range(E))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / N
    return {"cv": cv, "switch": switch, "z": z, "counts": counts, "importance": importance}


def _ref_moa(m, x, mem, q_pos, k_pos):
    """Output, and the (logits, chosen, gates) of every token for the auxiliary losses."""
    cfg = m.cfg
    H = cfg.n_heads
    B, t, _ = x.shape
    xs = x if mem is None else torch.cat([mem, x], 1)
    pos_weight = m.attention.pos_proj.weight if cfg.pos == "xl" else None
    scale = m.attention.logit_scale[0] if cfg.pos == "xl" and cfg.xl_bias_and_scale else None
    rows, routing = [], []
    for b in range(B):
        k = [m.k.weight @ xs[b, j] for j in range(xs.shape[1])]
        v = [m.v.weight @ xs[b, j] for j in range(xs.shape[1])]
        for i in range(t):
            logits = m.router.weight @ x[b, i]
            if cfg.moa_gating == "softmax":
                scores = torch.exp(logits) / torch.exp(logits).sum()
            else:
                scores = torch.sigmoid(logits)
            best = _topk(scores, H)
            routing.append((logits.tolist(), best, [scores[e].item() for e in best]))
            y = 0
            for e in best:
                q = x[b, i] @ m.q_experts[e]
                a = _ref_head([q], k, v, [q_pos[i]], k_pos, cfg, pos_weight, scale)[0]
                y = y + scores[e] * (a @ m.o_experts[e])
            rows.append(y)
    return torch.stack(rows).view(B, t, -1), routing


# ---------------------------------------------------------------- expert matmul


def _routed(pattern: str, N: int, E: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """[N, S] expert indices over E experts in one of the cases' routing patterns."""
    return indices(Case("routed", N, 1, S, 1, E, 1, 1, 1, True, pattern), gen)


def _check_expert_matmul(N, E, s_in, S, s_out, indices, gated, seed, default_groups=False):
    d_in, d_out = 3, 2
    x = _randn(seed, N, s_in, d_in).requires_grad_()
    weight = _randn(seed + 1, E, d_in, d_out).requires_grad_()
    scores = _randn(seed + 2, N, E).requires_grad_() if gated else None
    groups = None if default_groups else s_out
    out = expert_matmul(x, weight, route(indices, E), scores, groups)
    ref = reference(x, weight, indices, scores, s_out)
    wrt = {"x": x, "weight": weight} | ({"scores": scores} if gated else {})
    _assert_matches(out, ref, wrt, seed + 3)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    ("N", "E", "s_in", "S", "s_out", "pattern"),
    [
        (5, 4, 1, 4, 4, "random"),
        (5, 4, 1, 4, 1, "random"),
        (5, 4, 1, 4, 2, "random"),
        (5, 4, 4, 4, 1, "random"),
        (5, 4, 2, 4, 4, "random"),
        (5, 4, 4, 4, 4, "random"),
        (4, 6, 2, 6, 3, "random"),
        (6, 5, 1, 3, 1, "two-experts"),
        (6, 5, 3, 3, 1, "one-expert"),
        (4, 4, 1, 4, 1, "all-experts"),
        (4, 4, 4, 4, 2, "all-experts"),
        (7, 3, 1, 1, 1, "random"),  # k = 1
        (1, 3, 1, 2, 1, "random"),  # a single token
        (1, 3, 2, 2, 2, "one-expert"),
    ],
)
def test_expert_matmul_matches_loop(N, E, s_in, S, s_out, pattern, gated):
    """Forward and gradients (x, weight, gates) against the slot-by-slot loop."""
    seed = N * 1000 + E * 100 + s_in * 10 + S + s_out
    _check_expert_matmul(N, E, s_in, S, s_out, _routed(pattern, N, E, S, _gen(seed)), gated, seed)


def test_expert_matmul_default_out_groups_is_per_slot():
    indices = _routed("random", 3, 4, 4, _gen(0))
    _check_expert_matmul(3, 4, 2, 4, 4, indices, True, 7, default_groups=True)


@pytest.mark.parametrize("gated", [True, False], ids=["gates", "no-gates"])
@pytest.mark.parametrize("case", list(naive.FAMILY_CASES))
def test_the_named_cases_match_the_loop(case, gated):
    """The named cases every implementation is held to through the PyTorch path in float64 (padded batches and the
    one-token gathered path alike): that path against the slot-by-slot loop, output and every gradient."""
    case = naive.FAMILY_CASES[case]
    x, weight, routed, scores, _ = float64_inputs(case)
    x, weight, scores = (
        x.requires_grad_(),
        weight.requires_grad_(),
        scores.requires_grad_() if gated else None,
    )
    out = expert_matmul(x, weight, route(routed, case.n_experts), scores, case.out_groups)
    ref = reference(x, weight, routed, scores, case.out_groups)
    _assert_matches(out, ref, {"x": x, "weight": weight} | ({"scores": scores} if gated else {}), case.tokens)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    n_experts=st.integers(1, 5),
    s_in=st.sampled_from([1, 2, 3]),
    s_out=st.sampled_from([1, 2, 3]),
    mult=st.integers(1, 2),
    used=st.integers(1, 5),
    gated=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_expert_matmul_matches_loop_random(n, n_experts, s_in, s_out, mult, used, gated, seed):
    """Random shapes; only ``used`` of the experts get slots, so some may get none."""
    S = math.lcm(s_in, s_out) * mult
    pool = torch.randperm(n_experts, generator=_gen(seed))[: min(used, n_experts)]
    indices = pool[torch.randint(0, len(pool), (n, S), generator=_gen(seed + 1))]
    _check_expert_matmul(n, n_experts, s_in, S, s_out, indices, gated, seed)


# ---------------------------------------------------------------- SwitchHead


SWITCHHEAD_CASES = [
    # (pos, experts, shared_selection, window)
    ("xl", "vo", False, "mem-block"),
    ("xl", "vo", False, "mem-full"),
    ("xl", "vo", False, "bidirectional"),
    ("rope", "vo", False, "mem-block"),
    ("rope", "vo", False, "no-mem"),
    ("rope", "vo", False, "bidirectional"),
    ("xl", "v", False, "mem-block"),
    ("xl", "o", False, "mem-block"),
    ("xl", "qkvo", False, "mem-block"),
    ("rope", "qkvo", False, "mem-block"),
    ("xl", "qk", False, "mem-block"),
    ("rope", "qk", False, "mem-full"),
    ("xl", "vo", True, "mem-block"),
    ("rope", "qkvo", True, "mem-block"),
    ("xl", "o", True, "mem-full"),  # shared, but only the destination side routes
    ("xl", "k", True, "mem-full"),  # shared, but only the source side routes
]


def _switchhead_cfg(pos, experts, shared, window):
    d_head = 10 if pos == "rope" else 4  # rope: 5 channels rotated, rounded down to 4
    return _window_cfg(
        window,
        model="switchhead",
        pos=pos,
        d_head=d_head,
        n_experts=3,
        k=2,
        experts=experts,
        shared_selection=shared,
        entropy_reg=0.0,
    )


@pytest.mark.parametrize(("pos", "experts", "shared", "window"), SWITCHHEAD_CASES)
def test_switchhead_matches_reference(pos, experts, shared, window):
    """Forward and every gradient against the per-head, per-expert loop."""
    cfg = _switchhead_cfg(pos, experts, shared, window)
    seed = len(experts) * 10 + shared + 3 * len(pos)
    m = _build(SwitchHeadAttention, cfg, seed)
    x, mem, win, q_pos, k_pos = _inputs(cfg, window, seed + 1)
    y, aux = m(x, mem, win)
    choices = []
    y_ref = _ref_switchhead(m, x, mem, q_pos, k_pos, choices)
    # the routing must vary, or a wrong router or expert index could go unnoticed
    assert len({c[2] for c in choices}) > 1
    assert aux == 0.0
    _assert_matches(y, y_ref, _leaves(x, mem, m), seed + 2)


@pytest.mark.parametrize("experts", ["vo", "qkvo"])
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_switchhead_one_expert_ungated_is_dense(monkeypatch, pos, experts):
    """With E = 1, k = 1 and gates forced to 1, SwitchHead is dense attention with the same weights."""

    def ungated(logits, k, expert_dropout=0.0):
        shape = (*logits.shape[:-1], k)
        return torch.ones_like(logits), torch.zeros(shape, dtype=torch.long)

    monkeypatch.setattr(switchhead_module, "sigmoid_topk", ungated)
    cfg = _switchhead_cfg(pos, experts, False, "mem-block").replace(n_experts=1, k=1)
    H = cfg.n_heads
    sw = _build(SwitchHeadAttention, cfg, 11)
    dense = DenseAttention(cfg.replace(model="transformer")).double()
    with torch.no_grad():
        for name in "qkv":
            w = getattr(sw, name)
            # expert h is [d_model, D]; the dense head h is rows h*D:(h+1)*D of a [H*D, d_model] weight
            w = torch.cat([w[h].T for h in range(H)], 0) if name in experts else w.weight
            getattr(dense, name).weight.copy_(w)
        o = torch.cat([sw.o[h].T for h in range(H)], 1) if "o" in experts else sw.o.weight
        dense.o.weight.copy_(o)
        if pos == "xl":
            dense.attention.pos_proj.weight.copy_(sw.attention.pos_proj.weight)
    x, mem, win, _, _ = _inputs(cfg, "mem-block", 12)
    y, _ = sw(x, mem, win)
    y_dense, _ = dense(x, mem, win)
    _assert_matches(y, y_dense, {"x": x, "mem": mem}, 13)


# ---------------------------------------------------------------- dense attention


def _ref_dense(m, cfg, x, mem, q_pos, k_pos):
    """Head by head: rows of the Q, K, V weights, the XL terms (learned scale, u, v) if any, columns of O."""
    D = cfg.d_head
    xs = x if mem is None else torch.cat([mem, x], 1)
    xl = cfg.pos == "xl"
    rows = []
    for b in range(x.shape[0]):
        heads = []
        for h in range(cfg.n_heads):
            part = slice(h * D, (h + 1) * D)
            q = [m.q.weight[part] @ vec for vec in x[b]]
            k = [m.k.weight[part] @ vec for vec in xs[b]]
            v = [m.v.weight[part] @ vec for vec in xs[b]]
            pos_weight = m.attention.pos_proj.weight[part] if xl else None
            terms = ()
            if xl and cfg.xl_bias_and_scale:
                att = m.attention
                terms = (att.logit_scale[0], att.content_bias[h], att.position_bias[h])
            heads.append(_ref_head(q, k, v, q_pos, k_pos, cfg, pos_weight, *terms))
        for i in range(x.shape[1]):
            rows.append(sum(m.o.weight[:, h * D : (h + 1) * D] @ heads[h][i] for h in range(cfg.n_heads)))
    return torch.stack(rows).view(*x.shape[:2], -1)


@pytest.mark.parametrize(
    ("pos", "extras", "window"),
    [
        ("xl", True, "mem-block"),
        ("xl", True, "mem-full"),
        ("xl", True, "bidirectional"),
        ("xl", False, "mem-block"),
        ("rope", True, "mem-block"),
    ],
)
def test_dense_matches_reference(pos, extras, window):
    """Forward and every gradient, the XL biases u, v and the learned logit scale (redrawn at random, so none of
    them is trivial) included, against the per-head loop."""
    cfg = _window_cfg(
        window, model="transformer", pos=pos, d_head=10 if pos == "rope" else 4, xl_bias_and_scale=extras
    )
    seed = 70 + 3 * len(pos) + extras
    m = _build(DenseAttention, cfg, seed)
    extra_names = {f"attention.{n}" for n in ("content_bias", "position_bias", "logit_scale")}
    assert (extra_names <= dict(m.named_parameters()).keys()) == (pos == "xl" and extras)
    x, mem, win, q_pos, k_pos = _inputs(cfg, window, seed + 1)
    y, _ = m(x, mem, win)
    _assert_matches(y, _ref_dense(m, cfg, x, mem, q_pos, k_pos), _leaves(x, mem, m), seed + 2)


# ---------------------------------------------------------------- MoA


MOA_CASES = [
    # (pos, gating, window, n_heads)
    ("xl", "softmax", "mem-block", 2),
    ("xl", "sigmoid", "mem-block", 2),
    ("xl", "softmax", "bidirectional", 2),
    ("xl", "softmax", "mem-full", 4),  # every expert active
    ("rope", "softmax", "mem-block", 2),
    ("rope", "sigmoid", "mem-block", 3),
    ("rope", "sigmoid", "no-mem", 2),
]


@pytest.mark.parametrize(("pos", "gating", "window", "heads"), MOA_CASES)
def test_moa_matches_reference(pos, gating, window, heads):
    """Forward, every gradient and (softmax gating) the auxiliary loss against the per-expert loop."""
    cfg = _window_cfg(
        window,
        model="moa",
        pos=pos,
        d_head=10 if pos == "rope" else 4,
        n_heads=heads,
        n_experts=4,
        moa_gating=gating,
        moa_cv_coef=0.3,
        moa_switch_coef=0.2,
        moa_z_coef=0.1,
    )
    seed = 100 + 10 * heads + len(pos) + len(gating)
    m = _build(MoAAttention, cfg, seed)
    x, mem, win, q_pos, k_pos = _inputs(cfg, window, seed + 1)
    y, aux = m(x, mem, win)
    y_ref, routing = _ref_moa(m, x, mem, q_pos, k_pos)
    if heads < cfg.n_experts:
        assert len({tuple(sorted(r[1])) for r in routing}) > 1
    if gating == "softmax":
        hand = _hand_moa_losses(*(list(col) for col in zip(*routing, strict=True)))
        expected = 0.3 * hand["cv"] + 0.2 * hand["switch"] + 0.1 * hand["z"]
        torch.testing.assert_close(torch.as_tensor(aux, dtype=F64), torch.tensor(expected, dtype=F64), **TOL)
    else:
        assert aux == 0.0
    _assert_matches(y, y_ref, _leaves(x, mem, m), seed + 2)


@pytest.mark.parametrize("pos", ["xl", "rope"])
@pytest.mark.parametrize("kind", ["switchhead", "moa"])
def test_observed_forward_matches_reference(kind, pos):
    """Recording the maps takes another path (no fused attention for RoPE): same outputs, valid maps."""
    d_head = 10 if pos == "rope" else 4
    if kind == "switchhead":
        cfg = _switchhead_cfg(pos, "vo", False, "mem-block")
    else:
        cfg = _window_cfg("mem-block", model="moa", pos=pos, d_head=d_head, n_experts=4, moa_gating="sigmoid")
    m = _build(SwitchHeadAttention if kind == "switchhead" else MoAAttention, cfg, 60 + len(pos))
    x, mem, win, q_pos, k_pos = _inputs(cfg, "mem-block", 61)
    with observe(m) as records:
        y, _ = m(x, mem, win)
    if kind == "switchhead":
        y_ref = _ref_switchhead(m, x, mem, q_pos, k_pos, [])
    else:
        y_ref, _ = _ref_moa(m, x, mem, q_pos, k_pos)
    maps = records[""]["maps"]  # [B, H, t, S]
    allowed = torch.tensor([[_allowed(qp, kp, cfg) for kp in k_pos] for qp in q_pos])
    assert maps.shape == (2, cfg.n_heads, len(q_pos), len(k_pos))
    assert (maps[..., ~allowed] == 0).all() and (maps[..., allowed] > 0).all()
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1], dtype=F64), **TOL)
    _assert_matches(y, y_ref, _leaves(x, mem, m), 62)


# ---------------------------------------------------------------- every family, head widths, the XL shift


def _reference(m, cfg, x, mem, q_pos, k_pos):
    if cfg.attention == "dense":
        return _ref_dense(m, cfg, x, mem, q_pos, k_pos)
    if cfg.attention == "moa":
        return _ref_moa(m, x, mem, q_pos, k_pos)[0]
    return _ref_switchhead(m, x, mem, q_pos, k_pos, [])


@pytest.mark.parametrize(  # an odd and an even width in the fast loop, all four in the full suite
    "d_head", [5, pytest.param(6, marks=pytest.mark.slow), 8, pytest.param(12, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("window", ["mem-block", "bidirectional-mem"])
@pytest.mark.parametrize("pos", ["xl", "rope"])
@pytest.mark.parametrize("model", ["transformer", "switchhead", "moa", "switchall"])
def test_every_family_matches_reference(model, pos, window, d_head):
    """Each family's attention as its configuration builds it (SwitchAll: SwitchHead's), forward and every
    gradient, causal with memory and not, at head widths SDPA pads (5, 6, 12) and one it runs as is (8)."""
    cfg = _window_cfg(window, model=model, pos=pos, d_head=d_head, n_experts=4, k=2)
    seed = 300 + 10 * d_head + len(model) + 3 * len(pos) + len(window)
    m = _build(cfg.family.attention, cfg, seed)
    x, mem, win, q_pos, k_pos = _inputs(cfg, window, seed + 1)
    y, _ = m(x, mem, win)
    _assert_matches(y, _reference(m, cfg, x, mem, q_pos, k_pos), _leaves(x, mem, m), seed + 2)


def _ops(fn) -> set[str]:
    """Names of the operators ``fn()`` calls, backward ones included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("window", ["mem-block", "bidirectional-mem"])
def test_xl_positions_take_no_indexing(window):
    """The point of relative_shift: no indexing, whose accumulating index_put_ backward was ~70% of a dense XL
    training step on an H100."""
    cfg = _window_cfg(window, model="transformer", pos="xl")
    m = _build(DenseAttention, cfg, 90)
    x, mem, win, _, _ = _inputs(cfg, window, 91)
    ops = _ops(lambda: m(x, mem, win)[0].sum().backward())
    assert "aten::_softmax_backward_data" in ops  # the profile saw the backward
    assert not [op for op in ops if "index" in op]


@pytest.mark.parametrize("d_head", [6, 8, 16])
def test_sdpa_pads_only_unaligned_heads(d_head):
    cfg = _window_cfg("mem-block", model="transformer", pos="rope", d_head=d_head)
    m = _build(DenseAttention, cfg, 92)
    x, mem, win, _, _ = _inputs(cfg, "mem-block", 93)
    assert ("aten::pad" in _ops(lambda: m(x, mem, win))) == (d_head % 8 != 0)


# ---------------------------------------------------------------- dense MLP


def test_the_mlp_padded_for_cuda_is_the_mlp(monkeypatch):
    """On CUDA the hidden layer runs in a multiple of 8 units (here forced on the CPU, 13 -> 16): the zero units
    change no output and no parameter's gradient, in float64."""
    assert [mlp_module.padding(w, torch.device("cuda")) for w in (4110, 4188, 2053, 4096)] == [2, 4, 3, 0]
    assert mlp_module.padding(4110, torch.device("cpu")) == 0
    mlp = DenseMLP(ModelConfig(d_model=6, d_ff=13, n_layers=2)).double()
    x = _randn(7, 2, 5, 6).requires_grad_()
    leaves = [x, mlp.up.weight, mlp.down.weight]
    cotangent = _randn(8, 2, 5, 6)
    expected = mlp(x)[0]
    expected_grads = torch.autograd.grad(expected, leaves, cotangent)
    monkeypatch.setattr(mlp_module, "padding", lambda d_ff, device: -d_ff % 8)
    got = mlp(x)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    for g, e in zip(torch.autograd.grad(got, leaves, cotangent), expected_grads, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- sigma-MoE


@pytest.mark.parametrize(("n_experts", "k"), [(5, 2), (4, 1), (3, 3)])
def test_sigma_moe_matches_reference(n_experts, k):
    """y = sum over the top-k of sigmoid(x W_r)_e * relu(x W1_e) W2_e, forward and every gradient."""
    cfg = ModelConfig(
        model="switchall",
        d_model=6,
        n_layers=2,
        n_heads=1,
        d_head=2,
        mlp_experts=n_experts,
        mlp_expert_size=3,
        mlp_k=k,
        mlp_entropy_reg=0.0,
        dropout=0.0,
    )
    m = _build(SigmaMoE, cfg, 20 + n_experts + k)
    x = _randn(30 + k, 2, 5, cfg.d_model).requires_grad_()
    y, aux = m(x)
    rows, chosen = [], set()
    for vec in x.reshape(-1, cfg.d_model):
        scores = torch.sigmoid(m.router.weight @ vec)
        best = _topk(scores, k)
        chosen.add(tuple(sorted(best)))
        rows.append(sum(scores[e] * (torch.relu(vec @ m.up[e]) @ m.down[e]) for e in best))
    y_ref = torch.stack(rows).view_as(x)
    if k < n_experts:
        assert len(chosen) > 1
    assert aux == 0.0
    _assert_matches(y, y_ref, _leaves(x, None, m), 40 + k)


def test_sigma_moe_regularizer_pools_the_whole_batch():
    """The MLP's entropy regulariser: its coefficient times sum_e p_e log p_e of the softmax of the router's logits
    averaged over every token of the batch (the authors' sigma-MoE pools the batch, where SwitchHead pools each
    sequence), by hand in float64."""
    cfg = ModelConfig(
        model="switchall", d_model=6, n_layers=2, n_heads=1, d_head=2, mlp_experts=5, mlp_expert_size=3, mlp_k=2,
        mlp_entropy_reg=0.3, dropout=0.0,
    )  # fmt: skip
    m = _build(SigmaMoE, cfg, 24)
    x = _randn(31, 3, 5, cfg.d_model)
    _, aux = m(x)
    rows = [(m.router.weight @ vec).tolist() for vec in x.reshape(-1, cfg.d_model)]
    assert aux.item() == pytest.approx(0.3 * _hand_entropy_term(rows), rel=1e-12)
    per_sequence = sum(_hand_entropy_term(rows[b * 5 : (b + 1) * 5]) for b in range(3)) / 3
    assert abs(0.3 * per_sequence - aux.item()) > 1e-3  # the two poolings differ on these tokens


@pytest.mark.parametrize("module", ["sigma-moe", "switchhead"])
def test_expert_dropout_is_training_only(module):
    """Expert dropout hides experts from the selection in training alone: in evaluation a module with it gives
    the outputs of the same module without it (and in training, with half the experts hidden, others)."""
    if module == "sigma-moe":
        cfg = ModelConfig(
            model="switchall", d_model=6, n_layers=2, n_heads=1, d_head=2, mlp_experts=5, mlp_expert_size=3,
            mlp_k=2, dropout=0.0,
        )  # fmt: skip
        cls, field, args = SigmaMoE, "mlp_expert_dropout", (_randn(33, 2, 5, 6),)
    else:
        cfg = _window_cfg("no-mem", model="switchhead", n_heads=2, d_head=3, n_experts=4, k=2)
        cls, field, args = SwitchHeadAttention, "expert_dropout", _inputs(cfg, "no-mem", 34)[:3]
    plain = _build(cls, cfg, 35)
    dropped = _build(cls, cfg.replace(**{field: 0.5}), 35)
    torch.testing.assert_close(dropped.eval()(*args)[0], plain.eval()(*args)[0], rtol=0, atol=0)
    torch.manual_seed(36)
    trained = dropped.train()(*args)[0]
    torch.manual_seed(36)
    assert not torch.equal(trained, plain.train()(*args)[0])


# ---------------------------------------------------------------- MoA auxiliary losses


def test_moa_losses_hand_made_routing():
    """4 tokens, 3 experts, H = 2: expert 0 is chosen 4 times, expert 1 three times, expert 2 once."""
    logits = [[2.0, 1.0, 0.0], [1.0, 0.0, 2.0], [3.0, 2.0, -1.0], [1.0, 2.0, 0.0]]
    chosen = [[0, 1], [2, 0], [0, 1], [1, 0]]
    probs = torch.tensor(logits, dtype=F64).softmax(-1)
    gates = probs.gather(1, torch.tensor(chosen)).tolist()
    hand = _hand_moa_losses(logits, chosen, gates)
    assert hand["counts"] == [4, 3, 1]
    got = moa_losses(torch.tensor(logits, dtype=F64), torch.tensor(gates, dtype=F64), torch.tensor(chosen))
    for name in ("cv", "switch", "z"):
        torch.testing.assert_close(got[name], torch.tensor(hand[name], dtype=F64), **TOL, msg=name)


def test_moa_losses_known_values():
    """Uniform logits and balanced choices: cv = 0, switch = 1, z = (log E)^2."""
    E, N, H = 4, 6, 2
    logits = torch.zeros(N, E, dtype=F64)
    chosen = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    gates = torch.full((N, H), 1 / E, dtype=F64)
    got = moa_losses(logits, gates, chosen)
    torch.testing.assert_close(got["cv"], torch.tensor(0.0, dtype=F64), **TOL)
    torch.testing.assert_close(got["switch"], torch.tensor(1.0, dtype=F64), **TOL)
    torch.testing.assert_close(got["z"], torch.tensor(math.log(E) ** 2, dtype=F64), **TOL)


# ---------------------------------------------------------------- router and positions


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("expert_dropout", [0.0, 0.4])
def test_sigmoid_topk(k, expert_dropout):
    """Scores are the raw sigmoids of every expert; the chosen experts are the top-k of those not dropped, each
    expert dropped where its uniform draw is below the rate (replayed from the same seed): a chosen expert that
    survived is one of the survivors' top-k, and fewer than k survivors are all chosen."""
    torch.manual_seed(k)
    logits = _randn(k, 5, 3, 6, scale=2.0)
    scores, experts = sigmoid_topk(logits, k, expert_dropout)
    torch.manual_seed(k)  # the same draws as the router's torch.rand_like(scores)
    dropped = torch.rand(logits.shape, dtype=F64) < expert_dropout
    assert scores.shape == logits.shape and experts.shape == (5, 3, k)
    gates = scores.gather(-1, experts)
    changed = 0  # rows whose choice the dropout changed
    for n in range(5):
        for g in range(3):
            row = experts[n, g].tolist()
            assert len(set(row)) == k
            survivors = [e for e in range(6) if not dropped[n, g, e]]
            best = _topk(logits[n, g, survivors], k)
            assert set(row) & set(survivors) == {survivors[i] for i in best}, (n, g)
            changed += set(row) != set(_topk(logits[n, g], k))
            for gate, e in zip(gates[n, g].tolist(), row, strict=True):
                assert gate == pytest.approx(1 / (1 + math.exp(-logits[n, g, e].item())), rel=1e-12)
    # the replay tests something: at rate 0.4 some rows lost a top-k expert (all 6 are chosen at k = 6)
    assert (changed > 0) == (expert_dropout > 0 and k < 6)


@pytest.mark.parametrize("routing", ["count", "triton"])
@pytest.mark.parametrize("E", range(1, 10))  # past FEW_EXPERTS (8): torch's top-k
def test_top_k_of_few_experts_by_rank_is_torch_top_k(E, routing):
    """Routing without sorts, in elementwise kernels or Triton's: the k largest, largest first, torch.topk's experts
    in its order (distinct values); ties go to the lower id, and experts hidden by dropout (-inf) come last."""
    for k in range(1, E + 1):
        candidates = torch.sigmoid(_randn(E * 10 + k, 64, 3, E, scale=3.0))
        with routing_selected(routing):
            _, chosen = sigmoid_topk(torch.logit(candidates).to(_device(routing)), k)
        chosen = chosen.cpu()
        picked = candidates.gather(-1, chosen)
        if E > FEW_EXPERTS:  # torch.topk unsorted: the same experts, in its own order
            picked = picked.sort(-1, descending=True).values
        assert torch.equal(picked, candidates.topk(k, dim=-1).values)
    tied = torch.tensor([[0.5, 0.9, 0.5, float("-inf"), 0.9, 0.1, float("-inf"), 0.5]], dtype=F64)
    ranked = top_by_rank if routing == "count" else top_k_by_rank
    assert ranked(tied.to(_device(routing)), 8).tolist() == [[1, 4, 0, 2, 7, 5, 3, 6]]


@pytest.mark.parametrize("routing", ["count", "triton"])
def test_a_diverged_router_s_nan_ranks_first_and_every_id_is_an_expert(routing):
    """NaN fails every comparison: counted as the largest (torch.topk's order), ties to the lower id, the ranks stay
    a permutation; else two experts share a rank and the Triton kernel's sum of their ids names no expert."""
    nan, inf = float("nan"), float("inf")
    rows = [[nan, nan, nan, nan], [0.3, nan, 0.9, nan], [-inf, nan, inf, 0.1], [0.2, 0.7, nan, -inf]]

    def naive(row: list[float], k: int) -> list[int]:
        return sorted(range(len(row)), key=lambda e: (-(inf if math.isnan(row[e]) else row[e]), e))[:k]

    ranked = top_by_rank if routing == "count" else top_k_by_rank
    for k in (1, 2, 4):
        got = ranked(torch.tensor(rows, dtype=F64).to(_device(routing)), k).tolist()
        assert got == [naive(row, k) for row in rows]


def _device(routing: str) -> str:
    """Where ``routing``'s top-k runs: Triton's where its kernels run."""
    return TRITON_DEVICE if routing == "triton" else "cpu"


def _hand_entropy_term(rows: list[list[float]]) -> float:
    """sum_e p_e log p_e of the mean over ``rows`` of softmax(row)."""
    mean_p = [0.0] * len(rows[0])
    for row in rows:
        z = sum(math.exp(v) for v in row)
        for e, v in enumerate(row):
            mean_p[e] += math.exp(v) / z / len(rows)
    return sum(p * math.log(p) for p in mean_p)


def test_entropy_regularizer_by_hand():
    """Minus the entropy of each group's averaged softmax, averaged over the groups."""
    logits = _randn(50, 3, 7, 4, scale=1.5)
    expected = sum(_hand_entropy_term(logits[b].tolist()) for b in range(3)) / 3
    assert entropy_regularizer(logits).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("window", ["mem-block", "no-mem"])
def test_switchhead_regularizer_pools_each_sequence(window):
    """As the authors: for each side, each sequence's router softmaxes are averaged over its tokens and heads;
    minus the entropy of that mean, averaged over the sequences, summed over the sides, times the coefficient."""
    cfg = _switchhead_cfg("xl", "vo", False, window).replace(entropy_reg=0.3, n_heads=3)
    m = _build(SwitchHeadAttention, cfg, 80)
    x, mem, win, _, _ = _inputs(cfg, window, 81, batch=3)
    _, aux = m(x, mem, win)
    xs = x if mem is None else torch.cat([mem, x], 1)
    E = cfg.n_experts
    expected = 0.0
    for router, tokens in ((m.src_router, xs), (m.dst_router, x)):
        for b in range(3):
            rows = [
                (router.weight[h * E : (h + 1) * E] @ vec).tolist()
                for vec in tokens[b]
                for h in range(cfg.n_heads)
            ]
            expected += 0.3 * _hand_entropy_term(rows) / 3
    assert aux.item() == pytest.approx(expected, rel=1e-12)


def test_sinusoids_formula():
    """The XL encoding table the references reuse: [sin(d f_m), cos(d f_m)], f_m = 10000^(-2m/d_model)."""
    d_model = 7
    table = sinusoids(torch.arange(-3, 9), d_model, F64)
    for row, d in zip(table, range(-3, 9), strict=True):
        freqs = [10000.0 ** (-2 * m / d_model) for m in range((d_model + 1) // 2)]
        expected = ([math.sin(d * f) for f in freqs] + [math.cos(d * f) for f in freqs])[:d_model]
        assert row.tolist() == pytest.approx(expected, abs=1e-12)
