"""A position term of the logits that depends on the distance between query and key (Transformer-XL's relative
positions), and how each attention kernel reads it.

It arrives as scores by distance, [B, H, t, D]: column c is distance ``S - 1 - c``, so query i reads key j's term
in column ``t - 1 - i + j`` (the queries are the last t of the S keys). Spreading it over the [t, S] grid is what
the kernels do differently:

- the explicit kernel adds :meth:`RelativeBias.shifted`, built from views (no indexing, whose accumulating
  backward was ~70% of a dense XL training step on an H100);
- SDPA takes :meth:`RelativeBias.masked` as its float mask. On CUDA that is one Triton kernel each way, into rows
  aligned for the memory-efficient kernel. Built from views and ``masked_fill`` it took several memory-bound
  passes over [B, H, t, S] a layer each way (pads, copies, fills and two ``masked_fill``): 211 of dense's 587 ms of
  kernel time at 262M, batch 64 on an H200, against 99 ms for the attention kernels themselves;
- FlexAttention reads the scores by distance from inside its kernel (:meth:`RelativeBias.score_mod`): nothing
  [t, S] is built at all.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from switchbench.ops.attention.layout import empty_in_order, order_of, packed

IMPLS = ("torch", "triton")
# The memory-efficient SDPA kernel reads a float mask whose strides are multiples of 16 bytes and copies one that
# is not; 16 elements covers every dtype up to float64
ROW_ALIGNMENT = 16


@dataclass(frozen=True, eq=False)
class RelativeBias:
    """``scores`` [B, H, t, D] by distance, D = S (causal: no key is later than its query) or S + t - 1."""

    scores: Tensor
    keys: int  # S

    def shifted(self) -> Tensor:
        """[B, H, t, S]: entry (i, j) is column t - 1 - i + j; a causal window's future keys read zeros."""
        return relative_shift(self.scores, self.keys)

    def masked(self, mask: Tensor | None, impl: str | None = None) -> Tensor:
        """:meth:`shifted` with -inf where ``mask`` [t, S] is False: SDPA's float mask. ``impl`` (default: Triton on
        CUDA, torch elsewhere) is one of IMPLS; the Triton kernels run on the CPU under TRITON_INTERPRET=1."""
        impl = impl or ("triton" if self.scores.is_cuda else "torch")
        if impl == "triton":
            return torch.ops.switchbench.position_bias(self.scores, self.keys, mask)
        if impl != "torch":
            raise ValueError(f"position bias impl must be one of {', '.join(IMPLS)}; got {impl!r}")
        shifted = self.shifted()
        return shifted if mask is None else shifted.masked_fill(~mask, float("-inf"))

    def score_mod(self):
        """FlexAttention's ``score_mod``: the logit plus query i's score for key j, read by distance. Past the last
        distance (a causal window's future keys, which the mask removes) the column wraps around rather than
        clamps: their zero gradients then go to distinct entries, not all to one per row (FlexAttention's backward
        adds a captured tensor's gradient with atomics)."""
        scores, t, D = self.scores, self.scores.shape[-2], self.scores.shape[-1]

        def add(score, b, h, i, j):
            column = t - 1 - i + j
            return score + scores[b, h, i, torch.where(column < D, column, column - D)]

        return add


def relative_shift(scores: Tensor, S: int) -> Tensor:
    """Scores [B, H, t, D] of the distances S - 1, S - 2, ... (column c: distance S - 1 - c) -> [B, H, t, S] whose
    entry (i, j) is the score of distance i + S - t - j: query i against key j, the queries being the last t keys.

    Views, not indexing: the rows, zero-padded to width W = S + t, flattened and read back in rows of W - 1 from
    offset t - 1, start one column further left each. Entry (i, j) reads column t - 1 - i + j of padded row i:
    distance S - t + i - j. Future keys (negative distances, causal windows only) read the padding.
    """
    *batch, t, D = scores.shape
    W = S + t
    flat = F.pad(scores, (0, W - D)).flatten(-2)  # [B, H, t * W]
    return flat[..., t - 1 : t - 1 + t * (W - 1)].view(*batch, t, W - 1)[..., :S]  # [B, H, t, S]


def aligned_width(S: int) -> int:
    """The row length the Triton kernel writes a bias of S keys into: S rounded up to ROW_ALIGNMENT."""
    return -(-S // ROW_ALIGNMENT) * ROW_ALIGNMENT


# Custom ops: opaque to torch.compile (a fake implementation gives their shapes), one Triton launch each


@torch.library.custom_op("switchbench::position_bias", mutates_args=())
def _position_bias_op(scores: Tensor, S: int, mask: Tensor | None) -> Tensor:
    from switchbench.ops.attention import position_kernels

    return position_kernels.spread(scores, S, mask)


@_position_bias_op.register_fake
def _(scores, S, mask):
    return scores.new_empty(*scores.shape[:-1], aligned_width(S))[..., :S]


@torch.library.custom_op("switchbench::position_bias_backward", mutates_args=())
def _position_bias_backward_op(grad: Tensor, D: int, mask: Tensor | None, order: list[int]) -> Tensor:
    from switchbench.ops.attention import position_kernels

    return position_kernels.gather(grad, D, mask, order)


@_position_bias_backward_op.register_fake
def _(grad, D, mask, order):
    return empty_in_order(grad, (*grad.shape[:-1], D), order)


def _setup_context(ctx, inputs, output):
    scores, _, mask = inputs
    ctx.save_for_backward(mask)
    ctx.distances = scores.shape[-1]
    # the gradient laid out as the scores where the kernel can write that layout (unit-stride columns, no broadcast
    # dimension), else contiguous
    ctx.order = order_of(scores) if packed(scores) else list(range(scores.dim()))


def _backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return torch.ops.switchbench.position_bias_backward(grad, ctx.distances, mask, ctx.order), None, None


_position_bias_op.register_autograd(_backward, setup_context=_setup_context)
