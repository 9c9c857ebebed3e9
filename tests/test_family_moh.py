"""MoH: the routing invariants (shared heads always on, exactly k routed heads per token, weights as defined),
against a naive per-token and per-head float64 computation; the balance loss by a loop; its exact cost against the
counters; its presets against their dense rows' weights; its options checked."""

import math

import pytest

pytest.importorskip("hypothesis")  # a GPU node without it skips this module, naming it
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive import assert_counted_exactly

from switchbench.bench.cost import measure
from switchbench.bench.cost.accounting import exact_cost
from switchbench.bench.cost.params import parameter_counts
from switchbench.models.config import ModelConfig
from switchbench.models.families.moh import balance_loss
from switchbench.models.layers.attention_rope import rotate
from switchbench.models.layers.observe import observe
from switchbench.models.layers.window import make_window
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS


def _cfg(pos="rope", shared=2, k=2, H=6, T=5, causal=True, context_blocks=1, coef=0.01) -> ModelConfig:
    return ModelConfig(model="moh", pos=pos, causal=causal, context_blocks=context_blocks if causal else 0,
                       d_model=12, n_heads=H, d_head=4, T=T, n_layers=2,
                       options={"shared_heads": shared, "routed_k": k, "balance_coef": coef})  # fmt: skip


def _layer_and_inputs(cfg, seed=0):
    torch.manual_seed(seed)
    layer = cfg.family.attention(cfg).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cfg.T, cfg.d_model, generator=gen, dtype=torch.float64)
    mem = (
        torch.randn(2, cfg.mem_len, cfg.d_model, generator=gen, dtype=torch.float64) if cfg.mem_len else None
    )
    window = make_window(cfg.mem_len, cfg.mem_len, cfg.T, cfg.T, cfg.context_blocks, cfg.causal, "cpu")
    return layer, x, mem, window


def _naive_weights(layer, cfg, x_token) -> list[float]:
    """One token's head weights, by the definitions: shared heads first, then the routed ones."""
    hs, H, k = cfg.opts.shared_heads, cfg.n_heads, cfg.opts.routed_k
    Er = H - hs
    shared = [1.0] * hs
    if hs > 1:
        shared = [hs * p for p in torch.softmax(layer.shared_router.weight @ x_token, 0).tolist()]
    routed = [0.0] * Er
    if Er:
        p = torch.softmax(layer.router.weight @ x_token, 0).tolist()
        top = sorted(range(Er), key=lambda e: -p[e])[:k]
        total = sum(p[e] for e in top)
        for e in top:
            routed[e] = p[e] / total * k
    if hs and Er:
        a_s, a_r = (2 * torch.softmax(layer.mix.weight @ x_token, 0)).tolist()
        shared, routed = [w * a_s for w in shared], [w * a_r for w in routed]
    return shared + routed


@pytest.mark.parametrize(("shared", "k", "H"), [(2, 2, 6), (1, 3, 6), (0, 2, 4), (3, 0, 3), (2, 4, 6)])
def test_weights_follow_the_definition_and_the_routing_invariants(shared, k, H):
    cfg = _cfg(shared=shared, k=k, H=H)
    layer, x, _, _ = _layer_and_inputs(cfg)
    weights, chosen, _ = layer.head_weights(x)  # [B, t, H], [B, t, k]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected = torch.tensor(_naive_weights(layer, cfg, x[b, t]), dtype=torch.float64)
            torch.testing.assert_close(weights[b, t], expected, rtol=1e-12, atol=1e-12)
    assert (weights[..., :shared] > 0).all()  # shared heads always on
    routed = weights[..., shared:]
    assert ((routed > 0).sum(-1) == k).all()  # exactly k routed heads per token
    if chosen is not None:
        assert sorted(chosen.flatten().unique().tolist()) <= list(range(shared, H))
        on = torch.zeros_like(routed, dtype=torch.bool).scatter(-1, chosen - shared, True)
        assert torch.equal(on, routed > 0)
    if shared and H - shared:  # the two groups' weights sum to h_s a_s and k a_r, a_s + a_r = 2
        total = weights[..., :shared].sum(-1) / shared + routed.sum(-1) / k
        torch.testing.assert_close(total, torch.full_like(total, 2.0))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("shared", "k"), [(2, 2), (0, 1), (1, 3)])
def test_rope_output_equals_a_per_head_loop_weighted_by_token(causal, shared, k):
    cfg = _cfg(shared=shared, k=k, causal=causal)
    layer, x, mem, window = _layer_and_inputs(cfg)
    B, t, _ = x.shape
    xs = x if mem is None else torch.cat([mem, x], 1)
    H, D = cfg.n_heads, cfg.d_head
    q, kk, v = (
        (inp @ p.weight.T).view(B, -1, H, D) for inp, p in ((x, layer.q), (xs, layer.k), (xs, layer.v))
    )
    heads = []
    for h in range(H):
        qh = rotate(q[:, :, h][:, None], window.q_pos)[:, 0]
        kh = rotate(kk[:, :, h][:, None], window.k_pos)[:, 0]
        logits = qh @ kh.transpose(-1, -2) / math.sqrt(D)
        if window.mask is not None:
            logits = logits.masked_fill(~window.mask, float("-inf"))
        w = torch.tensor(
            [[_naive_weights(layer, cfg, x[b, i])[h] for i in range(t)] for b in range(B)],
            dtype=torch.float64,
        )
        heads.append((logits.softmax(-1) @ v[:, :, h]) * w[..., None])
    expected = torch.cat(heads, -1) @ layer.o.weight.T
    torch.testing.assert_close(layer(x, mem, window)[0], expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_one_shared_head_is_the_dense_layer(pos):
    """H = h_s = 1: the weight is a constant one, and MoH is the dense layer (XL extras and all)."""
    cfg = _cfg(pos=pos, shared=1, k=0, H=1)
    moh, x, mem, window = _layer_and_inputs(cfg)
    dense_cfg = cfg.replace(model="transformer", options=())
    dense = dense_cfg.family.attention(dense_cfg).double()
    dense.load_state_dict(moh.state_dict())  # no routers to leave out with one head
    torch.testing.assert_close(moh(x, mem, window)[0], dense(x, mem, window)[0], rtol=1e-12, atol=1e-12)


def test_balance_loss_is_er_squared_times_the_mean_of_fraction_times_probability():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(7, 4, generator=gen, dtype=torch.float64), -1)
    chosen = probs.topk(2, -1).indices
    f = [sum(e in row for row in chosen.tolist()) / 7 for e in range(4)]
    P = probs.mean(0).tolist()
    expected = 16 * sum(fe * pe for fe, pe in zip(f, P, strict=True)) / 4
    assert balance_loss(probs, chosen).item() == pytest.approx(expected, rel=1e-12)


def test_the_balance_loss_is_added_in_training_only_and_observation_records_the_choice():
    cfg = _cfg(coef=0.5)
    layer, x, mem, window = _layer_and_inputs(cfg)
    _, aux = layer(x, mem, window)
    weights, chosen, probs = layer.head_weights(x)
    expected = 0.5 / cfg.n_layers * balance_loss(probs.flatten(0, 1), (chosen - 2).flatten(0, 1))  # its share
    torch.testing.assert_close(aux, expected)
    layer.eval()
    assert layer(x, mem, window)[1] == 0.0
    with observe(layer) as records:
        layer(x, mem, window)
    record = records[""]
    assert torch.equal(record["experts"], chosen) and torch.equal(record["head_weights"], weights)
    torch.testing.assert_close(record["gates"], weights.gather(-1, chosen))


def test_the_model_adds_the_coefficient_times_the_mean_of_the_layers_balance_losses():
    """As MoH-ViT's training (engine.py): coef x the mean over the layers, not coef x their sum."""
    cfg = _cfg(coef=0.01).replace(n_layers=3, vocab=11, dropout=0.0)
    torch.manual_seed(0)
    model = LanguageModel(cfg).double()
    inputs = {}
    for i, block in enumerate(model.stack.blocks):
        block.attn.register_forward_hook(lambda module, args, out, i=i: inputs.__setitem__(i, args[0]))
    tokens = torch.randint(0, cfg.vocab, (2, cfg.T), generator=torch.Generator().manual_seed(1))
    aux = model(tokens).aux_loss
    losses = []
    for i, block in enumerate(model.stack.blocks):
        _, chosen, probs = block.attn.head_weights(inputs[i])
        losses.append(balance_loss(probs.flatten(0, 1), (chosen - 2).flatten(0, 1)))
    assert len(losses) == 3 and min(losses) > 0
    torch.testing.assert_close(aux, 0.01 * sum(losses) / 3, rtol=1e-12, atol=0)


@st.composite
def configs(draw):
    causal = draw(st.booleans())
    H = draw(st.integers(1, 5))
    shared = draw(st.integers(0, H))
    k = draw(st.integers(1, H - shared)) if shared < H else 0
    return ModelConfig(
        model="moh",
        pos=draw(st.sampled_from(["xl", "rope"])),
        causal=causal,
        context_blocks=draw(st.integers(0, 2)) if causal else 0,
        d_model=draw(st.integers(4, 24)),
        n_heads=H,
        d_head=draw(st.integers(1, 9)),
        T=draw(st.integers(1, 7)),
        xl_bias_and_scale=draw(st.booleans()),
        n_layers=2,
        options={"shared_heads": shared, "routed_k": k, "balance_coef": draw(st.sampled_from([0.0, 0.01]))},
    )


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_exact_count_equals_the_three_counters(cfg):
    assert_counted_exactly(cfg)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_exact_count_of_one_configuration_equals_the_counters_and_a_hand_count(pos):
    cfg = _cfg(pos=pos, context_blocks=1 if pos == "xl" else 0)
    exact = exact_cost(cfg)
    assert (measure.flop_counter_macs(cfg), measure.saved_floats(cfg)) == (exact.macs, exact.mem)
    # MACs by hand: the dense layer's, plus the routers: 4 routed, 2 shared, the two-way mix, over T tokens
    dense = exact_cost(cfg.replace(model="transformer", options=()))
    assert exact.macs - dense.macs == cfg.T * cfg.d_model * (4 + 2 + 2)


def test_presets_match_their_dense_rows_in_weights_per_layer():
    found = [name for name, cfg in PRESETS.items() if cfg.model == "moh"]
    assert {"c4-47m-moh-h10", "c4-262m-moh-h16", "listops-moh-h8", "bytes-920k-moh-h4"} <= set(found)
    for name in found:
        mine = parameter_counts(PRESETS[name])["per_layer"]
        theirs = parameter_counts(PRESETS[name.replace("moh", "transformer")])["per_layer"]
        assert abs(mine["attention_plus_mlp"] - theirs["attention_plus_mlp"]) < PRESETS[name].d_model, name
        active = (PRESETS[name].opts.shared_heads + PRESETS[name].opts.routed_k) / PRESETS[name].n_heads
        assert 0.5 <= active <= 0.75, name  # the published settings' range


@pytest.mark.parametrize(
    ("H", "options", "message"),
    [(4, {"shared_heads": 5}, "at most n_heads"), (4, {"shared_heads": 2, "routed_k": 3}, r"routed_k must be in \[1, 2\]"),
     (4, {"shared_heads": 2, "routed_k": 0}, r"routed_k must be in \[1, 2\]"), (4, {"balance_coef": -1.0}, "balance_coef"),
     (4, {"n_kv_heads": 2}, "n_kv_heads is no option of model moh")],
)  # fmt: skip
def test_bad_options_are_value_errors_that_say_why(H, options, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(model="moh", n_heads=H, options=options)
