"""MoH: the routing invariants (shared heads always on, exactly k routed heads per token, weights as defined),
against a naive per-token and per-head float64 computation, for the softmax routers (MoH-ViT) and the query-norm
router (MoH-LLaMA3); the balance loss by a loop; its exact cost against the counters; its presets against their
dense rows' weights; its options checked."""

import json
import math

import pandas as pd
import pytest

pytest.importorskip("hypothesis")  # a GPU node without it skips this module, naming it
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive import assert_counted_exactly
from optional import needs

from switchbench.bench.cost import measure
from switchbench.bench.cost.accounting import exact_cost
from switchbench.bench.cost.params import parameter_counts
from switchbench.cli import main
from switchbench.models.config import ModelConfig
from switchbench.models.families.moh import balance_loss
from switchbench.models.layers.attention_rope import rotate
from switchbench.models.layers.observe import observe
from switchbench.models.layers.projections import project
from switchbench.models.layers.window import make_window
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import PRESETS


def _cfg(pos="rope", shared=2, k=2, H=6, T=5, causal=True, context_blocks=1, coef=0.01, router="softmax"):
    coef = 0.0 if router == "norm" else coef  # the norm router has no balance loss
    return ModelConfig(
        model="moh",
        pos=pos,
        causal=causal,
        context_blocks=context_blocks if causal else 0,
        d_model=12,
        n_heads=H,
        d_head=4,
        T=T,
        n_layers=2,
        options={"shared_heads": shared, "routed_k": k, "balance_coef": coef, "moh_router": router},
    )


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


def _naive_weights(layer, cfg, x_token) -> torch.Tensor:
    """One token's head weights [H], by the definitions: shared heads first, then the routed ones. Built from the
    routers' weights with autograd on, so that the loop's gradients reach them; the choice is the only constant."""
    hs, H, k = cfg.opts.shared_heads, cfg.n_heads, cfg.opts.routed_k
    Er = H - hs
    one = x_token.new_ones(())
    shared = [one] * hs
    if hs > 1:
        shared = list(hs * torch.softmax(layer.shared_router.weight @ x_token, 0))
    routed = [0 * one] * Er
    if Er:
        p = torch.softmax(layer.router.weight @ x_token, 0)
        top = sorted(range(Er), key=lambda e: -p[e].item())[:k]
        total = sum(p[e] for e in top)
        for e in top:
            routed[e] = p[e] / total * k
    if hs and Er:
        a_s, a_r = 2 * torch.softmax(layer.mix.weight @ x_token, 0)
        shared, routed = [w * a_s for w in shared], [w * a_r for w in routed]
    return torch.stack(shared + routed)


def _softmax_weights(layer, x):
    """The layer's head weights, chosen heads and routed probabilities for x, its routers run on their own."""
    return layer.softmax_weights(x, *project(x, layer.mix, layer.shared_router, layer.router))


@pytest.mark.parametrize(("shared", "k", "H"), [(2, 2, 6), (1, 3, 6), (0, 2, 4), (3, 0, 3), (2, 4, 6)])
def test_weights_follow_the_definition_and_the_routing_invariants(shared, k, H):
    cfg = _cfg(shared=shared, k=k, H=H)
    layer, x, _, _ = _layer_and_inputs(cfg)
    weights, chosen, _ = _softmax_weights(layer, x)  # [B, t, H], [B, t, k]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected = _naive_weights(layer, cfg, x[b, t]).detach()
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
def test_rope_output_and_gradients_equal_a_per_head_loop_weighted_by_token(causal, shared, k):
    """The softmax routers' output, and the gradients of a random probe of it w.r.t. x, mem and every weight (the
    router, shared_router and mix among them), equal a per-head loop's with the weights by their definitions: a
    router whose chosen weights lost or scaled their gradient would still give the same output."""
    cfg = _cfg(shared=shared, k=k, causal=causal)
    layer, x, mem, window = _layer_and_inputs(cfg)
    x.requires_grad_()
    if mem is not None:
        mem.requires_grad_()
    B, t, _ = x.shape
    xs = x if mem is None else torch.cat([mem, x], 1)
    H, D = cfg.n_heads, cfg.d_head
    q, kk, v = (
        (inp @ p.weight.T).view(B, -1, H, D) for inp, p in ((x, layer.q), (xs, layer.k), (xs, layer.v))
    )
    w = torch.stack([torch.stack([_naive_weights(layer, cfg, x[b, i]) for i in range(t)]) for b in range(B)])
    heads = []
    for h in range(H):
        qh = rotate(q[:, :, h][:, None], window.q_pos)[:, 0]
        kh = rotate(kk[:, :, h][:, None], window.k_pos)[:, 0]
        logits = qh @ kh.transpose(-1, -2) / math.sqrt(D)
        if window.mask is not None:
            logits = logits.masked_fill(~window.mask, float("-inf"))
        heads.append((logits.softmax(-1) @ v[:, :, h]) * w[..., h, None])
    expected = torch.cat(heads, -1) @ layer.o.weight.T
    actual = layer(x, mem, window)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    leaves = {"x": x, **({} if mem is None else {"mem": mem}), **dict(layer.named_parameters())}
    # the routers this split has, all among the leaves: W_r, W_0 with shared heads, W_s with more than one
    routers = ["router", "mix"][: 1 + bool(shared)] + ["shared_router"] * (shared > 1)
    assert {f"{r}.weight" for r in routers} <= set(leaves)
    grad = torch.randn(actual.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    mine = torch.autograd.grad(actual, list(leaves.values()), grad, allow_unused=True)
    theirs = torch.autograd.grad(expected, list(leaves.values()), grad, allow_unused=True)
    for name, a, e in zip(leaves, mine, theirs, strict=True):
        assert a is not None and e is not None, f"{name} does not reach the output"
        torch.testing.assert_close(
            a, e, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


def _naive_norm_weights(layer, cfg, x_token) -> list[float]:
    """One token's head weights as MoH-LLaMA3 computes them: the routed heads' query norms over their standard
    deviation (unbiased), a softmax, its top k weigh one, as every shared head; the others zero."""
    hs, H, D, k = cfg.opts.shared_heads, cfg.n_heads, cfg.d_head, cfg.opts.routed_k
    q = (layer.q.weight @ x_token).tolist()
    norms = [math.sqrt(sum(c * c for c in q[h * D : (h + 1) * D])) for h in range(hs, H)]
    if len(norms) > 1:  # one routed head: its std is undefined, and it is always chosen
        mean = sum(norms) / len(norms)
        std = math.sqrt(sum((n - mean) ** 2 for n in norms) / (len(norms) - 1))
        exps = [math.exp(n / std) for n in norms]
        norms = [e / sum(exps) for e in exps]
    top = sorted(range(len(norms)), key=lambda e: -norms[e])[:k]
    return [1.0] * hs + [1.0 if e in top else 0.0 for e in range(H - hs)]


@pytest.mark.parametrize(("shared", "k", "H"), [(3, 1, 6), (2, 3, 6), (0, 2, 4), (3, 0, 3), (2, 1, 3)])
def test_norm_weights_are_the_published_top_k_of_normalised_query_norms(shared, k, H):
    cfg = _cfg(shared=shared, k=k, H=H, router="norm")
    layer, x, _, _ = _layer_and_inputs(cfg)
    assert not any(n.startswith(("router", "shared_router", "mix")) for n, _ in layer.named_parameters())
    q = layer.q(x).view(*x.shape[:2], H, cfg.d_head).transpose(1, 2)
    weights, chosen, probs = layer.norm_weights(q)
    assert probs is None
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected = torch.tensor(_naive_norm_weights(layer, cfg, x[b, t]), dtype=torch.float64)
            assert torch.equal(weights[b, t], expected), (b, t)
    assert ((weights[..., shared:] == 1).sum(-1) == k).all()
    if chosen is not None:
        assert torch.equal(weights.gather(-1, chosen), torch.ones_like(chosen, dtype=weights.dtype))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("shared", "k"), [(3, 1), (0, 2), (2, 3)])
def test_norm_routed_output_and_gradients_equal_a_per_token_per_head_loop(causal, shared, k):
    cfg = _cfg(shared=shared, k=k, causal=causal, router="norm")
    layer, x, mem, window = _layer_and_inputs(cfg)
    x.requires_grad_()
    B, t, _ = x.shape
    H, D = cfg.n_heads, cfg.d_head
    xs = x if mem is None else torch.cat([mem, x], 1)
    q, kk, v = (
        (inp @ p.weight.T).view(B, -1, H, D) for inp, p in ((x, layer.q), (xs, layer.k), (xs, layer.v))
    )
    q = torch.stack([rotate(q[:, :, h][:, None], window.q_pos)[:, 0] for h in range(H)], 2)  # [B, t, H, D]
    kk = torch.stack([rotate(kk[:, :, h][:, None], window.k_pos)[:, 0] for h in range(H)], 2)
    rows = []
    for b in range(B):
        for i in range(t):
            weights = _naive_norm_weights(layer, cfg, x[b, i].detach())
            heads = []
            for h in range(H):
                seen = [j for j in range(kk.shape[1]) if window.mask is None or window.mask[i, j]]
                logits = torch.stack([q[b, i, h] @ kk[b, j, h] / math.sqrt(D) for j in seen])
                mixed = sum(p * v[b, j, h] for p, j in zip(logits.softmax(0), seen, strict=True))
                heads.append(weights[h] * mixed)
            rows.append(layer.o.weight @ torch.cat(heads))
    expected = torch.stack(rows).view(B, t, -1)
    actual = layer(x, mem, window)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(actual)
    leaves = [x, layer.q.weight, layer.k.weight, layer.v.weight, layer.o.weight]
    mine, theirs = torch.autograd.grad(actual, leaves, grad), torch.autograd.grad(expected, leaves, grad)
    for name, a, e in zip(("x", "W_q", "W_k", "W_v", "W_o"), mine, theirs, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_the_norm_router_with_every_head_on_is_the_dense_layer(pos):
    """h_s + k = H: every weight is one, and the norm router adds no weights: the dense layer, state and all."""
    cfg = _cfg(pos=pos, shared=2, k=3, H=5, router="norm")
    moh, x, mem, window = _layer_and_inputs(cfg)
    dense_cfg = cfg.replace(model="transformer", options=())
    dense = dense_cfg.family.attention(dense_cfg).double()
    dense.load_state_dict(moh.state_dict())
    torch.testing.assert_close(moh(x, mem, window)[0], dense(x, mem, window)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_a_norm_routed_lm_decodes_token_by_token_as_in_one_call_and_is_causal(pos):
    cfg = _cfg(pos=pos, shared=2, k=2, H=6, router="norm").replace(vocab=13, context_blocks=1)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).double().eval()
    tokens = torch.randint(0, cfg.vocab, (2, 2 * cfg.T + 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = lm(tokens).logits
        state, steps = None, []
        for i in range(tokens.shape[1]):
            out = lm(tokens[:, i : i + 1], state)
            steps.append(out.logits)
            state = out.state
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab
        before_last = lm(changed).logits[:, :-1]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(before_last, whole[:, :-1], rtol=0, atol=0)


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
    weights, chosen, probs = _softmax_weights(layer, x)
    expected = 0.5 / cfg.n_layers * balance_loss(probs.flatten(0, 1), (chosen - 2).flatten(0, 1))  # its share
    torch.testing.assert_close(aux, expected)
    layer.eval()
    assert layer(x, mem, window)[1] == 0.0
    with observe(layer) as records:
        layer(x, mem, window)
    record = records[""]
    # the routed heads (after the 2 shared), numbered as the router numbers them
    assert torch.equal(record["experts"], chosen - 2) and torch.equal(record["head_weights"], weights)
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
        _, chosen, probs = _softmax_weights(block.attn, inputs[i])
        losses.append(balance_loss(probs.flatten(0, 1), (chosen - 2).flatten(0, 1)))
    assert len(losses) == 3 and min(losses) > 0
    torch.testing.assert_close(aux, 0.01 * sum(losses) / 3, rtol=1e-12, atol=0)


@st.composite
def configs(draw):
    causal = draw(st.booleans())
    H = draw(st.integers(1, 5))
    shared = draw(st.integers(0, H))
    k = draw(st.integers(1, H - shared)) if shared < H else 0
    router = draw(st.sampled_from(["softmax", "norm"]))
    coef = 0.0 if router == "norm" else draw(st.sampled_from([0.0, 0.01]))
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
        options={"shared_heads": shared, "routed_k": k, "balance_coef": coef, "moh_router": router},
    )


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_exact_count_equals_the_three_counters(cfg):
    assert_counted_exactly(cfg)


@pytest.mark.parametrize("router", ["softmax", "norm"])
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_exact_count_of_one_configuration_equals_the_counters_and_a_hand_count(pos, router):
    cfg = _cfg(pos=pos, context_blocks=1 if pos == "xl" else 0, router=router)
    exact = exact_cost(cfg)
    assert (measure.flop_counter_macs(cfg), measure.saved_floats(cfg)) == (exact.macs, exact.mem)
    # MACs by hand: the dense layer's, plus the routers (4 routed, 2 shared, the two-way mix, d_model each) or
    # the norms of the 4 routed heads' queries (d_head each), over T tokens
    dense = exact_cost(cfg.replace(model="transformer", options=()))
    extra = cfg.d_model * (4 + 2 + 2) if router == "softmax" else 4 * cfg.d_head
    assert exact.macs - dense.macs == cfg.T * extra


def test_presets_match_their_dense_rows_in_weights_per_layer():
    found = [name for name, cfg in PRESETS.items() if cfg.model == "moh"]
    assert {"c4-47m-moh-h10", "c4-262m-moh-h16", "listops-moh-h8", "bytes-920k-moh-h4"} <= set(found)
    for name in found:
        cfg = PRESETS[name]
        dense = PRESETS[name.replace("moh-norm", "transformer").replace("moh", "transformer")]
        mine = parameter_counts(cfg)["per_layer"]["attention_plus_mlp"]
        theirs = parameter_counts(dense)["per_layer"]["attention_plus_mlp"]
        if cfg.opts.moh_router == "norm":  # no router weights: the dense MLP, equal exactly
            assert (mine, cfg.d_ff) == (theirs, dense.d_ff), name
        else:
            assert abs(mine - theirs) < cfg.d_model, name
        active = (cfg.opts.shared_heads + cfg.opts.routed_k) / cfg.n_heads
        assert 0.5 <= active <= 0.75, name  # the published settings' range


@pytest.mark.parametrize(
    ("dense", "shared", "k"),
    [
        ("c4-47m-transformer-h10", 5, 2),
        ("c4-262m-transformer-h16", 8, 4),
        ("listops-transformer-h8", 4, 2),
        ("bytes-920k-transformer-h4", 2, 1),
    ],
)
def test_norm_presets_split_the_heads_as_moh_llama3(dense, shared, k):
    """Its code: int(0.5 H) shared heads, and int(0.25 H) chosen out of the other half; no balance loss."""
    cfg = PRESETS[dense.replace("transformer", "moh-norm")]
    options = (cfg.opts.moh_router, cfg.opts.balance_coef, cfg.opts.shared_heads, cfg.opts.routed_k)
    assert options == ("norm", 0.0, shared, k)
    assert cfg.replace(model="transformer", options=()) == PRESETS[dense]  # the dense row otherwise


@pytest.mark.parametrize(
    ("H", "options", "message"),
    [
        (4, {"shared_heads": 5}, "at most n_heads"),
        (4, {"shared_heads": 2, "routed_k": 3}, r"routed_k must be in \[1, 2\]"),
        (4, {"shared_heads": 2, "routed_k": 0}, r"routed_k must be in \[1, 2\]"),
        # every head shared: the only routed_k is 0 (it said "in [1, 0]")
        (4, {"shared_heads": 4, "routed_k": 1}, "routed_k must be 0: every head is shared, none is routed"),
        (4, {"balance_coef": -1.0}, "balance_coef"),
        (4, {"n_kv_heads": 2}, "n_kv_heads is no option of model moh"),
        (4, {"moh_router": "sigmoid"}, "moh_router must be one of softmax, norm"),
        (4, {"moh_router": "norm"}, "the norm router has no balance loss"),
    ],
)
def test_bad_options_are_value_errors_that_say_why(H, options, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(model="moh", n_heads=H, options=options)


@pytest.mark.slow
@needs("fvcore")
def test_the_norm_form_runs_through_every_command(tmp_path, capsys):
    """presets, params, count (its exact cost equal to the counters), speed, train, quality and analyze."""

    def run(command: str, *paths) -> str:
        assert main([*command.split(), *map(str, paths)]) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    assert "tiny-moh-norm" in {row["preset"] for row in json.loads(run("presets --json"))}
    mine, dense = (
        json.loads(run(f"params {name} --json"))["per_layer"]
        for name in ("tiny-moh-norm", "tiny-transformer")
    )
    assert mine["attention_plus_mlp"] == dense["attention_plus_mlp"]
    views = json.loads(run("count c4-47m-moh-norm-h10 --json"))
    assert views["macs_exact"] == views["macs_fvcore"] == views["macs_flop_counter"]
    assert views["mem_exact"] == views["mem_saved_floats"]
    speed = json.loads(
        run(
            "speed --presets tiny-transformer tiny-moh-norm --scopes layer --device cpu --batch 1 "
            "--rounds 2 --warmup 1 --json --out",
            tmp_path / "speed",
        )
    )
    assert {r["status"] for r in speed["rows"] if r["preset"] == "tiny-moh-norm"} == {"ok"}
    run(
        "train --task listops --preset listops-moh-norm-h8 --steps 2 --eval-every 2 --batch 4 --device cpu --out",
        tmp_path / "listops-moh-norm-h8",
    )
    quality = json.loads(
        run(
            "quality --families dense --presets bytes-920k-moh-norm-h4 --seeds 2 --steps 1 "
            "--threads 1 --device cpu --json --out",
            tmp_path / "quality",
        )
    )
    rows = [(r["family"], r["preset"]) for r in quality["summary"]]
    assert rows == [("dense", "bytes-920k-transformer-h4"), ("moh", "bytes-920k-moh-norm-h4")]
    run("analyze --out", tmp_path / "analysis", tmp_path / "listops-moh-norm-h8" / "checkpoint.pt")
    assert "listops-moh-norm-h8" in (tmp_path / "analysis" / "explorer.html").read_text()
    usage = (tmp_path / "analysis" / "usage.csv").read_text().splitlines()
    assert len(usage) > 1 and all(line.startswith("listops-moh-norm-h8,") for line in usage[1:])
    # per router, one count for each routed head: the shared ones are no experts left unused
    cfg = PRESETS["listops-moh-norm-h8"]
    routers = pd.read_csv(tmp_path / "analysis" / "usage.csv").groupby(["layer", "head", "side"])["expert"]
    assert set(routers.nunique()) == {cfg.n_heads - cfg.opts.shared_heads}
