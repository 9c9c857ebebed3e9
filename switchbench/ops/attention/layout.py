"""Memory layouts the attention kernels take as they are: a head-split view of one projection's output, a position
term laid out head by head. A kernel that reads any such layout through its strides, and writes its outputs and
gradients in its inputs' order, spares the copies in and out that ``.contiguous()`` would make."""

from collections.abc import Sequence

from torch import Tensor


def packed(x: Tensor) -> bool:
    """Whether ``x`` is a permutation of a contiguous tensor with unit-stride channels: its elements fill their
    span with no gap, as a head-split view of one projection's output does."""
    if x.stride(-1) != 1:
        return False
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def order_of(x: Tensor) -> list[int]:
    """``x``'s dimensions outermost first in memory; a stable sort keeps ties in x's order (size-1 dimensions,
    whose strides address nothing)."""
    return sorted(range(x.dim()), key=lambda dim: -x.stride(dim))


def empty_in_order(like: Tensor, shape: Sequence[int], order: Sequence[int]) -> Tensor:
    """An uninitialised packed tensor of ``shape`` (``like``'s dtype and device), its dimensions laid out in
    ``order``, outermost first."""
    made = like.new_empty([shape[dim] for dim in order])
    return made.permute([list(order).index(dim) for dim in range(len(shape))])


def empty_in_order_of(x: Tensor) -> Tensor:
    """An uninitialised tensor of ``x``'s shape and dtype, packed, its dimensions in the order of ``x``'s strides."""
    return empty_in_order(x, x.shape, order_of(x))
