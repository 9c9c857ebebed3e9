"""Triton kernels of the position bias (:mod:`~switchbench.ops.attention.relative`), for CUDA tensors (and CPU
tensors under TRITON_INTERPRET=1): one memory-bound pass each way.

``spread``: row (b, h, i) of the scores by distance [B, H, t, D] becomes the same row of the bias, whose entry j is
column t - 1 - i + j, zero past the last column (as the views' padding) and -inf where the mask says the query may
not read key j. ``gather``: its gradient, entry c of a row being the bias gradient's entry j = c - (t - 1 - i) where
that is a key the query reads, else zero. Rows are addressed through their three strides: the scores come head by
head from the models (:func:`~switchbench.models.layers.attention_xl.scores_by_distance`), and their gradient is
written in the same order, so that neither is copied into [B * H * t, D] rows on the way.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from switchbench.ops.attention.layout import empty_in_order
from switchbench.ops.attention.relative import aligned_width

BLOCK = 1024  # columns a program writes: one 2 KiB row segment in bf16


@triton.jit
def _row(H, t, sb, sh, st):
    """This program's row (b, h, i) of [B, H, t]: (query i, offset of the row's start through strides sb, sh, st)."""
    row = tl.program_id(0).to(tl.int64)  # B * H * t can pass 2**31 elements with the columns
    i = row % t
    head = row // t
    return i, (head // H) * sb + (head % H) * sh + i * st


@triton.jit
def _spread_kernel(
    scores_ptr,
    bias_ptr,
    mask_ptr,
    H,
    t,
    S,
    D,
    ss_b,
    ss_h,
    ss_t,
    sb_b,
    sb_h,
    sb_t,
    stride_mask,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i, scores_row = _row(H, t, ss_b, ss_h, ss_t)
    bias_row = _row(H, t, sb_b, sb_h, sb_t)[1]
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column = t - 1 - i + j
    key = j < S
    value = tl.load(scores_ptr + scores_row + column, mask=key & (column < D), other=0.0)
    if HAS_MASK:
        readable = tl.load(mask_ptr + i * stride_mask + j, mask=key, other=0) != 0
        value = tl.where(readable, value, float("-inf"))
    tl.store(bias_ptr + bias_row + j, value.to(bias_ptr.dtype.element_ty), mask=key)


@triton.jit
def _gather_kernel(
    grad_ptr,
    out_ptr,
    mask_ptr,
    H,
    t,
    S,
    D,
    sg_b,
    sg_h,
    sg_t,
    so_b,
    so_h,
    so_t,
    stride_mask,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i, grad_row = _row(H, t, sg_b, sg_h, sg_t)
    out_row = _row(H, t, so_b, so_h, so_t)[1]
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = column - (t - 1 - i)
    read = (column < D) & (j >= 0) & (j < S)
    if HAS_MASK:
        read = read & (tl.load(mask_ptr + i * stride_mask + j, mask=read, other=0) != 0)
    value = tl.load(grad_ptr + grad_row + j, mask=read, other=0.0)
    tl.store(out_ptr + out_row + column, value.to(out_ptr.dtype.element_ty), mask=column < D)


def spread(scores: Tensor, S: int, mask: Tensor | None) -> Tensor:
    """scores [B, H, t, D], in any layout with unit-stride columns -> bias [B, H, t, S], in rows of
    :func:`aligned_width` (S) elements."""
    B, H, t, D = scores.shape
    bias = scores.new_empty(B, H, t, aligned_width(S))[..., :S]
    _run(_spread_kernel, scores, bias, mask, S, D)
    return bias


def gather(grad: Tensor, D: int, mask: Tensor | None, order: Sequence[int]) -> Tensor:
    """The gradient of :func:`spread`: grad [B, H, t, S] -> [B, H, t, D], laid out in ``order`` (the scores'
    dimensions outermost first, :func:`~switchbench.ops.attention.layout.order_of`)."""
    *rows, S = grad.shape
    out = empty_in_order(grad, (*rows, D), order)
    _run(_gather_kernel, grad, out, mask, S, D)
    return out


def _run(kernel, src: Tensor, dst: Tensor, mask: Tensor | None, S: int, D: int) -> None:
    src = src if src.stride(-1) == 1 else src.contiguous()
    grid, args, constants = _arguments(src, dst, mask, S, D)
    with torch.cuda.device_of(src):
        kernel[grid](*args, **constants)


def _arguments(src: Tensor, dst: Tensor, mask: Tensor | None, S: int, D: int):
    """(grid, arguments, constexprs) of one launch from ``src`` to ``dst``, both [B, H, t, columns]: a program per
    row and block of the columns it writes, the mask [t, S] read as bytes."""
    B, H, t, columns = dst.shape
    readable = src if mask is None else mask.contiguous().view(torch.uint8)  # unread without a mask
    block = min(BLOCK, triton.next_power_of_2(columns))
    args = (src, dst, readable, H, t, S, D, *src.stride()[:3], *dst.stride()[:3], readable.stride(0))
    return (B * H * t, triton.cdiv(columns, block)), args, {"HAS_MASK": mask is not None, "BLOCK": block}


def launches(t: int, S: int, H: int, dtype: torch.dtype) -> list[tuple[str, object, tuple, dict]]:
    """(pass, kernel, arguments, constexprs) of both launches for a causal window of t queries over S keys in H
    heads, on meta tensors laid out as a model's (the scores head by head): what kernel-check compiles ahead of
    time. Two sequences and H heads, so that no size or stride is 1, which Triton would compile as a constant."""
    meta = {"dtype": dtype, "device": "meta"}
    mask = torch.empty(t, S, dtype=torch.bool, device="meta")
    scores = torch.empty(H, 2, t, S, **meta).transpose(0, 1)
    bias = torch.empty(2, H, t, aligned_width(S), **meta)[..., :S]
    return [
        ("forward", _spread_kernel, *_arguments(scores, bias, mask, S, S)[1:]),
        ("backward", _gather_kernel, *_arguments(bias, scores, mask, S, S)[1:]),
    ]
