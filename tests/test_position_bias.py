"""Transformer-XL's position term spread over the [t, S] grid: the views against the definition entry by entry, and
the Triton kernels (under TRITON_INTERPRET=1 without a GPU) against the views in float64, forward and backward."""

import pytest
import torch
from small import counted_copies

from switchbench.ops.attention.relative import ROW_ALIGNMENT, RelativeBias, relative_shift

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (t, S, causal): one query (decoding), the square chunk, a chunk after memory, wider than one Triton block
SHAPES = [(1, 1, True), (1, 4, True), (3, 3, True), (3, 9, True), (1, 1, False), (3, 3, False), (3, 8, False)]


def _draw(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(DEVICE)


def _window(t: int, S: int, causal: bool) -> tuple[int, torch.Tensor | None]:
    """Columns of scores by distance, and the mask: causal over memory, each query reading one chunk of 4 back."""
    if not causal:
        return S + t - 1, None
    q_pos, k_pos = torch.arange(S - t, S)[:, None], torch.arange(S)
    return S, ((k_pos <= q_pos) & (k_pos // 4 >= q_pos // 4 - 1)).to(DEVICE)


@pytest.mark.parametrize(("t", "S", "causal"), SHAPES)
def test_relative_shift_reads_each_distance(t, S, causal):
    """Entry (i, j) is the score of distance i + S - t - j, from columns of distances S - 1 down to 0 (causal)
    or 1 - t (not); a causal window's future keys read zeros."""
    lowest = 0 if causal else 1 - t
    distances = list(range(S - 1, lowest - 1, -1))
    scores = _draw(10 * t + S, 2, 3, t, len(distances))
    shifted = relative_shift(scores, S)
    assert shifted.shape == (2, 3, t, S)
    for i in range(t):
        for j in range(S):
            d = i + S - t - j
            expected = scores[..., i, distances.index(d)] if d >= lowest else scores.new_zeros(2, 3)
            assert torch.equal(shifted[..., i, j], expected), (i, j)


def _head_by_head(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, t, D] laid out [H, B, t, D], as a model's scores by distance come (one product a head)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


# Layouts of the scores: as the models give them, and two that the kernels take through a copy (their gradient
# then contiguous)
LAYOUTS = {
    "contiguous": lambda x: x,
    "head by head": _head_by_head,
    "strided columns": lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2),
    "broadcast": lambda x: x[:1].expand_as(x),
}


@pytest.mark.parametrize(
    "layout",
    ["contiguous", *(pytest.param(name, marks=pytest.mark.slow) for name in list(LAYOUTS)[1:])],
)
@pytest.mark.parametrize(("t", "S", "causal"), [*SHAPES, (2, 1100, True), (5, 1030, False)])
def test_the_triton_kernels_are_the_views(t, S, causal, layout):
    """The bias, -inf where masked, and the scores' gradient (from a cotangent that is nonzero everywhere, masked
    entries included): bit for bit the views' and masked_fill's, in every layout of the scores."""
    D, mask = _window(t, S, causal)
    scores = LAYOUTS[layout](_draw(t * S, 2, 3, t, D)).detach().requires_grad_()
    bias = RelativeBias(scores, S)
    expected = bias.masked(mask, impl="torch")
    got = bias.masked(mask, impl="triton")
    assert torch.equal(got, expected)
    cotangent = _draw(1, *expected.shape)
    (want,) = torch.autograd.grad(expected, scores, cotangent)
    (have,) = torch.autograd.grad(got, scores, cotangent)
    assert torch.equal(have, want)


def test_scores_laid_out_head_by_head_are_read_in_place():
    """Rows addressed through their strides: the kernels read [H, B, t, D] scores and write their gradient there,
    where a reshape into [B * H * t, D] rows would copy the whole term each way."""
    D, mask = _window(3, 9, True)
    scores = _head_by_head(_draw(2, 2, 3, 3, D)).requires_grad_()
    with counted_copies() as copies:
        bias = RelativeBias(scores, 9).masked(mask, impl="triton")
        (grad,) = torch.autograd.grad(bias, scores, _draw(1, *bias.shape))
    assert copies == [] and grad.stride() == scores.stride()


def test_a_gradient_the_kernel_cannot_write_in_the_scores_layout_comes_contiguous():
    """Scores with strided columns or broadcast over the sequences: the kernel writes unit-stride rows with no
    broadcast, so their gradient comes contiguous (in their order, its columns would overlap or be strided)."""
    D, mask = _window(3, 9, True)
    for make in (LAYOUTS["strided columns"], LAYOUTS["broadcast"]):
        scores = make(_draw(2, 2, 3, 3, D)).detach().requires_grad_()
        bias = RelativeBias(scores, 9).masked(mask, impl="triton")
        assert torch.autograd.grad(bias, scores, _draw(1, *bias.shape))[0].is_contiguous()


def test_the_triton_bias_rows_are_aligned_for_the_memory_efficient_kernel():
    """Rows of S = 9 keys start 16 elements apart, as the memory-efficient SDPA kernel reads a mask without
    copying it; the view is S wide."""
    D, mask = _window(3, 9, True)
    bias = RelativeBias(_draw(0, 2, 3, 3, D), 9).masked(mask, impl="triton")
    assert bias.shape == (2, 3, 3, 9)
    assert all(stride % ROW_ALIGNMENT == 0 for stride in bias.stride()[:-1])


@pytest.mark.slow  # compiles
def test_the_op_compiles_without_a_graph_break():
    """torch.compile reads the op's shapes and strides from its fake implementation, backward included."""
    D, mask = _window(3, 9, True)
    drawn = _draw(0, 2, 3, 3, D)

    def step(scores):
        return RelativeBias(scores, 9).masked(mask, impl="triton").exp().sum()

    for scores in (drawn, _head_by_head(drawn)):  # the fakes lay the gradient out as the kernels do
        scores = scores.requires_grad_()
        expected = torch.autograd.grad(step(scores), scores)[0]
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(scores), scores)[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert got.stride() == scores.stride()


def test_an_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="one of torch, triton"):
        RelativeBias(_draw(0, 1, 1, 2, 3), 3).masked(None, impl="cuda")
