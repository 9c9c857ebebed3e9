"""Rows of token slots as the expert-matmul kernels hold them: feature widths zero-padded to an alignment the
kernels need, and the per-slot rows summed back into their groups at the true width.

Shared by the implementations (triton_kernels.py, grouped.py, all_experts.py and op.py's PyTorch path).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

# A profiler range around each implementation's weight-gradient pass, so a profile can tell it from the input
# gradient (both run inside the one backward op): weight_gradient_range() below.
WEIGHT_GRADIENT_LABEL = "switchbench.expert_matmul.weight_gradient"
# A profiler range around the gates an implementation has applied outside the op (all_experts' form of one input
# group), forward, which the backward's nodes inherit: a profile counts them with the expert matmul, as it does gates
# applied inside the op, not with the routing of the module around them
GATES_LABEL = "switchbench.expert_matmul.gates"
# The Triton weight-gradient kernel, by name, as well: an H100 profile of torch 2.11 saw it outside the label when
# the label was user-scoped (see weight_gradient_range); kept for profiles that link no kernel to its range
WEIGHT_GRADIENT_KERNELS = ("_grouped_outer_kernel",)


def weight_gradient_range():
    """The profiler's range named WEIGHT_GRADIENT_LABEL, of an operator's (function) scope; free when no profiler
    runs. The profiler links a kernel to the innermost function-scope range open at its launch, and
    ``record_function``'s range is user-scoped: a kernel launched straight inside it, not from an aten operator (a
    Triton lay-out or outer product), was linked to the backward op around it and counted as the input gradient."""
    return torch._C._profiler._RecordFunctionFast(WEIGHT_GRADIENT_LABEL)


def in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, with no call where it is already: a no-op cast is still an operator the gate counts."""
    return t if t.dtype == dtype else t.to(dtype)


def aligned(t: Tensor, multiple: int) -> Tensor:
    """t with its last two dims (one for rows) zero-padded to multiples of ``multiple``; t itself when they are."""
    widths = t.shape[-2 if t.dim() > 2 else -1 :]
    pad = [0 if d % multiple == 0 else multiple - d % multiple for d in reversed(widths)]
    if not any(pad):
        return t
    return F.pad(t, [p for width in pad for p in (0, width)])


def per_slot(t: Tensor, slots: int) -> Tensor:
    """[N, G, d] -> [N * slots, d]: each group's row repeated for its slots // G slots."""
    n, groups, d = t.shape
    return t[:, :, None].expand(n, groups, slots // groups, d).reshape(n * slots, d)


def group_sum(rows: Tensor, n: int, groups: int, width: int) -> Tensor:
    """[N * S, padded width] -> [N, groups, width]: the sum over each group's slots (a view for one slot)."""
    per_group = rows.shape[0] // (n * groups) if n else 1  # no token: any count gives the same empty result
    rows = rows.view(n, groups, per_group, rows.shape[1])[..., :width]
    return rows[:, :, 0].contiguous() if rows.shape[2] == 1 else rows.sum(2)
