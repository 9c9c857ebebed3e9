"""Triton's flash attention with the position term read by distance (``--attention triton``), under
TRITON_INTERPRET=1 without a GPU: outputs and every gradient (q, k, v and the term by distance) against the
explicit kernel in float64, grouped heads, causal windows over memory, several blocks each way; and whole models."""

import pytest
import torch
from small import SEQ, TRITON_DEVICE, T, make_lm, random_tokens, small_cfg

from switchbench.ops.attention import choice, kernels

# the GPU's clock, imported before the suite's stand-in replaces it (conftest.py)
from switchbench.ops.attention.flash import _time as time_on_the_gpu
from switchbench.ops.attention.relative import RelativeBias

F64 = torch.float64


def _draw(seed: int, *shape, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(TRITON_DEVICE, dtype)


def _window(t: int, S: int, causal: bool) -> tuple[int, torch.Tensor | None]:
    """Columns of the term by distance, and the mask: causal over memory, each query reading one chunk back."""
    if not causal:
        return S + t - 1, None
    q_pos, k_pos = torch.arange(S - t, S)[:, None], torch.arange(S)
    return S, ((k_pos <= q_pos) & (k_pos // 16 >= q_pos // 16 - 1)).to(TRITON_DEVICE)


def _inputs(B, H, Hk, t, S, D, causal, biased, dtype, seed=0):
    P, mask = _window(t, S, causal)
    q = _draw(seed, B, H, t, D, dtype=dtype)
    k, v = _draw(seed + 1, B, Hk, S, D, dtype=dtype), _draw(seed + 2, B, Hk, S, D, dtype=dtype)
    pos = _draw(seed + 3, B, H, t, P, dtype=dtype) if biased else None
    return q, k, v, pos, mask


def _attend(kernel, q, k, v, pos, mask, cotangent):
    """The output and the gradients of q, k, v and the term (None without one) for ``cotangent``."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, *([] if pos is None else [pos]))]
    bias = None if pos is None else RelativeBias(leaves[3], k.shape[2])
    out = kernel(*leaves[:3], mask, bias, 0.3)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, cotangent)
    return out, *grads


def _explicit(q, k, v, mask, bias, scale):
    return kernels.explicit(q, k, v, mask, bias, scale, False)


# (B, H, Hk, t, S, D, causal): one query (decoding); a chunk after memory; grouped and shared key heads; more than
# one block of queries and keys and a head width that is no power of two; blocks the mask leaves nothing in
CASES = [
    (1, 2, 2, 1, 5, 8, True),
    (2, 2, 2, 8, 16, 16, True),
    (1, 4, 2, 8, 16, 8, True),
    (1, 3, 1, 7, 7, 16, False),
    (1, 2, 1, 70, 140, 20, True),
    (1, 2, 2, 66, 66, 16, False),
    # whole tiles outside the window, skipped (in the fast loop by the term's zeros below): a second a case here
    pytest.param(1, 2, 1, 200, 400, 16, True, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, 128, 256, 16, True, marks=pytest.mark.slow),  # every block full: the full suite
]


@pytest.mark.parametrize("biased", [True, False], ids=["xl", "no-term"])
@pytest.mark.parametrize(("B", "H", "Hk", "t", "S", "D", "causal"), CASES)
def test_the_kernel_is_the_explicit_attention_in_float32(B, H, Hk, t, S, D, causal, biased):
    """float32 in (multiplied exactly, not in TF32), float32 accumulators: within 1e-5 of the float64 explicit
    kernel's output and gradients, the term's included."""
    q, k, v, pos, mask = _inputs(B, H, Hk, t, S, D, causal, biased, torch.float32)
    cotangent = _draw(9, B, H, t, D)
    want = _attend(_explicit, *(x if x is None else x.double() for x in (q, k, v, pos)), mask, cotangent)
    have = _attend(kernels.fused, q, k, v, pos, mask, cotangent.float())
    for got, expected in zip(have, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(TRITON_DEVICE == "cuda", reason="Triton's interpreter alone multiplies bf16 wrongly")
def test_the_kernel_refuses_bf16_in_triton_s_interpreter():
    """Its tl.dot on bf16 came out 1e10 off, all finite: a tiny model's logits were 4 off, and a bf16 speed run
    saved its rows as ok."""
    q, k, v, pos, mask = _inputs(1, 2, 2, 8, 16, 16, True, True, torch.bfloat16)
    with pytest.raises(ValueError, match="--attention triton takes no bf16 on the CPU"):
        kernels.fused(q, k, v, mask, RelativeBias(pos, 16), 0.3)


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a CUDA GPU: Triton's interpreter has no bf16 dot")
def test_the_kernel_in_bf16_is_as_close_to_float64_as_sdpa_in_bf16():
    """Under autocast the inputs are bf16: the kernel's error against float64 is no worse than PyTorch's
    scaled-dot-product attention given the same bf16 inputs and the term as a float mask."""
    q, k, v, pos, mask = _inputs(1, 2, 2, 70, 140, 16, True, True, torch.bfloat16)
    cotangent = _draw(9, 1, 2, 70, 16)
    want = _attend(_explicit, *(x.double() for x in (q, k, v, pos)), mask, cotangent)
    have = _attend(kernels.fused, q, k, v, pos, mask, cotangent.bfloat16())
    sdpa = _attend(kernels.sdpa, q, k, v, pos, mask, cotangent.bfloat16())
    for got, reference, expected in zip(have, sdpa, want, strict=True):
        error = (got.double() - expected).abs().max()
        assert error <= 2 * (reference.double() - expected).abs().max() + 1e-3


@pytest.fixture
def unwritten_is_nan(monkeypatch):
    """torch.empty_like's memory filled with NaN while the test runs: an entry no kernel writes shows."""
    full_like = torch.full_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kwargs: full_like(x, float("nan"), **kwargs))


@pytest.mark.parametrize(
    ("t", "S", "causal"),
    [(8, 16, True), (200, 400, True), (66, 66, False)],
    ids=["window", "skipped-tiles", "no-mask"],
)
def test_the_term_gets_no_gradient_at_distances_no_query_meets_a_key(unwritten_is_nan, t, S, causal):
    """The term has a column per distance, but query i meets only the keys it may read: the columns it never reads
    (left of key 0, past the last key without a causal bound, keys the window hides, tiles the loops skip) get
    zero, written by the kernels into a buffer that starts as NaN here."""
    q, k, v, pos, mask = _inputs(1, 2, 1, t, S, 8, causal, True, torch.float32)
    i, column = torch.arange(t)[:, None], torch.arange(pos.shape[-1])[None, :]
    j = column - (t - 1 - i)  # the key query i meets at this column
    read = (j >= 0) & (j < S)
    if mask is not None:
        read &= mask.cpu()[i, j.clamp(0, S - 1)]
    grads = _attend(kernels.fused, q, k, v, pos, mask, _draw(9, 1, 2, t, 8).float())
    assert grads[-1].shape == pos.shape
    assert (~read).any() and not grads[-1][..., ~read.to(TRITON_DEVICE)].any()
    assert grads[-1][..., read.to(TRITON_DEVICE)].ne(0).all()


@pytest.mark.parametrize("biased", [True, False], ids=["xl", "no-term"])
def test_a_query_that_reads_no_key_gives_zero_and_leaves_every_gradient_finite(biased):
    """A mask row with no key (no window of the suite's makes one; a user's mask may): its output is 0 and it adds
    nothing to any gradient. The rest is the explicit attention in float64 where the row reads a key but passes
    back no gradient. Before, its log-sum-exp was -inf and exp(-inf - -inf) put NaN in every gradient of its tile."""
    q, k, v, pos, mask = _inputs(1, 2, 1, 8, 16, 8, True, biased, torch.float32)
    empty, some = mask.clone(), mask.clone()
    empty[3], some[3] = False, False
    some[3, 0] = True
    cotangent = _draw(9, 1, 2, 8, 8)
    quiet = cotangent.clone()
    quiet[:, :, 3] = 0
    have = _attend(kernels.fused, q, k, v, pos, empty, cotangent.float())
    want = _attend(_explicit, *(x if x is None else x.double() for x in (q, k, v, pos)), some, quiet)
    assert all(x.isfinite().all() for x in have)
    assert not have[0][:, :, 3].any()
    rows = [r for r in range(8) if r != 3]
    torch.testing.assert_close(have[0][:, :, rows].double(), want[0][:, :, rows], rtol=1e-5, atol=1e-5)
    for got, expected in zip(have[1:], want[1:], strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "pos"),
    [  # dense's and SwitchHead's XL models on this kernel, also in tests/test_attention_kernels.py (float64 there
        # on the CPU, float32 on a GPU)
        pytest.param("transformer", "xl", marks=pytest.mark.slow),
        pytest.param("switchhead", "xl", marks=pytest.mark.slow),
        ("moa", "xl"),
        pytest.param("gqa", "rope", marks=pytest.mark.slow),  # grouped heads: the kernel's own cases above
    ],
)
def test_a_model_on_the_kernel_is_the_model_on_the_explicit_attention(model, pos):
    """A whole model's loss and every parameter's gradient, over a chunk and one after memory, on this kernel
    against the explicit one (float32 against float64): XL's term, MoA's shared key head, RoPE's none."""
    lm = make_lm(small_cfg(model, pos)).to(TRITON_DEVICE)
    tokens = random_tokens(lm.cfg, SEQ).to(TRITON_DEVICE)

    def run(backend, dtype):
        net = lm.to(dtype)
        net.zero_grad(set_to_none=True)
        with choice.selected(backend), choice.recording() as resolved:
            state = net(tokens[:, :T]).state
            loss = net(tokens[:, T : 2 * T], state).loss(tokens[:, T + 1 : 2 * T + 1])
        loss.backward()
        assert set(resolved.values()) == {backend}
        # copies: converting the model to another dtype converts its gradients in place
        return loss.double(), {
            n: p.grad.to(F64, copy=True) for n, p in net.named_parameters() if p.grad is not None
        }

    want_loss, want = run("explicit", F64)
    have_loss, have = run("triton", torch.float32)
    torch.testing.assert_close(have_loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-6)  # every parameter's, named where one differs


def _causal(t: int, S: int) -> torch.Tensor:
    """A Transformer-XL training window: the last t of S keys as queries, each reading every key up to its own."""
    return (torch.arange(S)[None] <= torch.arange(S - t, S)[:, None]).to(TRITON_DEVICE)


@pytest.mark.parametrize("window", ["band", "causal"])
def test_the_loops_skip_exactly_the_tiles_the_mask_leaves_nothing_in(window):
    """Each block of rows visits the column blocks from its first to its last with a readable entry, and reads the
    mask outside its first run of blocks it may read whole: against a loop over the tiles (a ragged last block is
    never whole), at a window with blocks skipped and, for the causal one, with whole ones."""
    from switchbench.ops.attention import flash

    t, S = 200, 400
    mask = _window(t, S, True)[1] if window == "band" else _causal(t, S)
    for rows, cols in ((128, 64), (64, 32), (32, 64)):
        spans = flash._spans(mask, rows, cols, None).cpu()
        for r in range(spans.shape[0]):
            tiles = [mask[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols] for c in range(-(-S // cols))]
            live = [c for c, tile in enumerate(tiles) if tile.any()]
            whole = [c for c, tile in enumerate(tiles) if tile.shape == (rows, cols) and tile.all()]
            run = [c for i, c in enumerate(whole) if c == whole[0] + i]  # the first run of whole tiles
            full = [run[0], run[-1] + 1] if run else [live[-1] + 1] * 2
            assert spans[r].tolist() == [live[0], live[-1] + 1, *full]
        if window == "band":
            assert spans[:, 0].max() > 0  # the window's early keys are skipped by its late queries
        else:
            assert (spans[:, 3] > spans[:, 2]).any() and (
                spans[:, 1] > spans[:, 3]
            ).any()  # whole, then partial


def _holed(t: int, S: int) -> torch.Tensor:
    """Every key readable but one: whole tiles on both sides of a partial one along a loop, and a tile a kernel would
    read whole if it took the run of whole tiles along the wrong axis (a review's case)."""
    mask = torch.ones(t, S, dtype=torch.bool)
    mask[3, 40] = False
    return mask.to(TRITON_DEVICE)


@pytest.mark.parametrize("biased", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["xl", "no-term"])
@pytest.mark.parametrize("window", [_causal, _holed], ids=["causal", "holed"])
def test_tiles_read_whole_are_the_explicit_attention(monkeypatch, window, biased):
    """Windows with blocks small enough that most tiles are whole (their mask unread by the forward and the query
    blocks' kernels) and some are not: a causal one over memory, and one with a single key hidden; output and
    every gradient against the explicit kernel in float64."""
    from switchbench.ops import tuned as tuning
    from switchbench.ops.attention import flash

    pins = {kernel: flash.config_label(flash.candidates(kernel, 16)[2]) for kernel in flash.CONFIGS}
    monkeypatch.setenv(tuning.ENV, ";".join(f"flash_{kernel}={label}" for kernel, label in pins.items()))
    t, S = 64, 128  # 64-row blocks: whole tiles and partial ones in one row block
    # the term's distances: those of a causal window, or every one, negative ones too
    q, k, v, pos, _ = _inputs(1, 2, 1, t, S, 16, window is _causal, biased, F64)
    cotangent = _draw(9, 1, 2, t, 16)
    want = _attend(_explicit, q, k, v, pos, window(t, S), cotangent)
    have = _attend(kernels.fused, q, k, v, pos, window(t, S), cotangent)
    for got, expected in zip(have, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_a_speed_row_on_the_kernel_says_so():
    """The attention column of a bench run on this kernel names it (it had fallen through to "explicit softmax")."""
    from switchbench.bench.timing import speed

    layer = speed.layer_benches("tiny-transformer", 1, TRITON_DEVICE, torch.float32)[1]
    with choice.selected("triton"):
        assert layer.attention() == "Triton flash"


# In the fast loop the second candidates alone: they change every kernel's blocks from the first, which every other
# test of the kernel runs
INDICES = [pytest.param(i, marks=() if i == 1 else pytest.mark.slow) for i in range(4)]


@pytest.mark.parametrize("index", INDICES)
@pytest.mark.parametrize("D", [16, pytest.param(72, marks=pytest.mark.slow)], ids=["table-64", "table-128"])
def test_every_candidate_configuration_is_the_explicit_attention(monkeypatch, unwritten_is_nan, D, index):
    """Each configuration the measured choice may pick, pinned for all three kernels: several blocks each way,
    tiles the window skips and a ragged last block, with the term and without, against the explicit kernel in
    float64."""
    from switchbench.ops import tuned as tuning
    from switchbench.ops.attention import flash

    pins = {kernel: flash.config_label(flash.candidates(kernel, D)[index]) for kernel in flash.CONFIGS}
    monkeypatch.setenv(tuning.ENV, ";".join(f"flash_{kernel}={label}" for kernel, label in pins.items()))
    # On a GPU in bf16, the dtype the candidates are sized for: in float32 a 128 x 64 forward tile of 128-channel
    # heads needs 305 KiB of shared memory, past an H200 block's 227 (the timing passes over such a candidate)
    dtype, atol = (torch.bfloat16, 3e-2) if TRITON_DEVICE == "cuda" else (torch.float32, 1e-5)
    for biased in (True, False):  # dQ read off the term's gradient, or recomputed from the logits
        q, k, v, pos, mask = _inputs(1, 2, 1, 136, 272, D, True, biased, dtype)
        cotangent = _draw(9, 1, 2, 136, D)
        want = _attend(_explicit, *(x if x is None else x.double() for x in (q, k, v, pos)), mask, cotangent)
        have = _attend(kernels.fused, q, k, v, pos, mask, cotangent.to(dtype))
        for got, expected in zip(have, want, strict=True):
            scale = expected.abs().max().clamp(min=1)
            torch.testing.assert_close(got.double() / scale, expected / scale, rtol=atol, atol=atol)


def test_a_launch_shape_runs_the_candidate_measured_fastest_and_is_timed_once(monkeypatch):
    """On a GPU without a table each kernel times its candidates at a shape's first launch and keeps the fastest
    for the process; a table for this GPU's name, a pin or a capture decides without timing. (A stand-in clock
    and tensor: this is the choice, not the GPU's.)"""
    from types import SimpleNamespace

    from triton.runtime.errors import OutOfResources

    from switchbench.bench.command import kernel_metadata
    from switchbench.ops import tuned as tuning
    from switchbench.ops.attention import flash

    gpu = torch.device("cuda", 0)
    q = SimpleNamespace(is_cuda=True, device=gpu, dtype=torch.bfloat16, shape=(64, 16, 512, 64))
    k = SimpleNamespace(shape=(64, 16, 1024, 64))
    mask = object()
    table: dict = {"device": "H100", "configs": {}}
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "tables", lambda: (table,))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    tuning.ahead_of_time.cache_clear()
    candidates = flash.candidates("key_block", 64)
    timed = []

    def clock(call):
        timed.append(call.args[0])
        return 1.0 if call.args[0] == candidates[2] else 2.0  # the third is fastest

    monkeypatch.setattr(flash, "_time", clock)
    key = flash.shape_key(q, k, q, mask)
    assert key == "512x1024x64 bfloat16 pos mask"
    assert (
        flash.shape_key(q, SimpleNamespace(shape=(64, 4, 1000, 64)), None, None)
        == "512x1024x64 bfloat16 group4"
    )
    assert flash._chosen("key_block", q, k, q, mask, lambda config: None) == candidates[2]
    assert timed == candidates
    assert tuning.chosen() == {("flash_key_block", key): flash.config_label(candidates[2])}
    assert flash._chosen("key_block", q, k, q, mask, lambda config: None) == candidates[2]
    assert len(timed) == len(candidates)  # remembered, not timed again
    recorded = kernel_metadata("auto", "cuda")["triton_configs_measured"]  # what the run's file says
    assert recorded == {f"flash_key_block | {key}": flash.config_label(candidates[2])}

    forward = flash.candidates("forward", 64)

    def too_large(
        call,
    ):  # the second would be fastest, but this GPU has too little shared memory a block for it
        if call.args[0] == forward[1]:
            raise OutOfResources(163840, 101376, "shared memory")
        return 1.5 if call.args[0] == forward[3] else 2.0

    monkeypatch.setattr(flash, "_time", too_large)
    assert flash._chosen("forward", q, k, q, mask, lambda config: None) == forward[3]
    monkeypatch.setattr(flash, "_time", clock)

    monkeypatch.setattr(tuning, "_chosen", {})  # a later process on a GPU with a table
    table["configs"]["flash_key_block"] = {key: flash.config_label(candidates[1])}
    tuning.ahead_of_time.cache_clear()
    assert flash._chosen("key_block", q, k, q, mask, None) == candidates[1]
    monkeypatch.setenv(tuning.ENV, f"flash_key_block={flash.config_label(candidates[3])}")
    assert flash._chosen("key_block", q, k, q, mask, None) == candidates[3]
    monkeypatch.delenv(tuning.ENV)

    table["configs"] = {}
    tuning.ahead_of_time.cache_clear()
    capturing[0] = True  # a shape first met inside a capture runs the default, and nothing is recorded
    assert flash._chosen("key_block", q, k, q, mask, None) == candidates[0]
    assert tuning.chosen() == {} and len(timed) == len(candidates)
    table["configs"]["flash_key_block"] = {key: "M1 N1 w1 s1"}
    tuning.ahead_of_time.cache_clear()
    with pytest.raises(
        ValueError, match="flash_key_block at heads of 64 channels has no config 'M1 N1 w1 s1'"
    ):
        flash._chosen("key_block", q, k, q, mask, None)
    tuning.ahead_of_time.cache_clear()


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a CUDA GPU: nothing is timed in the interpreter")
def test_on_a_gpu_each_kernel_times_its_candidates_once_and_runs_the_one_it_chose(monkeypatch):
    """The timing itself, on the GPU: each kernel keeps one of its candidates at a shape's first launch, a second
    pass times nothing, and what it computes is what the first candidates compute."""
    from switchbench.ops import tuned as tuning
    from switchbench.ops.attention import flash

    calls = []

    def timed(call):
        calls.append(call)
        return time_on_the_gpu(call)

    monkeypatch.setattr(flash, "_time", timed)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "tables", lambda: ())
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.ahead_of_time.cache_clear()
    q, k, v, pos, mask = _inputs(2, 4, 4, 256, 512, 64, True, True, torch.bfloat16)
    cotangent = _draw(9, 2, 4, 256, 64, dtype=torch.bfloat16)
    chosen = _attend(kernels.fused, q, k, v, pos, mask, cotangent)
    assert len(calls) == sum(len(flash.candidates(kernel, 64)) for kernel in flash.CONFIGS)
    assert {kernel for kernel, _ in tuning.chosen()} == {f"flash_{kernel}" for kernel in flash.CONFIGS}
    again = _attend(kernels.fused, q, k, v, pos, mask, cotangent)
    assert len(calls) == sum(
        len(flash.candidates(kernel, 64)) for kernel in flash.CONFIGS
    )  # nothing timed again
    pins = {kernel: flash.config_label(flash.candidates(kernel, 64)[0]) for kernel in flash.CONFIGS}
    monkeypatch.setenv(tuning.ENV, ";".join(f"flash_{kernel}={label}" for kernel, label in pins.items()))
    first = _attend(kernels.fused, q, k, v, pos, mask, cotangent)
    for a, b, c in zip(chosen, again, first, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)
