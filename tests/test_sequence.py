"""Sequence behaviour of the language models: causality, XL memory, incremental decoding with a cache,
initialisation, overfitting a fixed batch, and observation of attention maps and routing."""

import itertools
import math

import pytest

pytest.importorskip("hypothesis")  # a GPU node without it skips this module, naming it
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from small import SEQ, TIGHT, WINDOWS, T, make_lm, random_tokens, small_cfg

from switchbench.models import family as registry
from switchbench.models.families.moa import MoAAttention
from switchbench.models.families.switchhead import SwitchHeadAttention
from switchbench.models.layers.observe import Observable, observe
from switchbench.models.layers.sigma_moe import SigmaMoE
from switchbench.models.layers.window import make_window
from switchbench.models.lm import LanguageModel, SequenceClassifier, State
from switchbench.models.presets import PRESETS

FAMILIES = registry.names()  # every registered family, the paper's and the others
POSITIONS = ("xl", "rope")


def run_pieces(lm: LanguageModel, tokens: torch.Tensor, sizes) -> torch.Tensor:
    """Logits of ``tokens`` fed in consecutive pieces of ``sizes``, carrying the state between calls."""
    assert sum(sizes) == tokens.shape[1]
    state, logits, start = None, [], 0
    with torch.no_grad():
        for n in sizes:
            out = lm(tokens[:, start : start + n], state)
            logits.append(out.logits)
            state, start = out.state, start + n
    assert state.offset == tokens.shape[1]
    return torch.cat(logits, dim=1)


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, T: int, context_blocks: int) -> torch.Tensor:
    """Brute-force window rule: p sees q iff q <= p and q's chunk is at most context_blocks chunks back."""
    return torch.tensor(
        [[q <= p and q // T >= p // T - context_blocks for q in k_pos.tolist()] for p in q_pos.tolist()]
    )


# --- the window ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "mem_len", "t", "cb"), [(0, 0, 19, 1), (8, 8, 8, 1), (13, 13, 1, 1), (21, 5, 3, 0)]
)
def test_make_window_matches_the_rule(offset, mem_len, t, cb):
    """The mask is exactly the documented rule over absolute positions."""
    window = make_window(offset, mem_len, t, T, cb, True, "cpu")
    assert window.q_pos.tolist() == list(range(offset, offset + t))
    assert window.k_pos.tolist() == list(range(offset - mem_len, offset + t))
    assert torch.equal(window.mask, allowed(window.q_pos, window.k_pos, T, cb))


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
def test_a_models_outputs_do_not_drift_with_the_position_its_stream_reached(model, pos):
    """Attention sees positions only relative to each other (XL by distance, RoPE by rotation), so a stream's
    chunk gives the same logits whatever absolute position it starts at. In float32 RoPE's angles rounded with
    the position: the tiny dense model's logits moved 1e-3 at 2**18 and 1.2 at 2**24, a training stream's
    position after 16k steps of 1,024 tokens."""
    cfg = small_cfg(model, pos)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).eval()  # float32, as trained
    tokens = random_tokens(cfg, 2 * T)
    with torch.no_grad():
        start = lm(tokens).logits
        for offset in (2**18, 2**24, 2**30):  # chunk-aligned (T divides them): the same window
            later = lm(tokens, State((None,) * cfg.n_layers, offset)).logits
            torch.testing.assert_close(later, start, rtol=1e-4, atol=1e-4)


# --- 1. causality ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
def test_causal(model, pos):
    """Changing the token at position t changes no logit before t, and some logit from t on."""
    cfg = small_cfg(model, pos)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    with torch.no_grad():
        base = lm(tokens).logits
        for t in (0, T - 1, T + 2, SEQ - 1):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % cfg.vocab
            logits = lm(changed).logits
            # Not bit-exact: a changed routing changes the expert buffers' shapes, hence the rounding.
            torch.testing.assert_close(
                logits[:, :t], base[:, :t], **TIGHT, msg=f"position {t} leaks backwards"
            )
            assert not torch.allclose(logits[:, t:], base[:, t:]), f"position {t} changes nothing"


# --- 2. XL memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", FAMILIES)
def test_xl_memory_matches_explicit_reference(model):
    """Chunk 2 after chunk 1 equals running each layer by hand on chunk 1's captured layer inputs."""
    cfg = small_cfg(model, "xl", context_blocks=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, 2 * T)
    captured = {}

    def capture(i):
        return lambda module, args, output: captured.__setitem__(i, args[0].detach().clone())

    hooks = [b.attn.register_forward_hook(capture(i)) for i, b in enumerate(lm.stack.blocks)]
    with torch.no_grad():
        first = lm(tokens[:, :T])
        for hook in hooks:
            hook.remove()
        second = lm(tokens[:, T:], first.state)

        window = make_window(T, T, T, T, 1, True, tokens.device)
        x = lm.stack.embedding(tokens[:, T:])
        for i, block in enumerate(lm.stack.blocks):
            assert captured[i].shape == (2, T, cfg.d_model)
            y, _ = block.attn(block.ln_attn(x), captured[i], window)
            x = x + y
            y, _ = block.mlp(block.ln_mlp(x))
            x = x + y
        expected = lm.head(lm.stack.ln_out(x))
        alone = lm(tokens[:, T:]).logits

    torch.testing.assert_close(second.logits, expected, **TIGHT)
    assert not torch.allclose(second.logits, alone, atol=1e-6), "the memory has no effect"


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("context_blocks", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2 in the fast loop
def test_context_blocks_reach(model, pos, context_blocks):
    """One layer: chunk 3 depends on chunk 1 exactly when two chunks of context are kept."""
    cfg = small_cfg(model, pos, n_layers=1, context_blocks=context_blocks)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, 3 * T)
    changed = tokens.clone()
    changed[:, : T // 2] = (changed[:, : T // 2] + 1) % cfg.vocab
    for sizes in ([3 * T], [T, T, T], [1] * (3 * T)):
        base, other = run_pieces(lm, tokens, sizes), run_pieces(lm, changed, sizes)
        if context_blocks == 2:
            assert not torch.allclose(base[:, 2 * T :], other[:, 2 * T :]), f"chunk 1 not seen ({sizes})"
        else:
            torch.testing.assert_close(base[:, 2 * T :], other[:, 2 * T :], **TIGHT)


@pytest.mark.parametrize("context_blocks", [1, 2])
def test_layer0_maps_cover_the_context(context_blocks):
    """With memory, layer 0's maps of chunk 3 span context_blocks past chunks, each with some weight."""
    cfg = small_cfg("transformer", "xl", context_blocks=context_blocks)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, 3 * T)
    with torch.no_grad():
        state = lm(tokens[:, : 2 * T]).state
        with observe(lm) as records:
            lm(tokens[:, 2 * T :], state)
    maps = records["stack.blocks.0.attn"]["maps"]
    assert maps.shape == (2, cfg.n_heads, T, (context_blocks + 1) * T)
    for chunk in range(context_blocks + 1):
        assert (maps[..., chunk * T : (chunk + 1) * T].sum(-1) > 0).all()


# --- 3. length-1 inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
def test_length_one_inputs(model, pos):
    """A single token runs with and without state, and matches the same token inside a longer call."""
    cfg = small_cfg(model, pos, context_blocks=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, T + 2, batch=3)
    with torch.no_grad():
        full = lm(tokens).logits
        single = lm(tokens[:, :1])
        assert single.logits.shape == (3, 1, cfg.vocab)
        assert single.state.offset == 1
        torch.testing.assert_close(single.logits, full[:, :1], **TIGHT)
        state = lm(tokens[:, : T + 1]).state
        step = lm(tokens[:, T + 1 :], state)
    assert step.logits.shape == (3, 1, cfg.vocab)
    assert step.state.offset == T + 2
    assert all(m.shape[1] == T + 2 for m in step.state.mems)
    torch.testing.assert_close(step.logits, full[:, T + 1 :], **TIGHT)


# --- 4. incremental decoding -----------------------------------------------------------------------------

PIECES = {
    "one call": [SEQ],
    "token by token": [1] * SEQ,
    "uneven": [5, 1, T, 2, 3],
    "straddling": [T - 1, T + 1, 3],
}


@pytest.mark.parametrize(("pos", "context_blocks"), WINDOWS)
@pytest.mark.parametrize("model", FAMILIES)
def test_incremental_matches_chunks(model, pos, context_blocks):
    """Any split of the sequence, token by token included, gives the logits of chunks of T."""
    cfg = small_cfg(model, pos, context_blocks=context_blocks)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    reference = run_pieces(lm, tokens, [T, T, SEQ - 2 * T])
    for name, sizes in PIECES.items():
        torch.testing.assert_close(
            run_pieces(lm, tokens, sizes), reference, **TIGHT, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("pos", POSITIONS)
def test_cache_keeps_the_window(model, pos):
    """After each call every layer holds context_blocks chunks plus the unfinished one, and no more."""
    cfg = small_cfg(model, pos, context_blocks=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    state, end = None, 0
    with torch.no_grad():
        for n in PIECES["uneven"]:
            state, end = lm(tokens[:, end : end + n], state).state, end + n
            keep = min(end, T + end % T)
            assert state.offset == end
            assert all((m is None and keep == 0) or m.shape == (2, keep, cfg.d_model) for m in state.mems)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    model=st.sampled_from(FAMILIES),
    pos=st.sampled_from(POSITIONS),
    context_blocks=st.integers(0, 2),
    cuts=st.lists(st.integers(1, SEQ - 1), max_size=6, unique=True),
)
def test_incremental_any_split(model, pos, context_blocks, cuts):
    """Random splits of the sequence agree with one call over the whole sequence."""
    cfg = small_cfg(model, pos, context_blocks=context_blocks)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    bounds = [0, *sorted(cuts), SEQ]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    torch.testing.assert_close(run_pieces(lm, tokens, sizes), run_pieces(lm, tokens, [SEQ]), **TIGHT)


# --- 7. learning -----------------------------------------------------------------------------------------

LM_PRESETS = (
    "tiny-transformer",
    "tiny-switchhead",
    "tiny-moa",
    "tiny-switchall",
    "tiny-transformer-rope",
    "tiny-switchhead-rope",
)


def test_the_loss_is_the_cross_entropy_plus_every_router_s_auxiliary_loss():
    """What training minimises: the cross-entropy plus each block's auxiliary losses, its attention's and its MLP's
    (SwitchAll: SwitchHead's entropy regulariser and the sigma-MoE's), each captured from its module's own output
    and summed here; the cross-entropy from the log-softmax by hand, in float64."""
    cfg = PRESETS["tiny-switchall"].replace(vocab=64, dropout=0.0, entropy_reg=0.3, mlp_entropy_reg=0.2)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).double()
    captured = []
    for block in lm.stack.blocks:
        for module in (block.attn, block.mlp):
            module.register_forward_hook(lambda module, args, out: captured.append(out[1]))
    data = torch.randint(cfg.vocab, (2, cfg.T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = data[:, :-1], data[:, 1:]
    out = lm(inputs)
    assert len(captured) == 2 * cfg.n_layers and all(aux.item() != 0 for aux in captured)
    aux = sum(captured)
    torch.testing.assert_close(out.aux_loss, aux, rtol=1e-12, atol=0)
    cross_entropy = -out.logits.log_softmax(-1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(out.loss(targets), cross_entropy + aux, rtol=1e-12, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("preset", LM_PRESETS)
def test_tiny_lm_overfits_a_batch(preset):
    """Each tiny preset memorises a fixed 4 x 32 batch of random tokens."""
    cfg = PRESETS[preset].replace(vocab=64, dropout=0.0)
    torch.manual_seed(0)
    lm = LanguageModel(cfg)
    data = torch.randint(cfg.vocab, (4, cfg.T + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.Adam(lm.parameters(), lr=3e-3)
    losses = []
    for step in range(80):
        loss = lm(inputs).loss(targets)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            # Routers learn only through their gates: a detached gate would leave them without gradient.
            for name, p in lm.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
                assert p.grad.abs().sum() > 0, f"{name} gets no gradient"
        optimizer.step()
        losses.append(loss.item())
    lm.eval()
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(lm(inputs).logits.flatten(0, 1), targets.flatten()).item()
    assert losses[0] > 0.8 * math.log(cfg.vocab)
    assert final < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {final:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "pos"), [(m, "xl") for m in FAMILIES] + [("switchhead", "rope")])
def test_sequence_classifier_learns_a_batch(model, pos):
    """The bidirectional classifier fits random labels of a fixed small batch."""
    cfg = small_cfg(model, pos, causal=False, context_blocks=0, T=16)
    torch.manual_seed(0)
    classifier = SequenceClassifier(cfg, n_classes=4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab, (8, 16), generator=generator)
    labels = torch.randint(4, (8,), generator=generator)
    optimizer = torch.optim.Adam(classifier.parameters(), lr=3e-3)
    for _ in range(60):
        logits, aux = classifier(tokens)
        loss = torch.nn.functional.cross_entropy(logits, labels) + aux
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    classifier.eval()
    with torch.no_grad():
        logits, _ = classifier(tokens)
    assert logits.shape == (8, 4)
    assert (logits.argmax(-1) == labels).all()


def test_sequence_classifier_is_bidirectional():
    """Without the causal mask, the pooled output depends on the last token, and each position sees it."""
    cfg = small_cfg("switchhead", "xl", causal=False, context_blocks=0)
    torch.manual_seed(0)
    classifier = SequenceClassifier(cfg, n_classes=3).double().eval()
    tokens = random_tokens(cfg, 12)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab
    with torch.no_grad():
        h, _, _ = classifier.stack(tokens)
        h2, _, _ = classifier.stack(changed)
    assert not torch.isclose(h[:, 0], h2[:, 0]).all(), "the first position does not see the last"


# --- 8. observation --------------------------------------------------------------------------------------


def observables(lm) -> dict:
    return {name: m for name, m in lm.named_modules() if isinstance(m, Observable)}


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
def test_observe_records_post_softmax_maps_and_routing(model, pos):
    """Maps are distributions over the allowed keys; routing has the documented shapes and ranges."""
    cfg = small_cfg(model, pos, context_blocks=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    B, H = tokens.shape[0], cfg.n_heads
    with torch.no_grad():
        state = lm(tokens[:, :T]).state
        for offset, t, state_in in ((0, SEQ, None), (T, SEQ - T, state)):
            mem = 0 if state_in is None else T
            with observe(lm) as records:
                lm(tokens[:, offset : offset + t], state_in)
            assert set(records) == set(observables(lm))
            q_pos, k_pos = torch.arange(offset, offset + t), torch.arange(offset - mem, offset + t)
            mask = allowed(q_pos, k_pos, T, cfg.context_blocks)
            for name, module in observables(lm).items():
                record = records[name]
                if isinstance(module, SigmaMoE):
                    check_selection(record["experts"], record["gates"], (B, t, cfg.mlp_k), cfg.mlp_experts)
                    continue
                maps = record["maps"]
                assert maps.shape == (B, H, t, mem + t), name
                assert (maps >= 0).all()
                torch.testing.assert_close(maps.sum(-1), torch.ones(B, H, t, dtype=maps.dtype))
                assert (maps[..., ~mask] == 0).all(), f"{name}: weight outside the window"
                assert (maps[..., mask] > 0).all()
                if isinstance(module, SwitchHeadAttention):
                    check_selection(
                        record["src_experts"], record["src_gates"], (B, mem + t, H, cfg.k), cfg.n_experts
                    )
                    check_selection(
                        record["dst_experts"], record["dst_gates"], (B, t, H, cfg.k), cfg.n_experts
                    )
                if isinstance(module, MoAAttention):
                    check_selection(record["experts"], record["gates"], (B, t, H), cfg.n_experts)


def check_selection(experts: torch.Tensor, gates: torch.Tensor, shape: tuple, n_experts: int) -> None:
    assert experts.shape == shape and gates.shape == shape
    assert ((experts >= 0) & (experts < n_experts)).all()
    assert ((gates >= 0) & (gates <= 1)).all()
    # The k choices of one router are distinct experts.
    assert (experts.sort(-1).values.diff(dim=-1) > 0).all()


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("model", FAMILIES)
def test_observe_changes_nothing_and_stops(model, pos):
    """Outputs are the same with and without observing; after the block nothing is recorded."""
    cfg = small_cfg(model, pos)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, SEQ)
    assert all(m.observation is None for m in observables(lm).values())
    with torch.no_grad():
        plain = lm(tokens)
        with observe(lm) as records:
            observed = lm(tokens)
        kept = {name: dict(record) for name, record in records.items()}
        assert all(m.observation is None for m in observables(lm).values())
        after = lm(tokens[:, :5])
    torch.testing.assert_close(observed.logits, plain.logits, **TIGHT)
    torch.testing.assert_close(after.logits, plain.logits[:, :5], **TIGHT)
    assert all(kept[name].keys() == records[name].keys() for name in records)
    for name, record in records.items():
        assert record, f"{name} recorded nothing inside the block"
        # A later forward outside the block must not overwrite what was recorded inside it.
        assert all(record[key] is kept[name][key] for key in record), name


# --- 9. the authors' training set-up ---------------------------------------------------------------------


@pytest.mark.parametrize("model", FAMILIES)
def test_memory_is_cached_before_the_layernorm(model):
    """The cache holds each layer's input before its LayerNorm, and the current LayerNorm normalises it: its gain
    and bias get gradients through the memory positions too."""
    cfg = small_cfg(model, "xl", n_layers=1)
    lm = make_lm(cfg)
    tokens = random_tokens(cfg, 2 * T)
    with torch.no_grad():
        state = lm(tokens[:, :T]).state
    mem = state.mems[0]
    assert torch.equal(mem, lm.stack.embedding(tokens[:, :T])), "the cache is not the block's input"
    block, window = lm.stack.blocks[0], make_window(T, T, T, T, 1, True, "cpu")
    ln = block.ln_attn
    probe = torch.randn(2, T, cfg.vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss_given(normalised_memory):
        x = lm.stack.embedding(tokens[:, T:])
        x = x + block.attn(ln(x), normalised_memory, window)[0]
        x = x + block.mlp(block.ln_mlp(x))[0]
        return (lm.head(lm.stack.ln_out(x)) * probe).sum()

    grads = torch.autograd.grad((lm(tokens[:, T:], state).logits * probe).sum(), [ln.weight, ln.bias])
    by_hand = torch.autograd.grad(loss_given(ln(mem)), [ln.weight, ln.bias])
    current_only = torch.autograd.grad(loss_given(ln(mem).detach()), [ln.weight, ln.bias])
    for g, g_hand, g_current in zip(grads, by_hand, current_only, strict=True):
        torch.testing.assert_close(g, g_hand, **TIGHT)
        assert (g - g_current).abs().max() > 1e-3 * g.abs().max(), "no gradient through the memory positions"


@pytest.mark.parametrize("model", ["switchhead", "moa", "switchall"])
def test_router_logits_in_float32_under_autocast(model):
    """Under CPU bf16 autocast the layers compute in bf16 but every router's selection and gates in float32,
    and a training step's gradients come back in float32."""
    cfg = small_cfg(model, "xl")
    torch.manual_seed(0)
    lm = LanguageModel(cfg)
    tokens = random_tokens(cfg, SEQ)
    with torch.autocast("cpu", dtype=torch.bfloat16), observe(lm) as records:
        out = lm(tokens[:, :-1])
        loss = out.loss(tokens[:, 1:])
    loss.backward()
    assert out.logits.dtype == torch.bfloat16, "autocast was not on"
    gates = [value for record in records.values() for key, value in record.items() if key.endswith("gates")]
    assert len(gates) == {"switchhead": 4, "moa": 2, "switchall": 6}[model]
    for g in gates:
        assert g.dtype == torch.float32
        # sigmoids or softmaxes computed in float32 are not bf16 numbers
        assert (g != g.bfloat16().float()).any()
    assert all(p.grad.dtype == torch.float32 for p in lm.parameters())


@pytest.mark.parametrize("model", ["transformer", "switchall"])
def test_training_dropout_sites(model):
    """In training, dropout p also hits the MLP hidden layer (dense and sigma-MoE) and the input of the output
    layer: each element is zeroed or scaled by 1/(1 - p), about a fraction p zeroed; in evaluation none is."""
    p = 0.3
    cfg = small_cfg(model, "xl", dropout=p, d_ff=256, mlp_expert_size=64)
    torch.manual_seed(0)
    lm = LanguageModel(cfg).double()
    seen = {}

    def record(name):
        return lambda module, args, output: seen.__setitem__(name, (args[0], output))

    lm.stack.blocks[0].mlp.dropout.register_forward_hook(record("hidden"))
    lm.stack.ln_out.register_forward_hook(record("ln_out"))
    lm.head.register_forward_hook(record("head"))
    tokens = random_tokens(cfg, SEQ, batch=4)
    for training in (True, False):
        lm.train(training)
        with torch.no_grad():
            lm(tokens)
        hidden_in = seen["hidden"][0]
        width = cfg.d_ff if model == "transformer" else cfg.mlp_expert_size
        assert hidden_in.shape[-1] == width and (hidden_in >= 0).all(), "not the ReLU hidden layer"
        sites = {"hidden": seen["hidden"], "output layer": (seen["ln_out"][1], seen["head"][0])}
        for name, (before, after) in sites.items():
            live = before != 0
            dropped = (after[live] == 0).double().mean().item()
            if training:
                assert abs(dropped - p) < 0.05, f"{name}: {dropped:.3f} dropped"
                kept = after[live] != 0
                torch.testing.assert_close(after[live][kept], before[live][kept] / (1 - p), **TIGHT)
            else:
                assert torch.equal(after, before), name
