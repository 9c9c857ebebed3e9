"""The expert matmul on torch's grouped GEMM: ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on a torch
without the functional form), the kernel torchtitan and Hugging Face's ``experts_implementation="grouped_mm"`` run.

The slot rows are gathered into expert order by the router's one sort (``order``, ``offsets``), and each expert's
run of rows is one group of the GEMM:

    forward       Y_e  = X_e W_e               2D x 3D, grouped along M by the experts' ends
    input grad    dX_e = dY_e W_e^T            2D x 3D, W^T a strided view (a column-major operand)
    weight grad   dW_e = X_e^T (g * dY_e)      2D x 2D, grouped along K: the contraction runs over the expert's rows
    gate grad     dg   = <dX ungated, x>       the row dot of the PyTorch path

and the results are gated, put back in slot order and summed per group. The backward keeps nothing beyond the
op's inputs: it gathers the rows again.

The library's rules, and how they are met rather than refused:
- ``offs`` are int32 cumulative ends: converted from the routing's offsets per call (E numbers).
- Every operand's leading stride must be a multiple of 16 bytes (checked on the CPU too): feature widths are
  zero-padded to 16 bytes (the 47M presets' d_model 412 and d_head 76, the 262M MoA's 146 are not aligned) and
  the results cut back; the zero columns add nothing.
- CUTLASS (sm_90 and sm_100) takes bf16 only. fp32 and fp16 on CUDA run the library's fallback, one mm per
  expert after copying the ends to the host (a sync): correct, not fast. Training runs under autocast, in bf16.
- An expert without rows is an empty group. The K-grouped form gave such experts non-zero weight gradients on
  Blackwell (pytorch#172439), so theirs are zeroed here; with no row at all the GEMM is skipped (a zero-length
  contraction passes no stride check). CUTLASS takes fewer than 1024 groups (experts); the presets use at most 64.
- float64 is refused with a ValueError, as on the Triton path; the CPU build takes fp32, fp16 and bf16.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from switchbench.ops.expert_matmul.slot_rows import aligned, group_sum, in_dtype, weight_gradient_range

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def unavailable(in_groups: int = 1, out_groups: int = 1) -> str | None:
    """Why this torch cannot run the grouped GEMM (of any groups), or None."""
    if _grouped_mm is None:
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    return None


def grouped_mm(rows: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """rows [M, K] in expert order, weight [E, K, N], ends [E] (int32, cumulative) -> [M, N]: one GEMM per
    expert's run of rows. Widths must be 16-byte multiples."""
    return _grouped_mm(rows, weight, offs=ends)


def expert_ends(offsets: Tensor) -> Tensor:
    """The routing's offsets [E + 1] as the library takes them: int32 ends [E]."""
    return offsets[1:].to(torch.int32)


def _alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: the row-width multiple every operand must have."""
    return 16 // dtype.itemsize


def _slot_rows(order: Tensor, slots: int, groups: int) -> Tensor:
    """[M]: the row of an [N * groups, d] tensor that each expert-ordered slot reads (or writes)."""
    token, s = order // slots, order % slots
    return token * groups + s // (slots // groups)


def _gathered(t: Tensor, order: Tensor, slots: int, align: int) -> Tensor:
    """t [N, groups, d] -> [M, d padded to ``align``]: each slot's row, in expert order."""
    n, groups, d = t.shape
    return aligned(t.reshape(n * groups, d), align)[_slot_rows(order, slots, groups)]


def _gates(scores: Tensor, order: Tensor, experts: Tensor, slots: int) -> Tensor:
    """[M, 1]: the router's score of each expert-ordered slot for its expert."""
    return scores[order // slots, experts][:, None]


def _unsorted(rows: Tensor, order: Tensor) -> Tensor:
    """Expert-ordered rows [M, d] back in slot order (n * S + s)."""
    return torch.empty_like(rows).index_copy_(0, order, rows)


def _weight_grad(x_rows: Tensor, grad_rows: Tensor, offsets: Tensor, ends: Tensor) -> Tensor:
    """The sum over each expert's rows of x^T g, the K-grouped GEMM -> [E, d_in, d_out]; zero where no row."""
    if x_rows.shape[0] == 0:
        return x_rows.new_zeros(ends.numel(), x_rows.shape[1], grad_rows.shape[1])
    grad_w = _grouped_mm(x_rows.t(), grad_rows, offs=ends)  # x^T: a column-major view, no copy
    return grad_w.masked_fill_((offsets.diff() == 0)[:, None, None], 0)


def _check(x: Tensor, weight: Tensor) -> None:
    reason = unavailable()
    if reason:
        raise ValueError(f"the grouped_mm expert matmul: {reason}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"the grouped_mm expert matmul takes fp32, fp16 or bf16; got {x.dtype} and {weight.dtype}"
        )


# The interface of op.py's implementations: READS_GROUPING, EVERY_EXPERT, unavailable, gates_outside,
# forward and backward.

READS_GROUPING = True  # the routing's slots in expert order
EVERY_EXPERT = False  # the routed slots' products alone


def gates_outside(in_groups: int, out_groups: int, d_in: int, d_out: int) -> bool:
    """False: the gates' gradient comes from the slots' input gradients and the inputs."""
    return False


def forward(x, weight, scores, indices, order, experts, offsets, s_out):
    _check(x, weight)
    n, slots, d_out = x.shape[0], indices.shape[1], weight.shape[2]
    align = _alignment(x.dtype)
    y = grouped_mm(
        _gathered(x, order, slots, align), aligned(weight, align), expert_ends(offsets)
    )  # [M, d_out']
    if scores is not None:
        y = y * _gates(scores, order, experts, slots)
    return group_sum(_unsorted(y, order), n, s_out, d_out)


def backward(grad_out, x, weight, scores, indices, order, experts, offsets):
    _check(x, weight)
    n, s_in, d_in = x.shape
    slots, d_out = indices.shape[1], weight.shape[2]
    align, ends = _alignment(x.dtype), expert_ends(offsets)
    x_rows = _gathered(x, order, slots, align)  # [M, d_in']
    grad_rows = _gathered(grad_out, order, slots, align)  # [M, d_out'], each slot's ungated gradient
    weight_t = aligned(weight, align).transpose(1, 2)  # a strided view: the GEMM reads W^T in place
    grad_x_rows = grouped_mm(grad_rows, weight_t, ends)  # [M, d_in'], ungated
    grad_s = x.new_empty(0)
    if scores is not None:
        # Ungated input gradients give the gate gradients as a row dot with x: no forward recomputed.
        dots = (grad_x_rows * x_rows).sum(1, dtype=torch.float32)
        grad_s = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        grad_s = in_dtype(
            grad_s.scatter_add_(1, indices, _unsorted(dots, order).view(n, slots)), scores.dtype
        )
        # in x's dtype, as its GEMMs: fp32 scores beside bf16 rows (a model served without autocast)
        gates = in_dtype(_gates(scores, order, experts, slots), x.dtype)
        grad_x_rows = grad_x_rows * gates
        # The weight gradient takes the gate once, on the narrower operand: fewer bytes.
        if d_in <= d_out:
            x_rows = x_rows * gates
        else:
            grad_rows = grad_rows * gates
    with weight_gradient_range():
        grad_w = _weight_grad(x_rows, grad_rows, offsets, ends)[:, :d_in, :d_out].contiguous()
    return group_sum(_unsorted(grad_x_rows, order), n, s_in, d_in), grad_w, grad_s
