"""Triton kernels of the position bias (:mod:`~switchbench.ops.attention.relative`), for CUDA tensors (and CPU
tensors under TRITON_INTERPRET=1): one memory-bound pass each way.

``spread``: row r of the scores by distance [B * H * t, D] (query i = r mod t) becomes row r of the bias, whose
entry j is column t - 1 - i + j, zero past the last column (as the views' padding) and -inf where the mask says
the query may not read key j. ``gather``: its gradient, entry c of row r being the bias gradient's entry
j = c - (t - 1 - i) where that is a key the query reads, else zero.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from switchbench.ops.attention.relative import aligned_width

BLOCK = 1024  # columns a program writes: one 2 KiB row segment in bf16


@triton.jit
def _spread_kernel(
    scores_ptr,
    bias_ptr,
    mask_ptr,
    t,
    S,
    D,
    stride_scores,
    stride_bias,
    stride_mask,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # B * H * t can pass 2**31 elements with the columns
    i = row % t
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column = t - 1 - i + j
    key = j < S
    value = tl.load(scores_ptr + row * stride_scores + column, mask=key & (column < D), other=0.0)
    if HAS_MASK:
        readable = tl.load(mask_ptr + i * stride_mask + j, mask=key, other=0) != 0
        value = tl.where(readable, value, float("-inf"))
    tl.store(bias_ptr + row * stride_bias + j, value.to(bias_ptr.dtype.element_ty), mask=key)


@triton.jit
def _gather_kernel(
    grad_ptr,
    out_ptr,
    mask_ptr,
    t,
    S,
    D,
    stride_grad,
    stride_out,
    stride_mask,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = row % t
    column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = column - (t - 1 - i)
    read = (column < D) & (j >= 0) & (j < S)
    if HAS_MASK:
        read = read & (tl.load(mask_ptr + i * stride_mask + j, mask=read, other=0) != 0)
    value = tl.load(grad_ptr + row * stride_grad + j, mask=read, other=0.0)
    tl.store(out_ptr + row * stride_out + column, value.to(out_ptr.dtype.element_ty), mask=column < D)


def spread(scores: Tensor, S: int, mask: Tensor | None) -> Tensor:
    """scores [..., t, D] -> bias [..., t, S], in rows of :func:`aligned_width` (S) elements."""
    *batch, t, D = scores.shape
    rows = scores.reshape(-1, D)
    width = aligned_width(S)
    bias = rows.new_empty(rows.shape[0], width)
    _run(_spread_kernel, rows, bias, mask, t, S, D, S)
    return bias.view(*batch, t, width)[..., :S]


def gather(grad: Tensor, D: int, mask: Tensor | None) -> Tensor:
    """The gradient of :func:`spread`: grad [..., t, S] -> [..., t, D]."""
    *batch, t, S = grad.shape
    rows = grad.reshape(-1, S)
    out = rows.new_empty(rows.shape[0], D)
    _run(_gather_kernel, rows, out, mask, t, S, D, D)
    return out.view(*batch, t, D)


def _run(kernel, src: Tensor, dst: Tensor, mask: Tensor | None, t: int, S: int, D: int, columns: int) -> None:
    src = src if src.stride(-1) == 1 else src.contiguous()
    grid, args, constants = _arguments(src, dst, mask, t, S, D, columns)
    with torch.cuda.device_of(src):
        kernel[grid](*args, **constants)


def _arguments(src: Tensor, dst: Tensor, mask: Tensor | None, t: int, S: int, D: int, columns: int):
    """(grid, arguments, constexprs) of one launch: a program per row and block of its ``columns``, the mask [t, S]
    read as bytes."""
    readable = src if mask is None else mask.contiguous().view(torch.uint8)  # unread without a mask
    block = min(BLOCK, triton.next_power_of_2(columns))
    args = (src, dst, readable, t, S, D, src.stride(0), dst.stride(0), readable.stride(0))
    return (src.shape[0], triton.cdiv(columns, block)), args, {"HAS_MASK": mask is not None, "BLOCK": block}


def launches(t: int, S: int, dtype: torch.dtype) -> list[tuple[str, object, tuple, dict]]:
    """(pass, kernel, arguments, constexprs) of both launches for a causal window of t queries over S keys, on meta
    tensors: what kernel-check compiles ahead of time."""
    meta = {"dtype": dtype, "device": "meta"}
    mask = torch.empty(t, S, dtype=torch.bool, device="meta")
    scores, bias = torch.empty(t, S, **meta), torch.empty(t, aligned_width(S), **meta)
    return [
        ("forward", _spread_kernel, *_arguments(scores, bias, mask, t, S, S, S)[1:]),
        ("backward", _gather_kernel, *_arguments(bias[:, :S], scores, mask, t, S, S, S)[1:]),
    ]
