"""Flash attention in Triton that reads Transformer-XL's position term by distance inside the kernel, for CUDA
tensors (and CPU tensors under TRITON_INTERPRET=1): ``--attention triton``.

Why: a training step cannot give SDPA's fast kernels the term. cuDNN's takes no gradient for a float mask, so an XL
step runs the memory-efficient kernel, which reads the term spread over [t, S] and writes its gradient there (on
an H200, 262M, batch 64: 99 of dense's 298 ms of kernel time in that kernel, 20 more spreading and gathering the
term). Here the term stays [B, H, t, P] by distance; a tile of logits reads its entries at column t - 1 - i + j
(:mod:`~switchbench.ops.attention.relative`), and the backward writes its gradient to the same places. Query i
meets key j once in a row, so every entry of the term's gradient has one writer: no atomics and no [t, S] tensor.
The backward writes its zeros too (distances that read no key, tiles the window skips): the gradient is never
filled beforehand.

The algorithm is FlashAttention-2's (Dao, 2023): the forward keeps a running maximum and sum per query row and
saves their log-sum-exp; the backward recomputes each tile's probabilities from it in a program per key block (dK,
dV and the term's gradient; it runs over the query heads of the key head's group), then a program per query block
computes dQ. With the term, dQ needs no recomputation: the term enters each logit once, so its gradient, read by
distance, is the logits' gradient dS, and dQ = dS K is one product a tile (recomputing dS takes two more, and the
exponentials). Without one, the query blocks recompute dS as FlashAttention-2 does. Heads may be grouped (GQA,
MoA's shared key head): key head h // (H / Hk) serves query head h. Each loop runs over the blocks its mask leaves
something to read in (:func:`_spans`): a causal window's fully masked tiles are skipped.
"""

import functools
import math
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from switchbench.core.versions import NO_BF16_DOT, interpreted_bf16_dot
from switchbench.ops import tuned as tuning
from switchbench.ops.attention import choice
from switchbench.ops.attention.layout import empty_in_order_of, packed


@triton.jit
def _by_distance(rows, cols, t, S, P, stride):
    """Where a tile of queries x keys lies in a tensor by distance (the term, its gradient): query i meets key j
    at column t - 1 - i + j of its row. Offsets from the head's start, and the mask of those on the grid."""
    column = t - 1 - rows[:, None] + cols[None, :]
    return rows[:, None] * stride + column, (rows[:, None] < t) & (cols[None, :] < S) & (column < P)


@triton.jit
def _logits(
    q,
    k,
    pos_ptr,
    mask_ptr,
    rows,
    cols,
    t,
    S,
    P,
    stride_pos,
    stride_mask,
    scale,
    along,
    full_first,
    full_last,
    HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WHOLE_UNREAD: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    """A tile's logits [BLOCK_M, BLOCK_N] in the accumulators' dtype: scale q k^T, plus the term by distance,
    -inf off the grid and where the mask hides the key. With WHOLE_UNREAD the mask is read only outside
    [full_first, full_last), the run of the loop's tiles it leaves whole (``along``: the tile's offsets along the
    loop, its rows or its columns); inside it the load is predicated off, with no memory read, as FlashAttention
    masks only a causal window's diagonal tiles."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
    inside = (rows[:, None] < t) & (cols[None, :] < S)
    if HAS_POS:
        at, on_grid = _by_distance(rows, cols, t, S, P, stride_pos)
        term = tl.load(pos_ptr + at, mask=on_grid, other=0.0)
        s += term.to(ACC)
    if HAS_MASK:
        readable = inside
        if WHOLE_UNREAD:
            readable = readable & ((along < full_first) | (along >= full_last))
        seen = tl.load(mask_ptr + rows[:, None] * stride_mask + cols[None, :], mask=readable, other=1)
        inside = inside & (seen != 0)
    return tl.where(inside, s, float("-inf"))


@triton.jit
def _span(spans_ptr, block, length, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """The offsets [first, last) in steps of BLOCK a program's loop visits, the blocks its mask leaves something
    to read in (:func:`_spans`), or all of ``length``; and [full_first, full_last), those it leaves whole (none
    without a mask)."""
    if HAS_MASK:
        first = tl.load(spans_ptr + 4 * block) * BLOCK
        last = tl.load(spans_ptr + 4 * block + 1) * BLOCK
        full_first = tl.load(spans_ptr + 4 * block + 2) * BLOCK
        full_last = tl.load(spans_ptr + 4 * block + 3) * BLOCK
    else:
        first = 0
        last = length
        full_first = 0
        full_last = 0
    return first, last, full_first, full_last


@triton.jit
def _zero_tile(dpos_ptr, rows, cols, t, S, P, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros into the term's gradient where a tile of queries x keys no program visits reads it."""
    at, on_grid = _by_distance(rows, cols, t, S, P, stride)
    tl.store(dpos_ptr + at, tl.zeros([BLOCK_M, BLOCK_N], dpos_ptr.dtype.element_ty), mask=on_grid)


@triton.jit
def _zero_keyless(dpos_ptr, rows, columns, t, S, P, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros into the term's gradient at the queries' distance columns that read no key: left of key 0 (beyond
    each query's reach) or, without a causal mask's bound, past key S - 1."""
    key = columns[None, :] - (t - 1 - rows[:, None])
    keyless = (
        (rows[:, None] < t) & (columns[None, :] >= 0) & (columns[None, :] < P) & ((key < 0) | (key >= S))
    )
    target = dpos_ptr + rows[:, None] * stride + columns[None, :]
    tl.store(target, tl.zeros([BLOCK_M, BLOCK_N], dpos_ptr.dtype.element_ty), mask=keyless)


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    mask_ptr,
    spans_ptr,
    o_ptr,
    lse_ptr,
    H,
    group,
    t,
    S,
    P,
    width,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_s,
    sp_b,
    sp_h,
    sp_t,
    stride_mask,
    scale,
    HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)  # the term passes 2**31 elements from batch 171 at 262M
    b, h = bh // H, bh % H
    kh = h // group
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_in, dim_in = rows < t, dims < width
    at = b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :]  # o is laid out as q
    q = tl.load(q_ptr + at, mask=row_in[:, None] & dim_in[None, :], other=0.0)
    pos_ptr += b * sp_b + h * sp_h
    k_ptr += b * sk_b + kh * sk_h
    v_ptr += b * sk_b + kh * sk_h
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    total = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    first, last, full_first, full_last = _span(spans_ptr, tl.program_id(0), S, BLOCK_N, HAS_MASK)
    for start in range(first, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_in = (cols < S)[:, None] & dim_in[None, :]
        k = tl.load(k_ptr + cols[:, None] * sk_s + dims[None, :], mask=col_in, other=0.0)
        s = _logits(
            q, k, pos_ptr, mask_ptr, rows, cols, t, S, P, sp_t, stride_mask, scale, cols[None, :], full_first,
            full_last, HAS_POS, HAS_MASK, True, PRECISION, ACC,
        )  # fmt: skip
        new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(new == float("-inf"), 0.0, new)  # a row with no key yet: nothing to rescale
        p = tl.exp(s - shift[:, None])
        rescale = tl.exp(m - shift)
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(v_ptr + cols[:, None] * sk_s + dims[None, :], mask=col_in, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
        m = new
    total = tl.where(total == 0.0, 1.0, total)  # a row past the last query, or one that reads no key: o = 0
    o = acc / total[:, None]
    tl.store(o_ptr + at, o.to(o_ptr.dtype.element_ty), mask=row_in[:, None] & dim_in[None, :])
    # a row that reads no key: +inf, so that the backward's exp(s - lse) is 0, not exp(-inf + inf) = NaN
    lse = tl.where(m == float("-inf"), float("inf"), m + tl.log(total))
    tl.store(lse_ptr + bh * t + rows, lse, mask=row_in)


@triton.jit
def _key_block_backward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    mask_ptr,
    spans_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dpos_ptr,
    H,
    group,
    t,
    S,
    P,
    width,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_s,
    sp_b,
    sp_h,
    sp_t,
    stride_mask,
    sd_b,
    sd_h,
    sd_s,
    scale,
    HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dK, dV of one key block (over every query head of its key head's group) and the term's gradient of its
    tiles. do has q's strides, v k's, dpos the term's, and dk and dv theirs (``sd_*``)."""
    bkh = tl.program_id(1).to(tl.int64)
    Hk = H // group
    b, kh = bkh // Hk, bkh % Hk
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_in = (cols < S)[:, None] & (dims < width)[None, :]
    kv_at = b * sk_b + kh * sk_h + cols[:, None] * sk_s + dims[None, :]
    k = tl.load(k_ptr + kv_at, mask=col_in, other=0.0)
    v = tl.load(v_ptr + kv_at, mask=col_in, other=0.0)
    grad_at = b * sd_b + kh * sd_h + cols[:, None] * sd_s + dims[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    # The mask read in every tile: under Triton 3.9 skipping it in whole ones took the 128-channel heads' 32 x 64
    # candidate past 255 registers (an 8-byte spill on sm_90)
    first, last, _, _ = _span(spans_ptr, tl.program_id(0), t, BLOCK_M, HAS_MASK)
    for member in range(0, group):
        h = kh * group + member
        bh = b * H + h
        terms = b * sp_b + h * sp_h
        for start in range(first, last, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_in = rows < t
            at = b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :]
            tile_in = row_in[:, None] & (dims < width)[None, :]
            q = tl.load(q_ptr + at, mask=tile_in, other=0.0)
            do = tl.load(do_ptr + at, mask=tile_in, other=0.0)
            lse = tl.load(lse_ptr + bh * t + rows, mask=row_in, other=0.0)
            delta = tl.load(delta_ptr + bh * t + rows, mask=row_in, other=0.0)
            s = _logits(
                q, k, pos_ptr + terms, mask_ptr, rows, cols, t, S, P, sp_t, stride_mask, scale, rows[:, None], 0, 0,
                HAS_POS, HAS_MASK, False, PRECISION, ACC,
            )  # fmt: skip
            p = tl.exp(s - lse[:, None])
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION, out_dtype=ACC)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            if HAS_POS:
                at, on_grid = _by_distance(rows, cols, t, S, P, sp_t)
                tl.store(dpos_ptr + terms + at, ds.to(dpos_ptr.dtype.element_ty), mask=on_grid)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION, out_dtype=ACC)
        if HAS_POS:  # the query blocks the window skips read nothing here: zero
            for start in range(0, first, BLOCK_M):
                _zero_tile(
                    dpos_ptr + terms, start + tl.arange(0, BLOCK_M), cols, t, S, P, sp_t, BLOCK_M, BLOCK_N
                )
            for start in range(last, t, BLOCK_M):
                _zero_tile(
                    dpos_ptr + terms, start + tl.arange(0, BLOCK_M), cols, t, S, P, sp_t, BLOCK_M, BLOCK_N
                )
    tl.store(dk_ptr + grad_at, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_in)
    tl.store(dv_ptr + grad_at, dv.to(dv_ptr.dtype.element_ty), mask=col_in)


@triton.jit
def _query_block_backward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    mask_ptr,
    spans_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    dpos_ptr,
    H,
    group,
    t,
    S,
    P,
    width,
    sq_b,
    sq_h,
    sq_t,
    sk_b,
    sk_h,
    sk_s,
    sp_b,
    sp_h,
    sp_t,
    stride_mask,
    scale,
    HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ of one query block (do and dq have q's strides, v k's). With the term, read off its gradient, which the
    key blocks' kernel has written, and zeros written to it at the block's distance columns that read no key."""
    bh = tl.program_id(1).to(tl.int64)  # the term passes 2**31 elements from batch 171 at 262M
    b, h = bh // H, bh % H
    kh = h // group
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_in, dim_in = rows < t, dims < width
    at = b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :]
    tile_in = row_in[:, None] & dim_in[None, :]
    k_ptr += b * sk_b + kh * sk_h
    first, last, full_first, full_last = _span(spans_ptr, tl.program_id(0), S, BLOCK_N, HAS_MASK)
    if HAS_POS:
        dpos_ptr += b * sp_b + h * sp_h
        dq = _dq_from_term(dpos_ptr, k_ptr, rows, dims, first, last, t, S, P, width, sp_t, sk_s, PRECISION, ACC,
                           BLOCK_M, BLOCK_N, BLOCK_D)  # fmt: skip
        first_row = (
            tl.program_id(0) * BLOCK_M
        )  # left of key 0 up to its reach, past key S - 1 from the last row's
        for start in range(0, t - 1 - first_row, BLOCK_N):
            _zero_keyless(dpos_ptr, rows, start + tl.arange(0, BLOCK_N), t, S, P, sp_t, BLOCK_M, BLOCK_N)
        for start in range(t - first_row - BLOCK_M + S, P, BLOCK_N):
            _zero_keyless(dpos_ptr, rows, start + tl.arange(0, BLOCK_N), t, S, P, sp_t, BLOCK_M, BLOCK_N)
    else:
        q = tl.load(q_ptr + at, mask=tile_in, other=0.0)
        do = tl.load(do_ptr + at, mask=tile_in, other=0.0)
        lse = tl.load(lse_ptr + bh * t + rows, mask=row_in, other=0.0)
        delta = tl.load(delta_ptr + bh * t + rows, mask=row_in, other=0.0)
        v_ptr += b * sk_b + kh * sk_h
        dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
        for start in range(first, last, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_in = (cols < S)[:, None] & dim_in[None, :]
            k = tl.load(k_ptr + cols[:, None] * sk_s + dims[None, :], mask=col_in, other=0.0)
            v = tl.load(v_ptr + cols[:, None] * sk_s + dims[None, :], mask=col_in, other=0.0)
            s = _logits(
                q, k, pos_ptr, mask_ptr, rows, cols, t, S, P, 0, stride_mask, scale, cols[None, :], full_first,
                full_last, False, HAS_MASK, True, PRECISION, ACC,
            )  # fmt: skip
            p = tl.exp(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
    tl.store(dq_ptr + at, (dq * scale).to(dq_ptr.dtype.element_ty), mask=tile_in)


@triton.jit
def _dq_from_term(
    dpos_ptr,
    k_ptr,
    rows,
    dims,
    first,
    last,
    t,
    S,
    P,
    width,
    sp_t,
    sk_s,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ / scale of a block of queries, [BLOCK_M, BLOCK_D], as dS K: the term enters each logit once, unscaled,
    so its gradient at query i's column t - 1 - i + j is dS[i, j] (zero where masked), written by the key blocks'
    kernel in the term's dtype. One product a tile where recomputing dS from the logits takes two more, and
    exp, do, lse and v unread."""
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for start in range(first, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_ptr + cols[:, None] * sk_s + dims[None, :],
            mask=(cols < S)[:, None] & (dims < width)[None, :],
            other=0.0,
        )
        at, on_grid = _by_distance(rows, cols, t, S, P, sp_t)
        ds = tl.load(dpos_ptr + at, mask=on_grid, other=0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
    return dq


# Candidate (BLOCK_M, BLOCK_N, warps, stages) of each kernel by the widest head it serves, heads being a multiple of
# 16 channels wide (the caller pads them: at 76, 88 or 104 channels the rows' misalignment spilled). Over every
# family's training window at 47M and 262M, XL's and RoPE's (grouped heads or not, the term or none, a causal mask:
# what kernel-check compiles), every candidate compiles for sm_90 without a spill and within a block's shared
# memory, each product a pipelined wgmma, under Triton 3.6 (the GPU node's) and 3.9 alike: four that were clean
# under 3.9 alone, two of them defaults, spilled under 3.6 and were replaced. With the term
# the query blocks' kernel makes one product a tile and takes larger tiles; the first of its lists also serves it
# without one. On a GPU each launch shape runs the one measured fastest there (:mod:`~switchbench.ops.tuned`); the
# first is the default, the interpreter's and a capture's.
CONFIGS = {
    "forward": {
        64: [(128, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4)],
        128: [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    },
    "key_block": {
        64: [(32, 64, 8, 3), (16, 128, 8, 3), (32, 64, 8, 4), (16, 64, 8, 3)],
        128: [(16, 64, 8, 3), (32, 64, 8, 2), (16, 64, 8, 4), (16, 64, 8, 2)],
    },
    "query_block": {
        64: [(64, 64, 8, 2), (128, 64, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3)],
        128: [(64, 32, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
    },
}
WIDEST = choice.WIDEST["triton"]  # channels a head may have


def forward(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """q [B, H, t, D], k, v [B, Hk, S, D], pos [B, H, t, P] or None, mask [t, S] bool or None -> (o [B, H, t, D],
    the log-sum-exp of each query's logits [B * H, t] in the accumulators' dtype)."""
    (q, pos), (k, v) = _taken(q, pos), _keys_values(k, v)
    B, H, t = q.shape[:3]
    o = empty_in_order_of(q)
    lse = q.new_empty(B * H, t, dtype=accumulated(q.dtype))
    common = _common(q, k, pos, mask)
    spans = _spans_of(mask, q)

    def launch(config):
        block_m, block_n, warps, stages = config
        _forward_kernel[(triton.cdiv(t, block_m), B * H)](
            q, k, v, *common["pointers"], spans(block_m, block_n), o, lse, *common["sizes"], *common["strides"],
            scale, **common["constants"], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    _run("forward", q, k, pos, mask, launch)
    return o, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor | None,
    mask: Tensor | None,
    o: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The gradients of :func:`forward`'s o for its output gradient ``do``: dq, dk, dv and the term's (None
    without one; zero at the distances no query meets a key)."""
    (q, pos), (k, v) = _taken(q, pos), _keys_values(k, v)
    do = do if do.stride() == q.stride() else empty_in_order_of(q).copy_(do)  # o's gradient, laid out as o
    B, H, t = q.shape[:3]
    # rowsum(dO o) = rowsum(P dP), FlashAttention-2's D
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).contiguous().view(B * H, t)
    # dpos is written whole by the kernels, zero where no query meets a key (no separate fill of the [B, H, t, P]
    # tensor): timing the candidates one after another into it leaves it right
    dq, dk, dv, dpos = gradients_like(q, k, v, pos)
    common = _common(q, k, pos, mask)
    sizes, strides, constants = common["sizes"], common["strides"], common["constants"]
    per_key_block = _spans_of(None if mask is None else mask.T, q)  # per key block, its query blocks
    per_query_block = _spans_of(mask, q)

    def key_blocks(config):
        block_m, block_n, warps, stages = config
        _key_block_backward_kernel[(triton.cdiv(k.shape[2], block_n), B * k.shape[1])](
            q, k, v, *common["pointers"], per_key_block(block_n, block_m), do, lse, delta, dk, dv,
            q if dpos is None else dpos, *sizes, *strides, *dk.stride()[:3], scale, **constants, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def query_blocks(config):
        block_m, block_n, warps, stages = config
        _query_block_backward_kernel[(triton.cdiv(t, block_m), B * H)](
            q, k, v, *common["pointers"], per_query_block(block_m, block_n), do, lse, delta, dq,
            q if dpos is None else dpos, *sizes, *strides, scale, **constants, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    _run("key_block", q, k, pos, mask, key_blocks)
    _run("query_block", q, k, pos, mask, query_blocks)
    return dq, dk, dv, dpos


def _run(kernel: str, q: Tensor, k: Tensor, pos: Tensor | None, mask: Tensor | None, launch) -> None:
    """``launch(config)`` on q's device with the configuration of ``kernel`` chosen for these shapes."""
    if interpreted_bf16_dot(q.device.type, str(q.dtype)):
        raise ValueError(f"--attention triton {NO_BF16_DOT}")
    with torch.cuda.device_of(q):
        launch(_chosen(kernel, q, k, pos, mask, launch))


def _chosen(kernel: str, q: Tensor, k: Tensor, pos: Tensor | None, mask: Tensor | None, launch) -> tuple:
    """The configuration ``kernel`` runs at these shapes: the pinned one; off CUDA, the default; else the one this
    process measured or tuned ahead of time for this GPU, or else the fastest of the candidates timed now, at the
    shape's first launch (and recorded). Inside a CUDA graph's capture nothing can be timed: a shape met there
    first runs the default."""
    name, options = f"flash_{kernel}", candidates(kernel, q.shape[-1])
    label = tuning.pinned(name)
    if label is None and q.is_cuda:
        key = shape_key(q, k, pos, mask)
        label = tuning.measured(name, key) or tuning.ahead_of_time(name, key, q.device)
        if label is None and not torch.cuda.is_current_stream_capturing():
            times = [_time_if_it_fits(functools.partial(launch, config)) for config in options]
            label = config_label(options[times.index(min(times))])
            tuning.record(name, key, label)
    return options[0] if label is None else by_label(kernel, q.shape[-1], label)


def _time_if_it_fits(call) -> float:
    """:func:`_time`, or infinity for a candidate this GPU cannot launch: the lists are sized for sm_90's 227 KiB
    of shared memory a block, and a 128 x 128 forward's 160 KiB is more than an sm_89 part has. The first candidate
    of each list fits everywhere the kernels ran before the lists."""
    try:
        return _time(call)
    except OutOfResources:
        return math.inf


def _time(call, repeats: int = 5) -> float:
    """Milliseconds a call takes on the GPU: the median of a few, after one that compiles and warms it. CUDA events,
    not ``triton.testing.do_bench``: its cache-clearing buffer could run a batch that just fits out of memory."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shape_key(q: Tensor, k: Tensor, pos: Tensor | None, mask: Tensor | None) -> str:
    """The tuning key of a launch: queries and keys rounded up to powers of two (decoding's growing windows share
    a few), the head width, the dtype, whether it reads a term and a mask, and the query heads a key head serves
    where there are several (the key blocks' kernel loops over them)."""
    t, S, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    flags = ["pos"] * (pos is not None) + ["mask"] * (mask is not None) + [f"group{group}"] * (group > 1)
    dtype = str(q.dtype).removeprefix("torch.")
    return " ".join([f"{triton.next_power_of_2(t)}x{triton.next_power_of_2(S)}x{D}", dtype, *flags])


def candidates(kernel: str, D: int) -> list[tuple[int, int, int, int]]:
    """``kernel``'s candidates for heads of D channels: those for the narrowest width that holds them."""
    table = CONFIGS[kernel]
    return table[min(width for width in table if width >= D)]


def config_label(config: tuple[int, int, int, int]) -> str:
    """``M128 N64 w8 s3``: how a configuration is named in tables, kernel-check and SWITCHBENCH_TRITON_CONFIG."""
    block_m, block_n, warps, stages = config
    return f"M{block_m} N{block_n} w{warps} s{stages}"


def by_label(kernel: str, D: int, label: str) -> tuple[int, int, int, int]:
    """The candidate of ``kernel`` for heads of D channels that ``label`` names; a ValueError listing them."""
    for config in candidates(kernel, D):
        if config_label(config) == label:
            return config
    choices = ", ".join(map(config_label, candidates(kernel, D)))
    raise ValueError(f"flash_{kernel} at heads of {D} channels has no config {label!r}; one of: {choices}")


def _spans_of(mask: Tensor | None, stand_in: Tensor):
    """:func:`_spans` of ``mask`` by block sizes, each computed once."""
    return functools.cache(lambda block_rows, block_cols: _spans(mask, block_rows, block_cols, stand_in))


def _spans(mask: Tensor | None, block_rows: int, block_cols: int, stand_in: Tensor) -> Tensor:
    """For each block of ``block_rows`` rows of ``mask`` [rows, cols], the first and one past the last block of
    ``block_cols`` columns with an entry it may read, then the same of its first run of blocks whose entries it
    may all read, [row blocks, 4] int32: a kernel's loop runs over the first range and skips the rest, a causal
    window's fully masked tiles (a quarter of the 262M window's), and reads the mask outside the second only.
    Without a mask, ``stand_in`` (never read). Static shapes and no read-back: a step with it stays capturable."""
    if mask is None:
        return stand_in
    rows, cols = mask.shape
    padded = F.pad(
        mask, (0, -cols % block_cols, 0, -rows % block_rows)
    )  # the padding is hidden: no tile past
    blocks = padded.shape[1] // block_cols  # the edges is whole
    tiles = padded.view(-1, block_rows, blocks, block_cols)
    live, whole = tiles.any(3).any(1), tiles.all(3).all(1)  # [row blocks, column blocks]
    index = torch.arange(blocks, device=mask.device)
    first = torch.where(live, index, blocks).amin(1)
    last = torch.where(live, index + 1, 0).amax(1)  # a row block with nothing to read: first > last, no loop
    # the first run of whole tiles, within [first, last]; empty (at last) where there is none
    full_first = torch.minimum(torch.where(whole, index, blocks).amin(1), last)
    broken = ~whole & (index >= full_first[:, None])
    full_last = torch.maximum(torch.minimum(torch.where(broken, index, blocks).amin(1), last), full_first)
    return torch.stack([first, last, full_first, full_last], 1).to(torch.int32)


def accumulated(dtype: torch.dtype) -> torch.dtype:
    """What the kernels accumulate in: float64 for float64 (the tests' exact reference), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Layouts. The kernels take any strides but a unit one for the channels, one set for q and the tensors laid out as
# it (o, do, dq), one for k and v, one for dk and dv, one for the term and its gradient. A head-split projection,
# [B, t, H, D] viewed as [B, H, t, D], is taken as it is, and o and the gradients come out in their input's order:
# dense's O projection then reads o with no copy, and each gradient flows back into its projection with none. On an
# H200 (262M, batch 64, eager) dense spent 27.5 ms a step in strided copies of attention's tensors, 9 launches a
# layer; on the CPU, 10 of a dense XL layer's 13 copies a training step were these inputs made contiguous, twice
# (forward and backward), and the copies they caused outside.


def _taken(*tensors: Tensor | None) -> list[Tensor | None]:
    """Each tensor as the kernels take it: as it is where :func:`packed`, else contiguous."""
    return [x if x is None or packed(x) else x.contiguous() for x in tensors]


def _keys_values(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k and v as the kernels take them, on one set of strides: as they are where they share unit-stride ones with
    no broadcast dimension (slices of one projection's output, two head-split views alike), else both
    contiguous."""
    if (
        k.stride() == v.stride()
        and k.stride(-1) == 1
        and all(st or n == 1 for n, st in zip(k.shape, k.stride(), strict=True))
    ):
        return k, v
    # also where k is broadcast over heads or sequences (a zero stride): dk must not take that order
    return k.contiguous(), v.contiguous()


def output_like(q: Tensor) -> Tensor:
    """An empty o for ``q`` (as given to :func:`forward`): laid out as the kernels take q."""
    return empty_in_order_of(*_taken(q))


def gradients_like(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Empty dq, dk, dv and dpos for the inputs as given: each in its input's order as the kernels take it (dk and
    dv packed, also where k and v are slices of a wider tensor)."""
    (q, pos), k = _taken(q, pos), _keys_values(k, v)[0]
    return (
        empty_in_order_of(q),
        empty_in_order_of(k),
        empty_in_order_of(k),
        None if pos is None else empty_in_order_of(pos),
    )


def _common(q: Tensor, k: Tensor, pos: Tensor | None, mask: Tensor | None) -> dict:
    """The arguments every kernel shares: term and mask pointers (q stands in for an absent one, never read),
    sizes, strides and constexprs."""
    H, t, D = q.shape[1:]
    if D > WIDEST:
        raise ValueError(f"--attention triton takes heads of at most {WIDEST} channels; got {D}")
    S = k.shape[2]
    readable = q if mask is None else mask.contiguous().view(torch.uint8)
    terms = q if pos is None else pos
    return {
        "pointers": (terms, readable),
        "sizes": (H, H // k.shape[1], t, S, terms.shape[-1], D),
        "strides": (  # q's serve o, do and the gradients of q; k's serve v and the gradients of both
            *q.stride()[:3],
            *k.stride()[:3],
            *terms.stride()[:3],
            readable.stride(0) if mask is not None else 0,
        ),
        "constants": {
            "HAS_POS": pos is not None,
            "HAS_MASK": mask is not None,
            # float32 multiplies in TF32 only where torch's own matmuls may (models run bf16 under autocast)
            "PRECISION": "tf32"
            if q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            else "ieee",
            "ACC": tl.float64 if accumulated(q.dtype) == torch.float64 else tl.float32,
            "BLOCK_D": max(16, triton.next_power_of_2(D)),
        },
    }


def launches(
    B: int, H: int, Hk: int, t: int, S: int, D: int, dtype: torch.dtype, term: bool = True
) -> list[tuple[str, object, tuple, dict]]:
    """(pass, kernel, arguments, constexprs with the launch's configuration) of each candidate of the three
    launches of a causal window of t queries of H heads over S keys of Hk heads, with the term or without, on meta
    tensors: what kernel-check compiles ahead of time."""
    meta = {"dtype": dtype, "device": "meta"}
    q, k = torch.empty(B, H, t, D, **meta), torch.empty(B, Hk, S, D, **meta)
    pos = torch.empty(B, H, t, S, **meta) if term else None
    mask = torch.empty(t, S, dtype=torch.bool, device="meta")
    lse = torch.empty(B * H, t, dtype=accumulated(dtype), device="meta")
    common = _common(q, k, pos, mask)
    shared = (*common["sizes"], *common["strides"])
    pointers = (*common["pointers"], torch.empty(1, 4, dtype=torch.int32, device="meta"))
    dpos = q if pos is None else pos  # as backward passes it
    kernels = {
        "forward": ("forward", _forward_kernel, (q, k, k, *pointers, q, lse, *shared, 1.0)),
        "key_block": (
            "backward",
            _key_block_backward_kernel,
            (q, k, k, *pointers, q, lse, lse, k, k, dpos, *shared, *k.stride()[:3], 1.0),
        ),
        "query_block": (
            "backward",
            _query_block_backward_kernel,
            (q, k, k, *pointers, q, lse, lse, q, dpos, *shared, 1.0),
        ),
    }
    return [
        (phase, fn, args, common["constants"] | _constexprs(config))
        for name, (phase, fn, args) in kernels.items()
        for config in candidates(name, D)
    ]


def _constexprs(config: tuple[int, int, int, int]) -> dict:
    block_m, block_n, warps, stages = config
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
