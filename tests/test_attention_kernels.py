"""The attention kernels compute one function: each backend against a naive loop in float64 (outputs and the
gradients of q, k, v and the position scores), the position bias's Triton kernels against its views, and every
family's model under each backend against the explicit one (logits and every parameter's gradient, XL with memory
and RoPE, decoding too). The Triton kernels' backward runs in Triton's interpreter without a GPU; FlexAttention has
no backward on the CPU: its gradients are checked where CUDA is."""

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from small import SEQ, TIGHT, T, checked_dtype, make_lm, random_tokens, small_cfg, within

from switchbench.models import family as registry
from switchbench.models.lm import SequenceClassifier
from switchbench.ops.attention import choice, kernels
from switchbench.ops.attention.kernels import attention
from switchbench.ops.attention.relative import RelativeBias

FAMILIES = registry.names()
CUDA = torch.cuda.is_available()
# Backends whose backward runs here (Triton's in its interpreter on the CPU)
TRAINABLE = ("explicit", "sdpa", "triton", "flex") if CUDA else ("explicit", "sdpa", "triton")
DEVICE = "cuda" if CUDA else "cpu"
# On the CPU Triton's interpreter and eager FlexAttention take seconds a model: the fast loop runs them on
# SwitchHead (whose attention is dense's kernel on other projections), every family in the full suite (explicit
# and SDPA run every family in both)
INTERPRETED, FAST_FAMILY = ("flex", "triton"), "switchhead"


def slow_unless(fast: bool):
    return () if fast else pytest.mark.slow


def by_cost(families, backends, settings=((),), fast_settings=((),)) -> list:
    """(family, backend, *setting) parameters: those of an interpreted backend slow on another family than
    SwitchHead or at a setting not in ``fast_settings``."""
    return [
        pytest.param(
            f, b, *s, marks=slow_unless(b not in INTERPRETED or (f == FAST_FAMILY and s in fast_settings))
        )
        for f in families
        for b in backends
        for s in settings
    ]


def naive(q, k, v, mask, scores, scale):
    """One query, one head at a time: softmax over the keys it may read, weights times values. The position term
    of query i and key j is the score of their distance i + S - t - j, in column S - 1 - distance of ``scores``."""
    B, H, t, _ = q.shape
    S = k.shape[2]
    group = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(t):
                logits = k[b, h // group] @ q[b, h, i] * scale
                if scores is not None:  # past the last distance (a future key): zero
                    row = torch.cat([scores[b, h, i], scores.new_zeros(S)])
                    logits = logits + row[[S - 1 - (i + S - t - j) for j in range(S)]]
                if mask is not None:
                    logits = logits.masked_fill(~mask[i], -math.inf)
                out[b, h, i] = logits.softmax(-1) @ v[b, h // group]
    return out


KEYS = 9


def inputs(H, Hk, d_head, biased, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, t, S = 2, 5, KEYS

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()

    q, k, v = draw(B, H, t, d_head), draw(B, Hk, S, d_head), draw(B, Hk, S, d_head)
    scores = draw(B, H, t, S if masked else S + t - 1) if biased else None  # by distance: causal has none < 0
    k_pos, q_pos = torch.arange(S), torch.arange(S - t, S)
    # causal over a window with memory, and a chunk boundary: query i reads keys j <= i from chunk 1 back at most
    mask = (
        ((k_pos <= q_pos[:, None]) & (k_pos // 4 >= q_pos[:, None] // 4 - 1)).to(DEVICE) if masked else None
    )
    return q, k, v, mask, scores


def relative(scores):
    return None if scores is None else RelativeBias(scores, KEYS)


def kernel_cases() -> list:
    """(backend, H, Hk, d_head, biased, masked): every backend over the whole grid, an interpreted one in the fast
    loop at grouped key heads, a width SDPA pads (5 channels to 8), a position term and a mask only."""
    grid = itertools.product(
        choice.BACKENDS, [(4, 4), (4, 2), (4, 1)], [8, 5], [(True, True), (False, True), (True, False)]
    )
    return [
        pytest.param(
            b,
            H,
            Hk,
            d,
            biased,
            masked,
            marks=slow_unless(b not in INTERPRETED or (Hk, d, biased, masked) == (2, 5, True, True)),
        )
        for b, (H, Hk), d, (biased, masked) in grid
    ]


@pytest.mark.parametrize(("backend", "H", "Hk", "d_head", "biased", "masked"), kernel_cases())
def test_each_backend_is_the_naive_loop_float64(backend, H, Hk, d_head, biased, masked):
    q, k, v, mask, scores = inputs(H, Hk, d_head, biased, masked)
    leaves = [x for x in (q, k, v, scores) if x is not None]
    scale, tolerance = 0.7, within(backend, DEVICE)
    reference = naive(q, k, v, mask, scores, scale)
    # the same values in the dtype the backend is checked in
    ran = [x.detach().to(checked_dtype(backend, DEVICE)).requires_grad_() for x in leaves]
    q, k, v, scores = (*ran, None)[:4]
    with choice.selected(backend):
        if backend in TRAINABLE:
            out, maps = attention(q, k, v, mask, relative(scores), scale)
        else:  # forward only: torch refuses FlexAttention on inputs that require grad off CUDA
            with torch.no_grad():
                q, k, v, scores = (x if x is None else x.detach() for x in (q, k, v, scores))
                out, maps = attention(q, k, v, mask, relative(scores), scale)
    assert maps is None
    torch.testing.assert_close(out.double(), reference, **tolerance)
    if backend not in TRAINABLE:
        return
    cotangent = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, leaves, cotangent)
    got = torch.autograd.grad(out, ran, cotangent.to(out.dtype))
    for name, g, e in zip(("q", "k", "v", "scores"), got, expected, strict=False):
        torch.testing.assert_close(g.double(), e, **tolerance, msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: on the CPU both take float64")
@pytest.mark.parametrize("backend", list(choice.NO_FLOAT64_ON_CUDA))
def test_a_triton_backend_refuses_float64_on_a_gpu_in_one_line(backend):
    """Triton 3.6 compiles no float64 product for sm_90, in the flash kernel or Inductor's FlexAttention kernel: a
    clear refusal, not a compiler's stack of passes."""
    q, k, v, mask, scores = inputs(4, 2, 8, True, True)
    with choice.selected(backend), pytest.raises(ValueError, match=f"--attention {backend} takes no float64"):
        attention(q, k, v, mask, relative(scores), 0.7)


@pytest.mark.parametrize("Hk", [2, 1])
def test_sdpa_repeats_grouped_heads_in_training_and_not_in_decoding(Hk, monkeypatch):
    """On CUDA, a masked call that will be differentiated gets as many key heads as query heads (SDPA's grouped
    backward was slow on an H200, and its fallback fp32); the attention and every gradient are still the naive
    loop's in float64. Without a backward (decoding) the grouped heads go to SDPA as they are."""
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], v.shape[1], kwargs["enable_gqa"]))
        return sdpa_function(q, k, v, **kwargs)

    sdpa_function = kernels.F.scaled_dot_product_attention
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", spy)
    q, k, v, mask, scores = inputs(4, Hk, 5, True, True)
    if not CUDA:  # the rule is CUDA's (the CPU keeps grouped heads): the CPU's tensors stand in for a GPU's
        assert not kernels._cuda_training(q, k, v, scores)
        monkeypatch.setattr(
            kernels,
            "_cuda_training",
            lambda *ts: torch.is_grad_enabled() and any(t.requires_grad for t in ts),
        )
    reference = naive(q, k, v, mask, scores, 0.7)
    with choice.selected("sdpa"):
        out, _ = attention(q, k, v, mask, relative(scores), 0.7)
        with torch.no_grad():
            attention(q, k, v, mask, relative(scores), 0.7)
    assert calls == [(4, 4, 4, False), (4, Hk, Hk, True)]
    torch.testing.assert_close(out, reference, **TIGHT)
    cotangent = torch.randn_like(reference)
    for g, e in zip(
        torch.autograd.grad(out, (q, k, v, scores), cotangent),
        torch.autograd.grad(reference, (q, k, v, scores), cotangent),
        strict=True,
    ):
        torch.testing.assert_close(g, e, **TIGHT)


@pytest.mark.parametrize("backend", choice.BACKENDS)
def test_maps_come_from_the_explicit_kernel_whatever_is_chosen(backend):
    q, k, v, mask, scores = (x if x is None else x.detach() for x in inputs(4, 2, 8, True, True))
    with choice.selected(backend), choice.recording() as resolved:
        out, maps = attention(q, k, v, mask, relative(scores), return_maps=True)
    assert set(resolved.values()) == {"explicit"}
    torch.testing.assert_close(out, naive(q, k, v, mask, scores, 1 / math.sqrt(8)), **TIGHT)
    torch.testing.assert_close(maps.sum(-1), torch.ones_like(maps[..., 0]), **TIGHT)
    assert not maps.masked_select(~mask).any()


def test_auto_is_fused_on_cuda_and_keeps_xl_explicit_on_the_cpu():
    """auto's rule, call by call: the maps need the explicit kernel; otherwise SDPA, except XL's biased logits on
    the CPU (the path the exact memory counts and the CPU gate's baseline describe)."""
    assert choice.lookup("cpu", biased=True, maps=False, named="auto") == "explicit"
    assert choice.lookup("cpu", biased=False, maps=False, named="auto") == "sdpa"
    assert choice.lookup("cuda", biased=True, maps=False, named="auto") == "sdpa"
    assert choice.lookup("cuda", biased=False, maps=True, named="auto") == "explicit"
    assert choice.lookup("cpu", biased=True, maps=False, named="flex") == "flex"


def test_the_environment_chooses_and_a_bad_name_is_refused(monkeypatch):
    monkeypatch.setenv(choice.ENV, "sdpa")
    assert choice.choice() == "sdpa"
    with choice.selected("explicit"):
        assert choice.choice() == "explicit"
    monkeypatch.setenv(choice.ENV, "fused")
    with pytest.raises(ValueError, match="SWITCHBENCH_ATTENTION: the attention kernel must be one of"):
        choice.choice()


def parameter_gradients(lm, tokens) -> dict[str, torch.Tensor]:
    lm.zero_grad(set_to_none=True)
    lm(tokens).loss(tokens).backward()
    return {name: p.grad for name, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model", "backend", "pos", "context_blocks"),
    by_cost(  # an interpreted backend's fast case: XL over two chunks of memory
        FAMILIES,
        [b for b in choice.BACKENDS if b != "explicit"],
        [("xl", 1), ("xl", 2), ("rope", 0), ("rope", 1)],
        [("xl", 2)],
    ),
)
def test_every_family_under_each_backend_is_the_explicit_model(model, backend, pos, context_blocks):
    """Logits of a sequence fed in two pieces (the second attends to the first's memory) and, where the backend
    trains here, every parameter's gradient: equal to the explicit kernel's in float64."""
    cfg = small_cfg(model, pos, context_blocks=context_blocks)
    lm = make_lm(cfg).to(DEVICE).train()  # dropout is 0: train mode only lets the routers' training paths run
    tokens = random_tokens(cfg, SEQ).to(DEVICE)
    tolerance = within(backend, DEVICE)

    def pieces():
        first = lm(tokens[:, :T])
        return torch.cat([first.logits, lm(tokens[:, T:], first.state).logits], dim=1)

    with choice.selected("explicit"):
        expected_logits = pieces().detach()
        # copies: converting the model to another dtype converts its gradients in place
        expected = {name: g.clone() for name, g in parameter_gradients(lm, tokens).items()}
    lm.to(checked_dtype(backend, DEVICE))
    with choice.selected(backend), choice.recording() as resolved:
        if backend in TRAINABLE:
            logits = pieces()
            got = parameter_gradients(lm, tokens)
        else:
            with torch.no_grad():
                logits, got = pieces(), expected
    assert set(resolved.values()) == {backend}
    torch.testing.assert_close(logits.double(), expected_logits, **tolerance)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            got[name].double(), expected[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.slow  # interpreted kernels in a model; the kernels alone: tests/test_position_bias.py
@pytest.mark.parametrize("model", FAMILIES)
def test_every_xl_family_on_sdpa_with_the_triton_bias_is_the_explicit_model(model, monkeypatch):
    """The position bias's Triton kernels inside a model, as a GPU runs them (here under the interpreter): a
    sequence in two pieces over two chunks of memory, logits and every parameter's gradient equal to the explicit
    kernel's, and decoding token by token."""
    monkeypatch.setattr(RelativeBias, "masked", functools.partialmethod(RelativeBias.masked, impl="triton"))
    test_every_family_under_each_backend_is_the_explicit_model(model, "sdpa", "xl", 2)
    test_decoding_under_each_backend_is_the_explicit_forward(model, "sdpa", "xl")


@pytest.mark.parametrize(("model", "backend"), by_cost(FAMILIES, choice.BACKENDS))
def test_a_bidirectional_classifier_under_each_backend(model, backend):
    """No mask at all, and XL's negative distances: ListOps' configuration."""
    cfg = small_cfg(model, "xl", causal=False, context_blocks=0)
    torch.manual_seed(0)
    clf = SequenceClassifier(cfg, 3).double().to(DEVICE).eval()
    tokens = random_tokens(cfg, SEQ).to(DEVICE)
    with torch.no_grad():
        with choice.selected("explicit"):
            expected = clf(tokens)[0]
        with choice.selected(backend):
            got = clf.to(checked_dtype(backend, DEVICE))(tokens)[0]
    torch.testing.assert_close(got.double(), expected, **within(backend, DEVICE))


@pytest.mark.parametrize(  # Triton's fast case: XL's, whose term is sliced at each step (FlexAttention's: the full suite)
    ("model", "backend", "pos"),
    [
        pytest.param(*p.values, marks=pytest.mark.slow) if p.values[1:] == ("flex", "xl") else p
        for p in by_cost(FAMILIES, choice.BACKENDS, [("xl",), ("rope",)], [("xl",)])
    ],
)
def test_decoding_under_each_backend_is_the_explicit_forward(model, backend, pos):
    """Prefill, then token by token (XL's position table sliced at each step), equal to one explicit forward."""
    cfg = small_cfg(model, pos)
    lm = make_lm(cfg).to(DEVICE)
    tokens = random_tokens(cfg, SEQ).to(DEVICE)
    with torch.no_grad():
        with choice.selected("explicit"):
            expected = lm(tokens).logits
        with choice.selected(backend):
            lm.to(checked_dtype(backend, DEVICE))
            cache = lm.new_cache(tokens.shape[0], SEQ)
            steps = [lm.decode(tokens[:, :5], cache)] + [
                lm.decode(tokens[:, i : i + 1], cache) for i in range(5, SEQ)
            ]
    torch.testing.assert_close(torch.cat(steps, dim=1).double(), expected, **within(backend, DEVICE))


# --- the command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["speed", "profile", "decode", "train", "quality", "all"])
def test_every_command_that_runs_a_model_takes_the_flag(command, monkeypatch, capsys):
    from switchbench.cli import _parser

    monkeypatch.delenv(choice.ENV, raising=False)
    argv = [command, *(["tiny-switchhead"] if command == "profile" else [])]
    assert _parser().parse_args(argv).attention == "auto"
    assert _parser().parse_args([*argv, "--attention", "sdpa"]).attention == "sdpa"
    monkeypatch.setenv(choice.ENV, "explicit")
    assert _parser().parse_args(argv).attention == "explicit"
    with pytest.raises(SystemExit):
        _parser().parse_args([*argv, "--attention", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("backend", "why"),
    [("flex", "needs a CUDA device"), ("triton", "needs a CUDA device, or TRITON_INTERPRET=1")],
)
def test_a_backend_the_cpu_cannot_run_is_refused_in_one_line(backend, why, tmp_path, capsys, monkeypatch):
    from switchbench.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's kernels run here only in its interpreter
    argv = [
        "speed",
        "--presets",
        "tiny-transformer",
        "tiny-switchhead",
        "--device",
        "cpu",
        "--attention",
        backend,
    ]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--attention {backend} {why}" in err
    assert not any(tmp_path.iterdir())  # refused before any work
    # chosen by the environment alone, the refusal names it (it named --attention, which was not given)
    monkeypatch.setenv("SWITCHBENCH_ATTENTION", backend)
    assert main([*argv[:-2], "--out", str(tmp_path)]) == 2
    assert f"SWITCHBENCH_ATTENTION={backend} {why}" in capsys.readouterr().err


def test_train_runs_on_the_chosen_kernel_and_records_it(tmp_path, capsys):
    import json

    from switchbench.cli import main

    argv = [
        "train",
        "--task",
        "lm",
        "--model",
        "switchhead",
        "--steps",
        "2",
        "--batch",
        "2",
        "--eval-every",
        "2",
    ]
    argv += ["--device", "cpu", "--attention", "sdpa", "--out", str(tmp_path / "run"), "--json"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["attention"] == "sdpa"
    assert printed["attention_resolved"] == {"cpu | position bias": "sdpa"}  # the default model is XL
    assert choice.resolutions() == {}  # out of force after the command


def test_compiled_flex_is_traced_once_for_every_layer_and_step(monkeypatch):
    """On CUDA FlexAttention runs compiled, and each layer hands it a new ``score_mod`` closure over its own
    position scores and a new block mask. Traced once per shape, not once per layer: a recompilation per layer
    would pass dynamo's cache limit and leave the step on eager FlexAttention, which materialises the scores. The
    same guards, with dynamo's eager backend on the CPU."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, dynamic=False, backend="eager")
    monkeypatch.setattr(kernels, "_flex_kernel", lambda cuda: compiled)
    lm = make_lm(small_cfg("transformer", "xl", n_layers=3))
    tokens = random_tokens(lm.cfg, SEQ)
    with torch.no_grad(), choice.selected("flex"):
        state = lm(tokens[:, :T]).state  # the first chunk: no memory yet
        for _ in range(3):
            lm(tokens[:, T:], state)
    # one graph without memory, one with: none per layer or per step
    assert counters["stats"]["unique_graphs"] == 2 and not counters["recompiles"]


@pytest.mark.slow  # twelve compilations: 10 s
def test_compiled_flex_is_compiled_for_every_shape_past_dynamos_default_limit():
    """A group's members, batch sizes and grad modes each compile FlexAttention once more; past dynamo's default
    of 8 compilations it would fall back to the eager path, which materialises the scores. Twelve shapes, twelve
    graphs and no fallback (dynamo's eager backend on the CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=8), torch.no_grad():  # dynamo's default, restored after
        compiled = kernels.compiled_flex(backend="eager")
        for t in range(1, 13):
            q = torch.randn(1, 2, 8 * t, 16)
            torch.testing.assert_close(compiled(q, q, q), F.scaled_dot_product_attention(q, q, q))
    assert counters["stats"]["unique_graphs"] == 12
