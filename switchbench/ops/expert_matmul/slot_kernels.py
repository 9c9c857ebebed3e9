"""Triton kernels of all_experts' passes around its GEMMs, for CUDA tensors (and CPU tensors under
TRITON_INTERPRET=1): each one memory-bound pass where eager PyTorch makes two to four, and none materialises a
[N, S, d] intermediate it does not return.

A token's slots s = 0..S-1 choose experts ``indices[n, s]`` of a flat axis of E; slot s belongs to group
``s // (S / G)`` of a side with G groups. A slot's gate is its expert's score, ``scores[n, indices[n, s]]``, so
slots of one token that share an expert share a gate.

- ``lay_out``: [N, G, d] rows -> [N, E, d], each expert's place the sum of the (gated) rows of the token's slots
  that chose it, zero where none did: the input of the GEMM over every expert (the form of one output group) and
  the output gradient of the GEMM (the form of one input group). Every place is written, so no zero fill.
- ``gate_sum``: ungated slot outputs [N, S, d] -> [N, G, d], each group's slots gated and summed.
- ``gate_sum_backward``: its gradients in one pass: each slot's output gradient (its group's, gated) and each
  score's, the dot of the group's output gradient with the slots' outputs that read it.
- ``pick``: [N, E, d] -> [N, G, d], each group's sum of its slots' (gated) rows, each slot reading its expert's,
  and the scores' gradient from the same rows: the input gradient of the form of one output group; ungated, the
  output of the form of one input group.

Each accumulates in fp32 (fp64 for fp64 inputs).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from switchbench.core.launch_log import LaunchLog

_TOKENS = 32  # tokens a program takes
_WIDTH = 128  # features a program (or one step of its loop) takes


@triton.jit
def _lay_out_kernel(
    rows_ptr,
    scores_ptr,
    indices_ptr,
    out_ptr,
    N,
    E,
    d,
    S: tl.constexpr,
    PER: tl.constexpr,  # slots a group of rows: S / G
    GATED: tl.constexpr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACC: tl.constexpr,  # the accumulator's type: fp32, fp64 for fp64
):
    n = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    e = tl.program_id(1)
    c = tl.program_id(2) * WIDTH + tl.arange(0, WIDTH)
    token, column = n < N, c < d
    acc = tl.zeros((TOKENS, WIDTH), dtype=ACC)
    for s in range(S):
        chose = tl.load(indices_ptr + n * S + s, mask=token, other=-1) == e
        row = tl.load(
            rows_ptr + (n * (S // PER) + s // PER)[:, None] * d + c[None, :],
            mask=chose[:, None] & column[None, :],
            other=0.0,
        )
        acc += row.to(ACC)
    if GATED:
        acc *= tl.load(scores_ptr + n * E + e, mask=token, other=0.0).to(ACC)[:, None]
    tl.store(
        out_ptr + (n * E + e)[:, None] * d + c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token[:, None] & column[None, :],
    )


@triton.jit
def _gate_sum_kernel(
    y_ptr,
    scores_ptr,
    indices_ptr,
    out_ptr,
    N,
    E,
    d,
    S: tl.constexpr,
    PER: tl.constexpr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACC: tl.constexpr,  # the accumulator's type: fp32, fp64 for fp64
):
    n = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    g = tl.program_id(1)
    c = tl.program_id(2) * WIDTH + tl.arange(0, WIDTH)
    token, column = n < N, c < d
    both = token[:, None] & column[None, :]
    acc = tl.zeros((TOKENS, WIDTH), dtype=ACC)
    for j in range(PER):
        s = g * PER + j
        expert = tl.load(indices_ptr + n * S + s, mask=token, other=0)
        gate = tl.load(scores_ptr + n * E + expert, mask=token, other=0.0).to(ACC)
        y = tl.load(y_ptr + (n * S + s)[:, None] * d + c[None, :], mask=both, other=0.0)
        acc += gate[:, None] * y.to(ACC)
    tl.store(
        out_ptr + (n * (S // PER) + g)[:, None] * d + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=both
    )


@triton.jit
def _gate_sum_backward_kernel(
    grad_ptr,
    y_ptr,
    scores_ptr,
    indices_ptr,
    grad_y_ptr,
    grad_scores_ptr,
    N,
    E,
    d,
    S: tl.constexpr,
    PER: tl.constexpr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACC: tl.constexpr,  # the accumulator's type: fp32, fp64 for fp64
    BLOCK_E: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    token = n < N
    experts = tl.arange(0, BLOCK_E)
    grad_scores = tl.zeros((TOKENS, BLOCK_E), dtype=ACC)
    for s in range(S):
        expert = tl.load(indices_ptr + n * S + s, mask=token, other=0)
        gate = tl.load(scores_ptr + n * E + expert, mask=token, other=0.0).to(ACC)
        dot = tl.zeros((TOKENS,), dtype=ACC)
        for c0 in range(0, d, WIDTH):
            c = c0 + tl.arange(0, WIDTH)
            both = token[:, None] & (c < d)[None, :]
            grad = tl.load(
                grad_ptr + (n * (S // PER) + s // PER)[:, None] * d + c[None, :], mask=both, other=0.0
            )
            y = tl.load(y_ptr + (n * S + s)[:, None] * d + c[None, :], mask=both, other=0.0)
            dot += tl.sum(grad.to(ACC) * y.to(ACC), 1)
            grad_y = (gate[:, None] * grad.to(ACC)).to(grad_y_ptr.dtype.element_ty)
            tl.store(grad_y_ptr + (n * S + s)[:, None] * d + c[None, :], grad_y, mask=both)
        grad_scores += tl.where(experts[None, :] == expert[:, None], dot[:, None], 0.0)
    out = grad_scores_ptr + n[:, None] * E + experts[None, :]
    tl.store(
        out, grad_scores.to(grad_scores_ptr.dtype.element_ty), mask=token[:, None] & (experts < E)[None, :]
    )


@triton.jit
def _pick_kernel(
    src_ptr,
    x_ptr,
    scores_ptr,
    indices_ptr,
    out_ptr,
    grad_scores_ptr,
    N,
    E,
    d,
    S: tl.constexpr,
    PER: tl.constexpr,
    GATED: tl.constexpr,
    TOKENS: tl.constexpr,
    WIDTH: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    token = n < N
    experts = tl.arange(0, BLOCK_E)
    grad_scores = tl.zeros((TOKENS, BLOCK_E), dtype=ACC)
    for g in range(S // PER):
        row = n * (S // PER) + g
        for c0 in range(0, d, WIDTH):
            c = c0 + tl.arange(0, WIDTH)
            both = token[:, None] & (c < d)[None, :]
            acc = tl.zeros((TOKENS, WIDTH), dtype=ACC)
            if GATED:  # the group's input row, which each of its slots' gradient rows is dotted with
                x = tl.load(x_ptr + row[:, None] * d + c[None, :], mask=both, other=0.0).to(ACC)
            for j in range(PER):
                expert = tl.load(indices_ptr + n * S + g * PER + j, mask=token, other=0)
                rows = src_ptr + (n * E + expert)[:, None] * d + c[None, :]
                src = tl.load(rows, mask=both, other=0.0).to(ACC)
                if GATED:
                    grad_scores += tl.where(
                        experts[None, :] == expert[:, None], tl.sum(src * x, 1)[:, None], 0.0
                    )
                    src *= tl.load(scores_ptr + n * E + expert, mask=token, other=0.0).to(ACC)[:, None]
                acc += src
            tl.store(out_ptr + row[:, None] * d + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=both)
    if GATED:
        out = grad_scores_ptr + n[:, None] * E + experts[None, :]
        tl.store(
            out,
            grad_scores.to(grad_scores_ptr.dtype.element_ty),
            mask=token[:, None] & (experts < E)[None, :],
        )


def lay_out(rows: Tensor, indices: Tensor, n_experts: int, scores: Tensor | None = None) -> Tensor:
    """rows [N, G, d] -> [N, E, d]: each expert's place the sum of the rows of the token's slots that chose it
    (``indices`` [N, S]), times its score [N, E] if given; zero where no slot did."""
    (n, groups, d), slots = rows.shape, indices.shape[1]
    out = rows.new_empty(n, n_experts, d)
    grid = (triton.cdiv(n, _TOKENS), n_experts, triton.cdiv(d, _WIDTH))
    constants = {
        "S": slots,
        "PER": slots // groups,
        "GATED": scores is not None,
        "TOKENS": _TOKENS,
        "WIDTH": _WIDTH,
    }
    _launch(_lay_out_kernel, grid, rows, scores, indices, out, n, n_experts, d, **constants)
    return out


def gate_sum(y: Tensor, scores: Tensor, indices: Tensor, groups: int) -> Tensor:
    """Ungated slot outputs y [N, S, d] -> [N, groups, d]: each group's slots times their gates, summed."""
    (n, slots, d), n_experts = y.shape, scores.shape[1]
    out = y.new_empty(n, groups, d)
    grid = (triton.cdiv(n, _TOKENS), groups, triton.cdiv(d, _WIDTH))
    constants = {"S": slots, "PER": slots // groups, "TOKENS": _TOKENS, "WIDTH": _WIDTH}
    _launch(_gate_sum_kernel, grid, y, scores, indices, out, n, n_experts, d, **constants)
    return out


def gate_sum_backward(grad: Tensor, y: Tensor, scores: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`gate_sum` for its output's ``grad`` [N, G, d]: (of y [N, S, d], of scores [N, E])."""
    (n, slots, d), n_experts = y.shape, scores.shape[1]
    grad_y = y.new_empty(y.shape)  # row-major whatever y's strides: the kernel writes it so
    grad_scores = scores.new_empty(scores.shape)
    # half the tokens of the forward's: with 32, the 47M value projection spilled 40 bytes under triton 3.6 (sm_90)
    constants = {
        "S": slots,
        "PER": slots // grad.shape[1],
        "TOKENS": _TOKENS // 2,
        "WIDTH": min(_WIDTH // 2, triton.next_power_of_2(d)),
    }
    constants["BLOCK_E"] = triton.next_power_of_2(n_experts)
    args = (grad, y, scores, indices, grad_y, grad_scores, n, n_experts, d)
    _launch(_gate_sum_backward_kernel, (triton.cdiv(n, constants["TOKENS"]),), *args, **constants)
    return grad_y, grad_scores


def pick(
    src: Tensor, indices: Tensor, groups: int, scores: Tensor | None = None, x: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """src [N, E, d] -> [N, groups, d]: each group's sum of its slots' rows of src, each row its expert's (times
    its score if ``scores`` [N, E] is given); and then the scores' gradient [N, E], each slot's row of src dotted
    with its group's row of ``x`` [N, groups, d] (the form of one output group's input gradient)."""
    (n, n_experts, d), slots = src.shape, indices.shape[1]
    out = src.new_empty(n, groups, d)
    grad_scores = None if scores is None else scores.new_empty(scores.shape)
    # gated, half the tokens and a quarter of the width of the other kernels: with the scores' gradient
    # [tokens, E] held, 32 tokens spilled on sm_90, and 64 features did at MoA's 262M output projection under
    # triton 3.6. Ungated (a forward's pick), the other kernels' blocks: wider rows, fewer programs
    gated = scores is not None
    tokens, width = (_TOKENS // 2, _WIDTH // 4) if gated else (_TOKENS, _WIDTH)
    constants = {"S": slots, "PER": slots // groups, "GATED": gated, "TOKENS": tokens}
    constants |= {
        "WIDTH": min(width, triton.next_power_of_2(d)),
        "BLOCK_E": triton.next_power_of_2(n_experts),
    }
    args = (src, x, scores, indices, out, grad_scores, n, n_experts, d)
    _launch(_pick_kernel, (triton.cdiv(n, constants["TOKENS"]),), *args, **constants)
    return out, grad_scores


_LOG = LaunchLog()  # while recording, each launch's (kernel, arguments, constexprs)
recording = _LOG.recording


def _launch(kernel, grid, first: Tensor, *args, **constants) -> None:
    """One launch of ``kernel`` over ``grid`` (none for an empty one), accumulating in fp32 (fp64 for fp64). The
    kernels index every tensor as row-major: inputs are made so here (outputs, allocated so by the caller, pass
    through as themselves). A missing tensor, unread, stands in as ``first``."""
    constants["ACC"] = tl.float64 if first.dtype == torch.float64 else tl.float32
    tensors = (
        first.contiguous(),
        *(first if a is None else a.contiguous() if isinstance(a, Tensor) else a for a in args),
    )
    if _LOG.launches is not None:
        _LOG.launches.append((kernel, tensors, constants))
    elif min(grid):
        with torch.cuda.device_of(first):
            kernel[grid](*tensors, **constants)
