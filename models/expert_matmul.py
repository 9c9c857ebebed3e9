"""The expert matmul: every token slot times the weight of the expert its router picked, gate-weighted and
summed inside the op.

One operation serves SwitchHead (V/K/Q and O experts), MoA (Q and O experts) and the sigma-MoE MLP. A token
has S slots (head x choice); slot s of token n uses expert ``indices[n, s]`` of a flat expert axis. It reads
input group ``s // (S / S_in)`` and adds into output group ``s // (S / S_out)``:

    out[n, s // (S/S_out)] += gates[n, s] * x[n, s // (S/S_in)] @ weight[indices[n, s]]

The slots are sorted by expert once per router (:func:`route`) and the sort is reused by every projection
that router drives. The backward saves only the inputs, the routing and the gates, so activation memory does
not grow with the number of active experts.
"""

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(eq=False)
class Routing:
    """Token slots grouped by expert: ``order`` lists flat slot ids n*S + s, expert by expert."""

    order: Tensor  # [M] slot ids sorted by expert, M = N*S
    experts: Tensor  # [M] expert of each sorted slot (non-decreasing)
    offsets: Tensor  # [E+1] start of each expert's run in ``order``
    n_experts: int
    slots: int  # S: slots per token

    @property
    def n_tokens(self) -> int:
        return self.order.numel() // self.slots

    @cached_property
    def padded(self) -> tuple[Tensor, int]:
        """Row of each slot (n*S + s order) in an [E, capacity] layout; capacity: the busiest load."""
        counts = self.offsets.diff()
        capacity = int(counts.max()) if self.order.numel() else 0
        rank = torch.arange(self.order.numel(), device=self.order.device) - self.offsets[self.experts]
        rows = torch.empty_like(self.order).index_copy_(0, self.order, self.experts * capacity + rank)
        return rows, capacity


def route(indices: Tensor, n_experts: int) -> Routing:
    """Sort the slots of ``indices`` [N, S] (expert ids in [0, n_experts)) by expert."""
    flat = indices.reshape(-1)
    experts, order = flat.sort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return Routing(order, experts, offsets, n_experts, indices.shape[1])


def expert_matmul(
    x: Tensor,
    weight: Tensor,
    routing: Routing,
    gates: Tensor | None = None,
    out_groups: int | None = None,
    impl: str = "torch",
) -> Tensor:
    """x [N, S_in, d_in], weight [E, d_in, d_out], gates [N, S] or None -> [N, S_out, d_out].

    ``out_groups`` (S_out) defaults to S: one output per slot, no reduction. ``impl`` names an entry of
    IMPLEMENTATIONS.
    """
    n, s_in, d_in = x.shape
    slots = routing.slots
    s_out = slots if out_groups is None else out_groups
    if n != routing.n_tokens or slots % s_in or slots % s_out:
        raise ValueError(f"x {tuple(x.shape)} and out_groups {s_out} do not fit {n} tokens x {slots} slots")
    if weight.shape[0] != routing.n_experts or weight.shape[1] != d_in:
        raise ValueError(
            f"weight {tuple(weight.shape)} does not fit {routing.n_experts} experts x {d_in} inputs"
        )
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        gates = None if gates is None else gates.to(dtype)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {', '.join(IMPLEMENTATIONS)}; got {impl!r}")
    return _ExpertMatmul.apply(x, weight, gates, routing, s_out, impl)


class _ExpertMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gates, routing, s_out, impl):
        ctx.save_for_backward(x, weight, gates)
        ctx.routing, ctx.impl = routing, impl
        return IMPLEMENTATIONS[impl][0](x, weight, gates, routing, s_out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, gates = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_g = IMPLEMENTATIONS[ctx.impl][1](grad_out, x, weight, gates, ctx.routing, needs)
        return grad_x, grad_w, grad_g, None, None, None


# PyTorch path: the slots are scattered into an [E, capacity, d] buffer and multiplied with one bmm. It is
# vectorised but pays for the padding when the load is uneven; the Triton path does not.


def _per_slot(t: Tensor, slots: int) -> Tensor:
    """[N, G, d] -> [N * slots, d]: each group's row repeated for its slots // G slots."""
    n, groups, d = t.shape
    return t[:, :, None].expand(n, groups, slots // groups, d).reshape(n * slots, d)


def _group_sum(t: Tensor, n: int, groups: int) -> Tensor:
    """[N * S, d] -> [N, groups, d]: the sum over each group's slots."""
    return t.view(n, groups, -1, t.shape[-1]).sum(2)


def _pad(rows: Tensor, routing: Routing) -> Tensor:
    index, capacity = routing.padded
    buffer = rows.new_zeros(routing.n_experts * capacity, rows.shape[1])
    return buffer.index_copy_(0, index, rows).view(routing.n_experts, capacity, -1)


def _unpad(buffer: Tensor, routing: Routing) -> Tensor:
    return buffer.view(-1, buffer.shape[-1])[routing.padded[0]]


def _forward(x, weight, gates, routing, s_out):
    n = x.shape[0]
    x_pad = _pad(_per_slot(x, routing.slots), routing)  # [E, cap, d_in]
    y = _unpad(torch.bmm(x_pad, weight), routing)  # [N * S, d_out]
    if gates is not None:
        y = y * gates.reshape(-1, 1)
    return _group_sum(y, n, s_out)


def _backward(grad_out, x, weight, gates, routing, needs):
    n, s_in, _ = x.shape
    grad = _per_slot(grad_out, routing.slots)  # [N * S, d_out]
    x_pad = _pad(_per_slot(x, routing.slots), routing)  # [E, cap, d_in]
    grad_x = grad_w = grad_g = None
    if gates is not None:
        if needs[2]:
            y = _unpad(torch.bmm(x_pad, weight), routing)  # recomputed rather than saved
            grad_g = (y * grad).sum(1).view(gates.shape)
        grad = grad * gates.reshape(-1, 1)
    grad_pad = _pad(grad, routing)  # [E, cap, d_out]
    if needs[0]:
        grad_rows = _unpad(torch.bmm(grad_pad, weight.transpose(1, 2)), routing)  # [N * S, d_in]
        grad_x = _group_sum(grad_rows, n, s_in)
    if needs[1]:
        grad_w = torch.bmm(x_pad.transpose(1, 2), grad_pad)
    return grad_x, grad_w, grad_g


# name -> (forward(x, weight, gates, routing, s_out), backward(grad_out, x, weight, gates, routing, needs))
IMPLEMENTATIONS = {"torch": (_forward, _backward)}
