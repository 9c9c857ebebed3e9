"""Triton's flash attention takes the layouts the models hand it, under TRITON_INTERPRET=1 without a GPU: q split
into heads from one projection's [B, t, H, D] output, k and v slices of one projection's output, a cache's window,
an output gradient in any layout. Each equals the explicit kernel in float64 (output and every gradient), and o
and the gradients come out in their inputs' order, so that no projection copies them on the way in or out. XL's
position term comes head by head from one product a head, which copies neither the queries nor the encodings."""

import pytest
import torch
from small import TRITON_DEVICE, counted_copies, small_cfg

from switchbench.models.families.dense import DenseAttention
from switchbench.models.layers.attention_xl import scores_by_distance
from switchbench.models.layers.window import make_window
from switchbench.ops.attention import choice, flash, kernels, layout
from switchbench.ops.attention.relative import RelativeBias

F64 = torch.float64


def _draw(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(TRITON_DEVICE)


def _head_split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, heads * D] -> the view [B, heads, L, D], as a model splits a projection's output."""
    B, L, _ = x.shape
    return x.view(B, L, heads, -1).transpose(1, 2)


def _layouts(B, H, Hk, t, S, D):
    """q head-split; k and v head-split slices of one [B, S, 2 Hk D] output (dense's K and V read their window
    in one product); the same data contiguous."""
    q = _head_split(_draw(0, B, t, H * D), H)
    kv = _draw(1, B, S, 2 * Hk * D)
    k, v = _head_split(kv[..., : Hk * D], Hk), _head_split(kv[..., Hk * D :], Hk)
    return (q, k, v), tuple(x.contiguous() for x in (q, k, v))


def _run(kernel, q, k, v, pos, mask, cotangent):
    leaves = [x.detach().requires_grad_() for x in (q, k, v, pos)]
    out = kernel(*leaves[:3], mask, RelativeBias(leaves[3], k.shape[2]), 0.3)
    out = out[0] if isinstance(out, tuple) else out
    return out, *torch.autograd.grad(out, leaves, cotangent)


def _explicit(q, k, v, mask, bias, scale):
    return kernels.explicit(q, k, v, mask, bias, scale, False)


def _assert_fused_is_explicit(q, k, v, pos, mask, cotangent):
    """The output and the gradients of q, k, v and the term, against the explicit kernel's in float64."""
    want, have = (_run(kernel, q, k, v, pos, mask, cotangent) for kernel in (_explicit, kernels.fused))
    for got, expected in zip(have, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("H", "Hk"),
    [pytest.param(2, 2, marks=pytest.mark.slow), (4, 2), pytest.param(2, 1, marks=pytest.mark.slow)],
    ids=["heads", "grouped", "shared"],
)
def test_the_kernel_takes_head_split_views_as_they_are(H, Hk):
    """Output and every gradient equal the explicit kernel's in float64, the output gradient arriving as the O
    projection's gradient does (a head-split view) and as a contiguous tensor."""
    B, t, S, D = 2, 24, 40, 16
    (q, k, v), _ = _layouts(B, H, Hk, t, S, D)
    pos = _draw(3, B, H, t, S)
    mask = (torch.arange(S)[None] <= torch.arange(S - t, S)[:, None]).to(TRITON_DEVICE)
    for cotangent in (_head_split(_draw(4, B, t, H * D), H), _draw(4, B, H, t, D)):
        _assert_fused_is_explicit(q, k, v, pos, mask, cotangent)


def test_broadcast_keys_and_values_are_copied_and_their_gradients_are_right():
    """k and v expanded from one head (a zero stride) share strides, but dK and dV must not be laid out in their
    order: they are taken contiguous, and the gradients equal the explicit kernel's."""
    B, H, t, S, D = 2, 2, 8, 16, 16
    q, pos = _draw(0, B, H, t, D), _draw(3, B, H, t, S + t - 1)  # no mask: every distance, negative ones too
    k, v = (_draw(seed, B, 1, S, D).expand(B, H, S, D) for seed in (1, 2))
    assert all(x.is_contiguous() for x in flash._keys_values(k, v))
    _assert_fused_is_explicit(q, k, v, pos, None, _draw(4, B, H, t, D))


def test_head_split_inputs_are_taken_without_a_copy_and_outputs_follow_their_order():
    (q, k, v), (qc, _, vc) = _layouts(2, 4, 2, 24, 40, 16)
    assert layout.packed(q) and not layout.packed(k) and layout.packed(qc)
    assert flash._taken(q)[0] is q  # a head-split view, packed
    assert all(a is b for a, b in zip(flash._keys_values(k, v), (k, v), strict=True))  # one set of strides
    o = flash.output_like(q)
    assert (
        o.stride() == q.stride() and o.transpose(1, 2).is_contiguous()
    )  # the O projection reads it as it is
    dq, dk, dv, dpos = flash.gradients_like(q, k, v, None)
    assert dq.stride() == q.stride() and dpos is None
    for grad in (dk, dv):  # packed in the slices' order: the view back to [B, S, Hk D] needs no copy
        assert grad.transpose(1, 2).is_contiguous()
    # what the kernels cannot share strides for is made contiguous: a v of another layout than k's
    taken = flash._keys_values(k, vc)
    assert all(x.is_contiguous() for x in taken) and flash.gradients_like(q, k, vc, None)[1].is_contiguous()
    # a head-split view with one key head reads as a contiguous one
    assert layout.packed(_head_split(_draw(5, 2, 40, 16), 1))


@pytest.mark.parametrize(
    "strides",
    [(32, 8, 2, 1), (24, 1, 8, 2), (48, 12, 3, 1)],
    ids=["padded rows", "channels strided", "gaps"],
)
def test_a_tensor_with_gaps_or_strided_channels_is_not_packed(strides):
    x = torch.empty_strided((2, 4, 3, 2), strides, dtype=F64)
    assert not layout.packed(x)
    made = layout.empty_in_order_of(x.contiguous())
    assert made.is_contiguous()


@pytest.mark.parametrize("Hk", [3, 1], ids=["a key head each", "one for all"])
@pytest.mark.parametrize("split", [True, False], ids=["head-split q", "contiguous q"])
def test_the_position_term_is_one_product_a_head(Hk, split):
    """Equal to the broadcast product q @ r in float64, with both gradients, laid out head by head."""
    B, H, t, D, P = 2, 3, 5, 4, 7
    q = _head_split(_draw(0, B, t, H * D), H) if split else _draw(0, B, H, t, D)
    r = _draw(1, Hk, D, P)
    cotangent = _draw(2, B, H, t, P)
    got, want = (
        (product(q_, r_), *torch.autograd.grad(product(q_, r_), (q_, r_), cotangent))
        for product in (scores_by_distance, torch.matmul)
        for q_, r_ in [(q.detach().requires_grad_(), r.detach().requires_grad_())]
    )
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, rtol=1e-12, atol=1e-12)
    assert layout.order_of(got[0]) == [1, 0, 2, 3] and layout.packed(got[0])


def test_a_dense_xl_layer_copies_only_its_query_gradient():
    """A dense XL layer's forward and backward on flash attention, with a chunk of memory: of its activations only
    the queries' gradient is copied, their position part coming head by head into the projection's token order.
    The broadcast q @ r copied the queries and the encodings once a sequence as well (and summed the encodings'
    gradient over the sequences)."""
    cfg = small_cfg(
        "transformer", "xl", n_heads=4, d_head=16, d_model=64
    )  # 16 channels: none padded for tl.dot
    layer = DenseAttention(cfg).double().to(TRITON_DEVICE)
    B, T = 2, cfg.T
    x, memory = _draw(0, B, T, 64).requires_grad_(), _draw(1, B, T, 64)
    window = make_window(T, T, T, T, 1, True, TRITON_DEVICE)
    with choice.selected("triton"), counted_copies() as copies:
        layer(x, memory, window)[0].sum().backward()
    distances = 2 * T
    assert copies == [(distances, 1), (B, T, 4, 16)]  # the distances made floats, the queries' gradient
