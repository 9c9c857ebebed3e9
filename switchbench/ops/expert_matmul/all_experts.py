"""The expert matmul as dense GEMMs over every expert, gated: E / S times the routed MACs (E experts in all, S slots
a token), each GEMM as large and aligned as a dense projection's.

Where a router chooses among few experts (SwitchHead 262M: k = 2 of 4 a head, twice the routed MACs) this can beat
the routed kernels. Those gather each slot's input row, so SwitchHead's value projection reads a token's
1024-wide row once per slot, eight times; at 262M, batch 64 the roofline of ``kernel-check`` puts that op's
forward+backward at 1.7 times the time of a dense matmul of the same useful MACs on an H200, before any kernel
inefficiency. Here every row is read once and the GEMMs run at cuBLAS's rate. ``auto`` picks it only where
``kernel-tune`` measured it fastest.

Two forms, by which side of the op has one group:

- one input group (S_in = 1: SwitchHead's V, K and Q, MoA's Q, the sigma-MoE up projection): every expert's output
  is one GEMM, ``Y = x W_cat`` with ``W_cat`` [d_in, E d_out], and each slot reads its expert's columns. Backward:
  ``dY`` holds each slot's output gradient in its expert's columns (zero elsewhere), ``dx = dY W_cat^T`` and
  ``dW = x^T dY``. A gate's gradient is its slot's output dotted with the slot's output gradient: rather than
  compute the outputs again (a fourth GEMM as large as the other three), this form gates outside the op
  (:func:`gates_outside`), where autograd keeps the ungated slot outputs, [N, S, d_out];
- one output group (S_out = 1: SwitchHead's O, MoA's O, the sigma-MoE down projection): the gated inputs are laid
  out by expert, ``X[n, e]`` the sum of the gated rows of token n's slots that chose e (zero if none), and
  ``out = X_cat W_flat`` with ``W_flat`` [E d_in, d_out]. Backward: ``dX = dout W_flat^T``, each slot's rows of
  ``dX`` gated back into its input group, a gate's gradient their dot with the slot's input, ``dW = X^T dout``.

Inside the op nothing beyond its inputs is kept for the backward. The passes around the GEMMs (laying rows out by
expert and picking them back, gating and summing slots, and the gates' gradients) are one Triton kernel each on
CUDA (slot_kernels.py; the tests run them on the CPU in Triton's interpreter), where eager PyTorch makes two to seven passes over
[N, S, d] and [N, E, d] tensors: by the roofline, 0.44 ms of the value projection's 1.17 at 262M, batch 64 on an
H100, and 0.41 of the output projection's 0.78, before.
"""

import importlib.util

import torch
from torch import Tensor

from switchbench.ops.expert_matmul.slot_rows import group_sum, in_dtype, per_slot, weight_gradient_range


def unavailable(in_groups: int, out_groups: int) -> str | None:
    """Why the dense form cannot run an op of these groups, or None."""
    if in_groups != 1 and out_groups != 1:
        return f"all_experts needs one input group or one output group; got {in_groups} and {out_groups}"
    return None


def gates_outside(in_groups: int, out_groups: int, d_in: int, d_out: int) -> bool:
    """Whether the op of these groups and widths is handed no gates, its slots gated by the caller instead: the form
    of one input group, whose gate gradient needs the slots' outputs."""
    return _by_input(in_groups, out_groups, d_in, d_out)


def _by_input(in_groups: int, out_groups: int, d_in: int, d_out: int) -> bool:
    """Whether the form of one input group runs (else that of one output group): where both apply, the one whose
    [N, E, width] intermediate is narrower."""
    reason = unavailable(in_groups, out_groups)
    if reason:
        raise ValueError(reason)
    return in_groups == 1 and (out_groups != 1 or d_out <= d_in)


def _per_slot(t: Tensor, slots: int) -> Tensor:
    """[N, G, d] -> [N, slots, d]: each group's row for each of its slots."""
    return per_slot(t, slots).view(t.shape[0], slots, t.shape[2])


def _group_sum(t: Tensor, groups: int) -> Tensor:
    """[N, S, d] -> [N, groups, d]: the sum over each group's slots."""
    n, slots, d = t.shape
    return group_sum(t.reshape(n * slots, d), n, groups, d)


def _columns(indices: Tensor, width: int) -> Tensor:
    """[N, S, width]: each slot's expert id, broadcast along a row of that expert's block."""
    return indices[..., None].expand(*indices.shape, width)


def _ungated(scores: Tensor | None) -> None:
    if scores is not None:
        raise ValueError(
            "all_experts' form of one input group takes no gates: they are applied outside the op"
        )


def _gates(scores: Tensor | None, indices: Tensor) -> Tensor | None:
    return None if scores is None else scores.gather(1, indices)[..., None]  # [N, S, 1]


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused(t: Tensor) -> bool:
    """Whether the passes around the GEMMs run as Triton kernels for ``t``: on CUDA; elsewhere (or without triton)
    as eager PyTorch, which the tests hold them to. The tests run the kernels on the CPU too, in Triton's
    interpreter, by asking for them; every other CPU run stays eager (the interpreter took kernel-bench's 47M
    sweep from 9 s to 286 s)."""
    return t.is_cuda and _HAS_TRITON


def _laid_out(rows: Tensor, indices: Tensor, n_experts: int, scores: Tensor | None = None) -> Tensor:
    """rows [N, G, d] -> [N, E, d]: each expert's place the sum of the rows of the token's slots that chose it
    (slots that share an expert add up), times its score if ``scores`` is given; zero where no slot did."""
    if fused(rows):
        from switchbench.ops.expert_matmul import slot_kernels

        return slot_kernels.lay_out(rows, indices, n_experts, scores)
    n, _, d = rows.shape
    slot_rows = _per_slot(rows, indices.shape[1])
    gates = _gates(scores, indices)
    # in the rows' dtype, as the fused kernel writes them (fp32 scores beside bf16 rows promoted them)
    slot_rows = slot_rows if gates is None else in_dtype(slot_rows * gates, rows.dtype)
    return rows.new_zeros(n, n_experts, d).scatter_add_(1, _columns(indices, d), slot_rows)


def _picked(
    src: Tensor, indices: Tensor, groups: int, scores: Tensor | None = None, x: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """src [N, E, d] -> [N, groups, d]: each group's sum of its slots' rows, each its expert's, gated by ``scores``
    if given; and the scores' gradient (None without scores), each slot's ungated row dotted with its group's row
    of ``x``. Ungated, the form of one input group's output; gated, the form of one output group's input
    gradient."""
    if fused(src):
        from switchbench.ops.expert_matmul import slot_kernels

        return slot_kernels.pick(src, indices, groups, scores, x)
    rows = src.gather(1, _columns(indices, src.shape[2]))  # [N, S, d], ungated
    if scores is None:
        return _group_sum(rows, groups), None
    grad_scores = _gate_grad(rows, _per_slot(x, indices.shape[1]), scores, indices)
    return in_dtype(_group_sum(rows * _gates(scores, indices), groups), src.dtype), grad_scores


def _gate_grad(rows: Tensor, other: Tensor, scores: Tensor, indices: Tensor) -> Tensor:
    """[N, E]: each slot's row dot (in at least fp32) added into its expert's score."""
    wide = torch.promote_types(scores.dtype, torch.float32)
    dots = (rows * other).sum(-1, dtype=wide)
    grad = torch.zeros(scores.shape, dtype=wide, device=scores.device).scatter_add_(1, indices, dots)
    return in_dtype(grad, scores.dtype)


# The interface of op.py's implementations: READS_GROUPING, EVERY_EXPERT, unavailable, gates_outside,
# forward and backward.

READS_GROUPING = False  # the indices alone: handed None for the order, experts and offsets
EVERY_EXPERT = True  # E / S times the routed products


def forward(x, weight, scores, indices, order, experts, offsets, s_out):
    (n, s_in, d_in), (n_experts, _, d_out) = x.shape, weight.shape
    if _by_input(s_in, s_out, d_in, d_out):
        _ungated(scores)
        y = (x[:, 0] @ weight.permute(1, 0, 2).reshape(d_in, -1)).view(n, n_experts, d_out)
        return _picked(y, indices, s_out)[0]  # each slot's expert's row, summed in its output group
    laid_out = _laid_out(x, indices, n_experts, scores)  # [N, E, d_in], gated
    return (laid_out.view(n, n_experts * d_in) @ weight.reshape(-1, d_out)).view(n, 1, d_out)


def backward(grad_out, x, weight, scores, indices, order, experts, offsets):
    (n, s_in, d_in), (n_experts, _, d_out), s_out = x.shape, weight.shape, grad_out.shape[1]
    no_scores = x.new_empty(0)
    if _by_input(s_in, s_out, d_in, d_out):
        _ungated(scores)
        w_cat = weight.permute(1, 0, 2).reshape(d_in, -1)  # [d_in, E d_out]
        grad_y = _laid_out(grad_out, indices, n_experts).view(n, n_experts * d_out)
        grad_x = (grad_y @ w_cat.t()).view(n, 1, d_in)
        with weight_gradient_range():
            grad_w = (x[:, 0].t() @ grad_y).view(d_in, n_experts, d_out).permute(1, 0, 2).contiguous()
        return grad_x, grad_w, no_scores
    grad_laid = (grad_out[:, 0] @ weight.reshape(-1, d_out).t()).view(n, n_experts, d_in)
    grad_x, grad_scores = _picked(grad_laid, indices, s_in, scores, x)
    with weight_gradient_range():
        laid_out = _laid_out(x, indices, n_experts, scores).view(n, n_experts * d_in)  # gated
        grad_w = (laid_out.t() @ grad_out[:, 0]).view(n_experts, d_in, d_out)
    return grad_x, grad_w, no_scores if grad_scores is None else grad_scores


# The gating of the form of one input group, outside the op (``gates_outside``): a custom op of its own, one Triton
# pass each way where :func:`fused`, and opaque to torch.compile, which sees its fake implementation.


@torch.library.custom_op("switchbench::gate_sum", mutates_args=())
def gate_sum(y: Tensor, scores: Tensor, indices: Tensor, groups: int) -> Tensor:
    """Ungated slot outputs y [N, S, d] -> [N, groups, d]: each group's slots times their gates (``scores`` [N, E]
    read at ``indices`` [N, S]), summed."""
    if fused(y):
        from switchbench.ops.expert_matmul import slot_kernels

        return slot_kernels.gate_sum(y, scores, indices, groups)
    return in_dtype(_group_sum(y * _gates(scores, indices), groups), y.dtype)


@gate_sum.register_fake
def _(y, scores, indices, groups):
    return y.new_empty(y.shape[0], groups, y.shape[2])


@torch.library.custom_op("switchbench::gate_sum_backward", mutates_args=())
def _gate_sum_backward(grad: Tensor, y: Tensor, scores: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """(grad y, grad scores) for the output's ``grad`` [N, G, d]."""
    grad = in_dtype(grad, y.dtype)  # under CUDA autocast the gradient may come in fp32
    if fused(y):
        from switchbench.ops.expert_matmul import slot_kernels

        return slot_kernels.gate_sum_backward(grad, y, scores, indices)
    grad_slots = _per_slot(grad, y.shape[1])
    return grad_slots * _gates(scores, indices), _gate_grad(grad_slots, y, scores, indices)


@_gate_sum_backward.register_fake
def _(grad, y, scores, indices):
    return torch.empty_like(y), torch.empty_like(scores)


def _gate_sum_setup(ctx, inputs, output):
    y, scores, indices, _ = inputs
    ctx.save_for_backward(y, scores, indices)


def _gate_sum_grad(ctx, grad):
    y, scores, indices = ctx.saved_tensors
    grad_y, grad_scores = torch.ops.switchbench.gate_sum_backward(grad.contiguous(), y, scores, indices)
    return grad_y, grad_scores, None, None


gate_sum.register_autograd(_gate_sum_grad, setup_context=_gate_sum_setup)
