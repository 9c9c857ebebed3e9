"""GQA/MQA: against a naive per-head loop and against the dense layer with its key-value heads repeated (float64),
its exact cost against the counters, its presets against their dense rows' weights, its options checked."""

import math
import re
import subprocess
import sys

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
from switchbench.models.layers.attention_rope import rotate
from switchbench.models.layers.observe import observe
from switchbench.models.layers.window import make_window
from switchbench.models.presets import PRESETS


def _cfg(pos="rope", causal=True, kv=2, H=4, T=5, context_blocks=1, **extra) -> ModelConfig:
    return ModelConfig(
        model="gqa",
        pos=pos,
        causal=causal,
        context_blocks=context_blocks if causal else 0,
        d_model=12,
        n_heads=H,
        d_head=6,
        T=T,
        n_layers=2,
        options={"n_kv_heads": kv},
        **extra,
    )


def _inputs(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cfg.T, cfg.d_model, generator=gen, dtype=torch.float64)
    mem = (
        torch.randn(2, cfg.mem_len, cfg.d_model, generator=gen, dtype=torch.float64) if cfg.mem_len else None
    )
    window = make_window(cfg.mem_len, cfg.mem_len, cfg.T, cfg.T, cfg.context_blocks, cfg.causal, "cpu")
    return x, mem, window


def _layer(cfg, seed=0):
    torch.manual_seed(seed)
    layer = cfg.family.attention(cfg).double()
    with torch.no_grad():  # non-zero XL extras, so that copying them is tested
        for p in layer.parameters():
            if p.dim() < 2:
                p.normal_()
    return layer


def _naive_rope(layer, cfg, x, mem, window):
    """Head by head: query head h reads key-value head h // (H / Hk); softmax over the allowed keys."""
    B, t, _ = x.shape
    xs = x if mem is None else torch.cat([mem, x], 1)
    H, Hk, D = cfg.n_heads, cfg.opts.n_kv_heads, cfg.d_head
    q = (x @ layer.q.weight.T).view(B, t, H, D)
    k = (xs @ layer.k.weight.T).view(B, -1, Hk, D)
    v = (xs @ layer.v.weight.T).view(B, -1, Hk, D)
    heads = []
    for h in range(H):
        g = h // (H // Hk)
        qh = rotate(q[:, :, h][:, None], window.q_pos)[:, 0]  # [B, t, D]
        kh = rotate(k[:, :, g][:, None], window.k_pos)[:, 0]
        logits = qh @ kh.transpose(-1, -2) / math.sqrt(D)
        if window.mask is not None:
            logits = logits.masked_fill(~window.mask, float("-inf"))
        heads.append(logits.softmax(-1) @ v[:, :, g])
    return torch.cat(heads, -1) @ layer.o.weight.T


@pytest.mark.parametrize("kv", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_rope_equals_a_per_head_loop_in_float64(kv, causal):
    cfg = _cfg(kv=kv, causal=causal)
    layer = _layer(cfg)
    x, mem, window = _inputs(cfg)
    y, aux = layer(x, mem, window)
    torch.testing.assert_close(y, _naive_rope(layer, cfg, x, mem, window), rtol=1e-10, atol=1e-10)
    assert aux == 0.0


@pytest.mark.parametrize("pos", ["xl", "rope"])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_equals_the_dense_layer_with_key_value_heads_repeated(pos, kv):
    """The dense layer whose K and V rows are each key-value head's, repeated for its group (XL extras copied)."""
    cfg = _cfg(pos=pos, kv=kv)
    gqa = _layer(cfg)
    dense_cfg = cfg.replace(model="transformer", options=())
    dense = dense_cfg.family.attention(dense_cfg).double()
    group, D = cfg.n_heads // kv, cfg.d_head
    with torch.no_grad():
        state = dict(gqa.state_dict())
        for name in ("k.weight", "v.weight"):
            w = state[name].view(kv, D, -1)
            state[name] = w.repeat_interleave(group, dim=0).reshape(cfg.n_heads * D, -1)
        dense.load_state_dict(state)
    x, mem, window = _inputs(cfg, seed=1)
    torch.testing.assert_close(gqa(x, mem, window)[0], dense(x, mem, window)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kv", [1, 2])
def test_observed_maps_are_the_grouped_attention_that_runs(kv):
    """Observing takes the explicit-softmax path; its output equals SDPA's grouped path, its maps are rows that
    sum to one over the allowed keys."""
    cfg = _cfg(kv=kv)
    layer = _layer(cfg)
    x, mem, window = _inputs(cfg)
    plain = layer(x, mem, window)[0]
    with observe(layer) as records:
        seen = layer(x, mem, window)[0]
    maps = records[""]["maps"]
    torch.testing.assert_close(seen, plain, rtol=1e-10, atol=1e-10)
    assert maps.shape == (2, cfg.n_heads, cfg.T, cfg.T + cfg.mem_len)
    torch.testing.assert_close(maps.sum(-1), torch.ones_like(maps.sum(-1)))
    assert not maps.masked_select(~window.mask).any()


@st.composite
def configs(draw):
    causal = draw(st.booleans())
    kv = draw(st.integers(1, 3))
    return ModelConfig(
        model="gqa",
        pos=draw(st.sampled_from(["xl", "rope"])),
        causal=causal,
        context_blocks=draw(st.integers(0, 2)) if causal else 0,
        d_model=draw(st.integers(4, 24)),
        n_heads=kv * draw(st.integers(1, 3)),
        d_head=draw(st.integers(1, 9)),
        T=draw(st.integers(1, 7)),
        xl_bias_and_scale=draw(st.booleans()),
        n_layers=2,
        options={"n_kv_heads": kv},
    )


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_exact_count_equals_the_three_counters(cfg):
    assert_counted_exactly(cfg)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_exact_count_of_one_configuration_equals_the_counters(pos):
    cfg = _cfg(pos=pos, kv=2, context_blocks=1 if pos == "xl" else 0)
    exact = exact_cost(cfg)
    assert (measure.flop_counter_macs(cfg), measure.saved_floats(cfg)) == (exact.macs, exact.mem)
    # by hand, MACs: Q and O as dense, K and V of two heads over the window, attention of four query heads
    H, Hk, dh, dm, T, S = 4, 2, 6, 12, 5, cfg.mem_len + 5
    projections = T * dm * H * dh * 2 + 2 * S * dm * Hk * dh
    assert exact.macs - projections == exact_cost(cfg.replace(model="transformer", options=())).macs - (
        T * dm * H * dh * 2 + 2 * S * dm * H * dh
    )


def test_presets_match_their_dense_rows_in_weights_per_layer():
    """Attention + MLP weights per layer equal the dense row's, as the paper matches its models."""
    found = [name for name, cfg in PRESETS.items() if cfg.model == "gqa"]
    assert {"c4-47m-gqa-h10-kv2", "c4-47m-mqa-h10", "c4-262m-gqa-h16-kv4", "wikitext103-244m-mqa-h16"} <= set(
        found
    )
    for name in found:
        dense = re.sub(r"-kv\d+", "", name.replace("gqa", "transformer").replace("mqa", "transformer"))
        mine, theirs = (parameter_counts(PRESETS[n])["per_layer"] for n in (name, dense))
        assert mine["attention_plus_mlp"] == theirs["attention_plus_mlp"], name
        assert mine["attention"] < theirs["attention"]
        assert PRESETS[name].opts.n_kv_heads == (
            1 if "mqa" in name else int(name.split("-kv")[1].split("-")[0])
        )


@pytest.mark.parametrize(
    ("options", "heads", "message"),
    [
        ({"n_kv_heads": 3}, 4, "multiple of n_kv_heads"),
        ({"n_kv_heads": 0}, 4, "n_kv_heads must be >= 1; got 0"),
        ({"n_kv_heads": 2, "n_shared": 1}, 4, "n_shared is no option of model gqa"),
    ],
)
def test_bad_options_are_value_errors_that_say_why(options, heads, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(model="gqa", n_heads=heads, options=options)
    with pytest.raises(ValueError, match="takes no options"):
        ModelConfig(model="transformer", options={"n_kv_heads": 2})


@pytest.mark.slow  # a subprocess or a timing: seconds each, in tox
def test_the_option_is_a_flag_and_a_wrong_family_exits_2():
    run = [sys.executable, "-m", "switchbench", "params", "--json"]
    ok = subprocess.run(
        [*run, "tiny-transformer", "--model", "gqa", "--n-kv-heads", "2"], capture_output=True
    )
    assert ok.returncode == 0, ok.stderr
    assert b'"n_kv_heads": 2' in ok.stdout
    bad = subprocess.run([*run, "tiny-switchhead", "--n-kv-heads", "2"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert re.search("model switchhead takes no options; got n_kv_heads", bad.stderr)
    assert len(bad.stderr.strip().splitlines()) == 1
