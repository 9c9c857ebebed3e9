"""The expert matmul: every token slot times the weight of the expert its router picked, gate-weighted and
summed inside the op.

One operation serves SwitchHead (V/K/Q and O experts), MoA (Q and O experts) and the sigma-MoE MLP. A token
has S slots (head x choice); slot s of token n uses expert ``indices[n, s]`` of a flat expert axis. It reads
input group ``s // (S / S_in)`` and adds into output group ``s // (S / S_out)``:

    out[n, s // (S/S_out)] += scores[n, indices[n, s]] * x[n, s // (S/S_in)] @ weight[indices[n, s]]

The gate of a slot is read from the router's scores [N, E] inside the op, so the op saves the scores the router
keeps anyway rather than k gates per token; an implementation whose gate gradient would need the slots' outputs
computed again has them gated outside instead (``gates_outside``), where autograd keeps them.

The slots are grouped by expert once per router (:func:`route`), on first use, and the grouping is reused by
every projection that router drives; where all of them compute every expert (all_experts) it is never made. The
op is a torch.library custom op (``switchbench::expert_matmul``, with a fake implementation for torch.compile and
the FLOP counters); its backward saves only the inputs, the routing and the scores, so activation memory does not
grow with the number of active experts.

Layers: Triton kernels (triton_kernels.py), torch's grouped GEMM (grouped.py), dense GEMMs over every expert
(all_experts.py) or the PyTorch path below -> custom ops -> autograd -> :func:`expert_matmul`. Which one runs is
chosen per call (choice.py): ``impl=``, the choice in force (``--expert-matmul``), SWITCHBENCH_EXPERT_MATMUL, or
``auto``: the measured fastest for this device and shape, else Triton on CUDA and PyTorch elsewhere.
"""

import contextlib
import importlib.util
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from switchbench.core.choice import Choice, traced_once
from switchbench.core.precision import autocast_dtype
from switchbench.ops.expert_matmul import all_experts as expert_matmul_all_experts
from switchbench.ops.expert_matmul import grouped as expert_matmul_grouped
from switchbench.ops.expert_matmul.cases import Case
from switchbench.ops.expert_matmul.choice import IMPLS, measured_routing, resolve, shape_bucket
from switchbench.ops.expert_matmul.slot_rows import GATES_LABEL, in_dtype, per_slot, weight_gradient_range


@dataclass(eq=False)
class Routing:
    """A router's choice, ``indices`` [N, S]: the expert (of ``n_experts``) of each token's S slots, and the slots
    grouped by expert: ``order`` lists flat slot ids n*S + s expert by expert, ``experts`` the expert of each,
    ``offsets`` [E+1] where each expert's run starts. The grouping (``by`` one of ROUTINGS, :func:`route`) is
    made on first use, once for every projection the router drives, and not at all where none reads it: the
    all-experts implementation reads ``indices`` alone."""

    indices: Tensor
    n_experts: int
    by: str = "sort"
    # the grouping once made; a plain field, which torch.compile traces (functools.cached_property takes a lock)
    _grouped: tuple[Tensor, Tensor, Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def slots(self) -> int:
        return self.indices.shape[1]

    @property
    def n_tokens(self) -> int:
        return self.indices.shape[0]

    @property
    def grouped(self) -> tuple[Tensor, Tensor, Tensor]:
        """(order, experts, offsets)."""
        if self._grouped is None:
            self._grouped = _group(self.indices.reshape(-1), self.n_experts, self.by)
        return self._grouped

    @property
    def order(self) -> Tensor:
        return self.grouped[0]

    @property
    def experts(self) -> Tensor:
        return self.grouped[1]

    @property
    def offsets(self) -> Tensor:
        return self.grouped[2]


ROUTINGS = ("sort", "count", "triton")
# the most experts the Triton grouping counts in registers (its one-hot tiles are slots x experts); more are sorted
MAX_GROUPED = 128
ENV_ROUTING = "SWITCHBENCH_ROUTING"
# auto is the method kernel-tune measured fastest on this GPU (choice.py's table), else the sort: on the CPU the
# count was slower (one thread: 1.4x at 1,024 tokens x 4 slots over 10 experts, 11x at 4,096 x 8 over 32), and on a
# GPU neither the count nor the Triton kernels have been measured yet
ROUTING_CHOICES = ("auto", *ROUTINGS)
_ROUTING = Choice("routing", ENV_ROUTING, ROUTING_CHOICES)
routing_selected = _ROUTING.selected
routing_choice = _ROUTING.choice


@traced_once
def routing_method(device_type: str) -> str:
    """How :func:`route` groups slots here: the choice in force (``SWITCHBENCH_ROUTING``), auto being the method
    measured fastest on this GPU, else the sort."""
    named = _ROUTING.choice()
    method = named if named != "auto" else measured_routing(torch.device(device_type)) or "sort"
    _ROUTING.record(device_type, method)
    return method


def route(indices: Tensor, n_experts: int, by: str | None = None) -> Routing:
    """The routing of ``indices`` [N, S] (expert ids in [0, n_experts)), its slots to be grouped by expert, each
    expert's slots in their flat order (a stable sort's order), ``by`` one of ROUTINGS (default:
    :func:`routing_method`).

    ``count`` finds each slot's place from a running count of the slots per expert: a comparison with every expert
    id, one cumulative sum over the expert-major one-hot and a scatter, a few kernels of O(N S E) elementwise work
    with static shapes. A router chooses among few experts (SwitchHead 262M: 4 heads x 4), where that is less work
    than a general sort, whose radix passes were the largest kernels of SwitchHead's routing on an H100.
    ``triton`` counts the same way in two Triton launches (routing_kernels.py) for up to MAX_GROUPED experts, and
    sorts past that. ``sort`` is the stable sort, kept as the reference the tests hold the others to.
    """
    by = by or routing_method(indices.device.type)
    if by not in ROUTINGS:
        raise ValueError(f"route by one of {', '.join(ROUTINGS)}, not {by!r}")
    return Routing(indices, n_experts, by)


def _group(flat: Tensor, n_experts: int, by: str) -> tuple[Tensor, Tensor, Tensor]:
    """(order, experts, offsets) of the slots ``flat`` [M] grouped by expert, :func:`route`'s way ``by``."""
    if by == "triton" and n_experts <= MAX_GROUPED:
        return tuple(torch.ops.switchbench.group_slots(flat, n_experts))
    if by in ("sort", "triton"):
        experts, order = flat.sort(stable=True)
        # each expert's run starts where a binary search of the sorted ids puts it: a count by scatter_add's atomics
        # on a few addresses was 5.2 ms of SwitchHead's 262M step on an H200 (batch 64), longer than the sort
        ids = torch.arange(n_experts + 1, device=flat.device, dtype=experts.dtype)
        return order, experts, torch.searchsorted(experts, ids)
    # One scan over the one-hot [E, M], expert-major and flattened: entry (e, m) counts the slots of the experts below
    # e and those of e up to m, one past where slot m goes if its expert is e; a row's last entry is where the next
    # expert's run starts. A 1-D scan is one fast kernel on CUDA; a scan down the M axis of [M, E] runs as E serial
    # threads (pytorch/pytorch#122170)
    ids = torch.arange(n_experts, device=flat.device)
    onehot = (ids[:, None] == flat).to(torch.int32)
    running = onehot.view(-1).cumsum(0, dtype=torch.int32).view(n_experts, -1)
    ends = running[:, -1].long() if flat.numel() else ids.new_zeros(n_experts)
    place = running.gather(0, flat[None, :]).squeeze(0).long() - 1  # where each slot goes
    order = torch.empty_like(flat).scatter_(0, place, torch.arange(flat.numel(), device=flat.device))
    return order, flat[order], torch.cat([ends.new_zeros(1), ends])


def expert_matmul(
    x: Tensor,
    weight: Tensor,
    routing: Routing,
    scores: Tensor | None = None,
    out_groups: int | None = None,
    impl: str | None = None,
) -> Tensor:
    """x [N, S_in, d_in], weight [E, d_in, d_out], router scores [N, E] or None (no gates) -> [N, S_out, d_out].

    ``out_groups`` (S_out) defaults to S: one output per slot, no reduction. ``impl``: one of IMPLS, or "auto";
    default: the choice in force.
    """
    n, s_in, d_in = x.shape
    slots = routing.slots
    s_out = slots if out_groups is None else out_groups
    if n != routing.n_tokens or slots % s_in or slots % s_out:
        raise ValueError(f"x {tuple(x.shape)} and out_groups {s_out} do not fit {n} tokens x {slots} slots")
    if weight.shape[0] != routing.n_experts or weight.shape[1] != d_in:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit {routing.n_experts} experts x {d_in} in")
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:
        x, weight = in_dtype(x, dtype), in_dtype(weight, dtype)
        scores = None if scores is None else in_dtype(scores, dtype)
    if impl is None or impl == "auto":
        gated = scores is not None
        bucket = shape_bucket(
            routing.indices.numel(), d_in, weight.shape[2], x.dtype, gated, slots, routing.n_experts
        )
        impl = resolve(x.device, bucket, impl)
    if impl not in IMPLS:
        raise ValueError(f"expert matmul impl must be one of {', '.join(IMPLS)} or auto; got {impl!r}")
    grouped = routing.grouped if reads_grouping(impl) else (None, None, None)
    if scores is not None and _implementation(impl).gates_outside(s_in, s_out, d_in, weight.shape[2]):
        # each slot's output, ungated: autograd keeps it for the gates' gradient, which the op would compute again
        y = torch.ops.switchbench.expert_matmul(x, weight, None, routing.indices, *grouped, slots, impl)
        # the label only where a profiler can see it: torch.compile drops it, with a warning
        with contextlib.nullcontext() if torch.compiler.is_compiling() else record_function(GATES_LABEL):
            return expert_matmul_all_experts.gate_sum(y, scores, routing.indices, s_out)
    return torch.ops.switchbench.expert_matmul(x, weight, scores, routing.indices, *grouped, s_out, impl)


# Custom ops


@torch.library.custom_op("switchbench::group_slots", mutates_args=())
def _group_slots_op(flat: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    from switchbench.ops.expert_matmul import routing_kernels

    return routing_kernels.group(flat, n_experts)


@_group_slots_op.register_fake
def _(flat, n_experts):
    return torch.empty_like(flat), torch.empty_like(flat), flat.new_empty(n_experts + 1)


@torch.library.custom_op("switchbench::top_k_by_rank", mutates_args=())
def _top_k_by_rank_op(candidates: Tensor, k: int) -> Tensor:
    from switchbench.ops.expert_matmul import routing_kernels

    return routing_kernels.top_k(candidates, k)


@_top_k_by_rank_op.register_fake
def _(candidates, k):
    return candidates.new_empty(*candidates.shape[:-1], k, dtype=torch.long)


def top_k_by_rank(candidates: Tensor, k: int) -> Tensor:
    """router.py's ``top_by_rank`` in one Triton launch, over [..., E] for few experts (it compares every pair): the
    experts of the k largest, largest first, ties to the lower id."""
    return torch.ops.switchbench.top_k_by_rank(candidates.detach(), k)


@torch.library.custom_op("switchbench::expert_matmul", mutates_args=())
def _expert_matmul_op(
    x: Tensor,
    weight: Tensor,
    scores: Tensor | None,
    indices: Tensor,
    order: Tensor | None,
    experts: Tensor | None,
    offsets: Tensor | None,
    s_out: int,
    impl: str,
) -> Tensor:
    # x's dtype, as its fake says: fp32 scores beside bf16 inputs (a model served without autocast) promoted the
    # PyTorch paths' outputs to fp32, where Triton's kernels write bf16
    return in_dtype(
        _implementation(impl).forward(x, weight, scores, indices, order, experts, offsets, s_out), x.dtype
    )


@_expert_matmul_op.register_fake
def _(x, weight, scores, indices, order, experts, offsets, s_out, impl):
    return x.new_empty(x.shape[0], s_out, weight.shape[2])


@torch.library.custom_op("switchbench::expert_matmul_backward", mutates_args=())
def _expert_matmul_backward_op(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    scores: Tensor | None,
    indices: Tensor,
    order: Tensor | None,
    experts: Tensor | None,
    offsets: Tensor | None,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (grad_x, grad_weight, grad_scores); grad_scores is empty when there are no scores.

    ``grad_out`` may come in any floating dtype: under CUDA autocast the gradient reaching the op can be fp32
    while its saved inputs are bf16, so it is cast to the forward's compute dtype (x's) first.
    """
    grad_out = in_dtype(grad_out, x.dtype)
    return _implementation(impl).backward(grad_out, x, weight, scores, indices, order, experts, offsets)


@_expert_matmul_backward_op.register_fake
def _(grad_out, x, weight, scores, indices, order, experts, offsets, impl):
    grad_scores = x.new_empty(0) if scores is None else torch.empty_like(scores)
    return torch.empty_like(x), torch.empty_like(weight), grad_scores


def _setup_context(ctx, inputs, output):
    x, weight, scores, indices, order, experts, offsets, _, impl = inputs
    ctx.save_for_backward(x, weight, scores, indices, order, experts, offsets)
    ctx.impl = impl


def _backward(ctx, grad_out):
    x, weight, scores, *routing = ctx.saved_tensors
    grad_x, grad_w, grad_s = torch.ops.switchbench.expert_matmul_backward(
        grad_out.contiguous(), x, weight, scores, *routing, ctx.impl
    )
    return grad_x, grad_w, None if scores is None else grad_s, None, None, None, None, None, None


_expert_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def unavailable(impl: str, in_groups: int = 1, out_groups: int = 1) -> str | None:
    """Why implementation ``impl`` cannot run an op of ``in_groups`` input and ``out_groups`` output groups on this
    machine, or None (the default groups, which every implementation takes, ask of the machine alone)."""
    if impl == "triton" and importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return _implementation(impl).unavailable(in_groups, out_groups)


def executed_macs(case: Case, impl: str) -> int:
    """Forward MACs an expert matmul of ``case`` executes on implementation ``impl``: the useful ones, or every
    expert's for one that computes them all (``EVERY_EXPERT``). The PyTorch path's padding to the busiest expert
    depends on the routing and is not counted."""
    experts = case.n_experts if _implementation(impl).EVERY_EXPERT else case.slots
    return case.tokens * experts * case.d_in * case.d_out


def reads_grouping(impl: str) -> bool:
    """Whether implementation ``impl`` reads the routing's grouping of slots by expert (else its indices alone, and
    a router none of whose projections reads it makes none)."""
    return _implementation(impl).READS_GROUPING


def _implementation(impl: str):
    if impl == "triton":
        from switchbench.ops.expert_matmul import triton_kernels as expert_matmul_triton

        return expert_matmul_triton
    return {"grouped_mm": expert_matmul_grouped, "all_experts": expert_matmul_all_experts}.get(
        impl, TorchExpertMatmul
    )


# The PyTorch path: slots scattered into an [E, capacity, d] buffer (capacity = the busiest expert's load) and
# multiplied with one bmm. Vectorised and exact, but it pays for the padding when the load is uneven.


class TorchExpertMatmul:
    READS_GROUPING = True  # the routing's slots in expert order
    EVERY_EXPERT = False  # the routed slots' products alone

    @staticmethod
    def unavailable(in_groups, out_groups):
        return None

    @staticmethod
    def gates_outside(in_groups, out_groups, d_in, d_out):
        return False

    @staticmethod
    def forward(x, weight, scores, indices, order, experts, offsets, s_out):
        n = x.shape[0]
        if indices.numel() <= weight.shape[0]:  # a few tokens (decoding): each slot reads its expert's matrix
            return _gathered(x, weight, scores, indices, s_out)
        rows, capacity = _padded_rows(order, experts, offsets)
        x_pad = _pad(per_slot(x, indices.shape[1]), rows, capacity, weight.shape[0])  # [E, cap, d_in]
        y = _unpad(torch.bmm(x_pad, weight), rows)  # [N * S, d_out]
        if scores is not None:
            y = y * scores.gather(1, indices).reshape(-1, 1)
        return _group_sum(y, n, s_out)

    @staticmethod
    def backward(grad_out, x, weight, scores, indices, order, experts, offsets):
        n, s_in, _ = x.shape
        n_experts, slots = weight.shape[0], indices.shape[1]
        rows, capacity = _padded_rows(order, experts, offsets)
        x_slots = per_slot(x, slots)  # [N * S, d_in]
        grad_pad = _pad(per_slot(grad_out, slots), rows, capacity, n_experts)  # [E, cap, d_out], ungated
        # Ungated input gradients give the gate gradients as a row-dot with x: no forward recomputed.
        grad_rows = _unpad(torch.bmm(grad_pad, weight.transpose(1, 2)), rows)  # [N * S, d_in]
        grad_s = x.new_empty(0)
        if scores is not None:
            # in x's dtype, as its GEMMs: fp32 scores beside bf16 inputs (a model served without autocast)
            gates = in_dtype(scores.gather(1, indices).reshape(-1, 1), x.dtype)
            grad_s = torch.zeros_like(scores).scatter_add_(
                1, indices, in_dtype((grad_rows * x_slots).sum(1).view(n, slots), scores.dtype)
            )
            grad_rows, x_slots = grad_rows * gates, x_slots * gates
        with weight_gradient_range():
            grad_w = torch.bmm(_pad(x_slots, rows, capacity, n_experts).transpose(1, 2), grad_pad)
        return _group_sum(grad_rows, n, s_in), grad_w, grad_s


def _gathered(x: Tensor, weight: Tensor, scores: Tensor | None, indices: Tensor, s_out: int) -> Tensor:
    """The forward for no more slots than experts, as gpt-fast decodes its MoE: each slot's expert matrix gathered
    (a copy of at most as many matrices as there are experts) and applied by one batched matmul, without the padded
    path's sort-order bookkeeping and its capacity's host sync, which a decoded token's few slots do not repay."""
    n, slots = indices.shape
    y = torch.bmm(per_slot(x, slots)[:, None], weight[indices.reshape(-1)])[:, 0]  # [N * S, d_out]
    if scores is not None:
        y = y * scores.gather(1, indices).reshape(-1, 1)
    return _group_sum(y, n, s_out)


def _padded_rows(order: Tensor, experts: Tensor, offsets: Tensor) -> tuple[Tensor, int]:
    """Row of each slot (n*S + s order) in the [E, capacity] buffer, and the capacity."""
    capacity = int(offsets.diff().max()) if order.numel() else 0
    rank = torch.arange(order.numel(), device=order.device) - offsets[experts]
    return torch.empty_like(order).index_copy_(0, order, experts * capacity + rank), capacity


def _group_sum(t: Tensor, n: int, groups: int) -> Tensor:
    """[N * S, d] (or [N, S, d]) -> [N, groups, d]: the sum over each group's slots."""
    d = t.shape[-1]
    per_group = t.numel() // max(n * groups * d, 1)  # spelt out: of no tokens, view cannot infer it
    return t.view(n, groups, per_group, d).sum(2)


def _pad(rows: Tensor, index: Tensor, capacity: int, n_experts: int) -> Tensor:
    buffer = rows.new_zeros(n_experts * capacity, rows.shape[1])
    return buffer.index_copy_(0, index, rows).view(n_experts, capacity, rows.shape[1])


def _unpad(buffer: Tensor, index: Tensor) -> Tensor:
    return buffer.view(-1, buffer.shape[-1])[index]
