"""Triton kernels of the expert matmul, for CUDA tensors (and CPU tensors under TRITON_INTERPRET=1).

``scatter_matmul``: tiles of BLOCK_M slots, laid out expert by expert over the sorted slots, gather
their input rows, multiply them by their expert's weight with fp32 accumulation, scale by the gate and write
one row per slot; the rows are then summed per output group. ``grouped_outer`` accumulates the weight
gradient x^T g over each expert's slots. No capacity, no dropped token; an expert with no slot gets a zero
gradient.

Autotuning is keyed on the token-slot count rounded up to a power of two, so a new batch size or length
reuses the tuning of its bucket.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tile(offsets_ptr, pid, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert of the pid-th tile and its slot range [start, end); empty past the last tile."""
    e_ids = tl.arange(0, BLOCK_E)
    lo = tl.load(offsets_ptr + e_ids, mask=e_ids < n_experts, other=0)
    hi = tl.load(offsets_ptr + e_ids + 1, mask=e_ids < n_experts, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_end <= pid).to(tl.int32), 0)
    mine = e_ids == e
    start = (
        tl.sum(tl.where(mine, lo, 0), 0) + (pid - tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)) * BLOCK_M
    )
    end = tl.sum(tl.where(mine, hi, 0), 0)
    return tl.minimum(e, n_experts - 1), start, end


@triton.jit
def _scatter_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    scores_ptr,
    order_ptr,
    offsets_ptr,
    n_experts,
    d_in,
    d_out,
    slots,
    in_groups,
    m_bucket,  # autotuning key only
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    HAS_GATES: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, start, end = _tile(offsets_ptr, tl.program_id(0), n_experts, BLOCK_M, BLOCK_E)
    i = start + tl.arange(0, BLOCK_M)
    row_ok = i < end
    slot = tl.load(order_ptr + i, mask=row_ok, other=0).to(tl.int64)
    in_row = (slot // slots) * in_groups + (slot % slots) // (slots // in_groups)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(start < end, d_in, 0)  # an empty tile skips the loop
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + in_row[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_ok[:, None] & (k[None, :] < d_in),
            other=0.0,
        )
        b = tl.load(
            w_ptr + e * stride_we + k[:, None] * stride_wk + n[None, :] * stride_wn,
            mask=(k[:, None] < d_in) & (n[None, :] < d_out),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_GATES:
        gate = tl.load(scores_ptr + (slot // slots) * n_experts + e, mask=row_ok, other=0.0)
        acc = acc * gate.to(tl.float32)[:, None]
    tl.store(
        y_ptr + slot[:, None] * d_out + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (n[None, :] < d_out),
    )


@triton.jit
def _grouped_outer_kernel(
    x_ptr,
    g_ptr,
    dw_ptr,
    scores_ptr,
    order_ptr,
    offsets_ptr,
    n_experts,
    d_in,
    d_out,
    slots,
    in_groups,
    out_groups,
    m_bucket,  # autotuning key only
    stride_xm,
    stride_xk,
    stride_gm,
    stride_gn,
    HAS_GATES: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for i0 in range(start, end, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        row_ok = i < end
        slot = tl.load(order_ptr + i, mask=row_ok, other=0).to(tl.int64)
        token, s = slot // slots, slot % slots
        in_row = token * in_groups + s // (slots // in_groups)
        out_row = token * out_groups + s // (slots // out_groups)
        a = tl.load(
            x_ptr + in_row[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_ok[:, None] & (k[None, :] < d_in),
            other=0.0,
        )
        b = tl.load(
            g_ptr + out_row[:, None] * stride_gm + n[None, :] * stride_gn,
            mask=row_ok[:, None] & (n[None, :] < d_out),
            other=0.0,
        )
        if HAS_GATES:
            gate = tl.load(scores_ptr + token * n_experts + e, mask=row_ok, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * gate[:, None]).to(a.dtype)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    dw = dw_ptr + e.to(tl.int64) * d_in * d_out + k[:, None] * d_out + n[None, :]
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=(k[:, None] < d_in) & (n[None, :] < d_out))


_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for m, n, k, w, s in [
        (64, 64, 32, 4, 4),
        (64, 128, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (128, 128, 32, 8, 3),
        (128, 128, 64, 8, 3),
        (64, 64, 64, 4, 3),
        (128, 64, 64, 4, 3),
        (64, 128, 64, 4, 3),
    ]
]
_KEY = ["m_bucket", "d_in", "d_out"]
_INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
_scatter_matmul_tuned = triton.autotune(_CONFIGS, key=_KEY)(_scatter_matmul_kernel)
_grouped_outer_tuned = triton.autotune(_CONFIGS, key=_KEY)(_grouped_outer_kernel)


_recorded: list | None = None


@contextlib.contextmanager
def recording():
    """Collect (kernel, autotuner, args, constexprs) of each launch instead of running it: kernel-check
    compiles the launches of meta tensors ahead of time."""
    global _recorded
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None


def _launch(kernel, tuned, grid, *args, **constants):
    """The autotuned kernel on a GPU; one fixed small configuration in the (slow) interpreter."""
    if _recorded is not None:
        _recorded.append((kernel, tuned, args, constants))
    elif os.environ.get("TRITON_INTERPRET") == "1":
        kernel[grid(_INTERPRETER_CONFIG)](*args, **constants, **_INTERPRETER_CONFIG)
    else:
        tuned[grid](*args, **constants)


def _precision(dtype: torch.dtype) -> str:
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 and os.environ.get("TRITON_INTERPRET") != "1" else "ieee"


def scatter_matmul(rows, in_groups, weight, scores, slots, order, offsets) -> Tensor:
    """rows [N * in_groups, d_in], weight [E, d_in, d_out] (any strides), scores [N, E] or None
    -> one row per slot [N * slots, d_out]."""
    n_experts, d_in, d_out = weight.shape
    m = order.numel()
    y = rows.new_empty(m, d_out)
    if m == 0:
        return y

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) + n_experts, triton.cdiv(d_out, meta["BLOCK_N"]))

    _launch(
        _scatter_matmul_kernel,
        _scatter_matmul_tuned,
        grid,
        rows,
        weight,
        y,
        scores,
        order,
        offsets,
        n_experts,
        d_in,
        d_out,
        slots,
        in_groups,
        triton.next_power_of_2(m),
        rows.stride(0),
        rows.stride(1),
        *weight.stride(),
        HAS_GATES=scores is not None,
        PRECISION=_precision(rows.dtype),
        BLOCK_E=triton.next_power_of_2(n_experts),
    )
    return y


def grouped_outer(x_rows, in_groups, grad_rows, out_groups, scores, slots, order, offsets, n_experts):
    """Sum over each expert's slots of x_row^T (gate * grad_row) -> [E, d_in, d_out]."""
    d_in, d_out = x_rows.shape[1], grad_rows.shape[1]
    m = order.numel()
    dw = x_rows.new_empty(n_experts, d_in, d_out)

    def grid(meta):
        return (n_experts, triton.cdiv(d_in, meta["BLOCK_K"]), triton.cdiv(d_out, meta["BLOCK_N"]))

    _launch(
        _grouped_outer_kernel,
        _grouped_outer_tuned,
        grid,
        x_rows,
        grad_rows,
        dw,
        scores,
        order,
        offsets,
        n_experts,
        d_in,
        d_out,
        slots,
        in_groups,
        out_groups,
        triton.next_power_of_2(max(m, 1)),
        x_rows.stride(0),
        x_rows.stride(1),
        grad_rows.stride(0),
        grad_rows.stride(1),
        HAS_GATES=scores is not None,
        PRECISION=_precision(x_rows.dtype),
    )
    return dw


# The interface of models.expert_matmul's implementations.


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def forward(x, weight, scores, indices, order, experts, offsets, s_out):
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"the Triton expert matmul takes fp32, fp16 or bf16; got {x.dtype} and {weight.dtype}"
        )
    n, s_in, d_in = x.shape
    slots = indices.shape[1]
    y = scatter_matmul(
        x.reshape(n * s_in, d_in), s_in, weight, scores, slots, order, offsets
    )  # [N * S, d_out]
    return y.view(n, s_out, -1, weight.shape[2]).sum(2)


def backward(grad_out, x, weight, scores, indices, order, experts, offsets):
    n, s_in, d_in = x.shape
    s_out, d_out = grad_out.shape[1:]
    slots = indices.shape[1]
    x_rows, grad_rows = x.reshape(n * s_in, d_in), grad_out.reshape(n * s_out, d_out)
    weight_t = weight.transpose(1, 2)  # a strided view: the kernel reads W^T in place
    # Ungated input gradients per slot; the gate gradients are their row-dot with x, no forward recomputed.
    grad_slots = scatter_matmul(grad_rows, s_out, weight_t, None, slots, order, offsets)  # [N * S, d_in]
    grad_w = grouped_outer(x_rows, s_in, grad_rows, s_out, scores, slots, order, offsets, weight.shape[0])
    grad_s = x.new_empty(0)
    grad_slots = grad_slots.view(n, s_in, slots // s_in, d_in)
    if scores is not None:
        gates = scores.gather(1, indices).view(n, s_in, slots // s_in, 1)
        grad_gates = (grad_slots.float() * x[:, :, None].float()).sum(-1).view(n, slots)
        grad_s = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        grad_s = grad_s.scatter_add_(1, indices, grad_gates).to(scores.dtype)
        grad_slots = grad_slots * gates
    return grad_slots.sum(2), grad_w, grad_s
