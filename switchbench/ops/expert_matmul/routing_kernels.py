"""Triton kernels of routing (``--routing triton``), for CUDA tensors (and CPU tensors under TRITON_INTERPRET=1):
the top-k of few experts and the grouping of slots by expert, each in few launches of static shape and no sort.

``top_k``: a program ranks the experts of a block of rows, an expert's rank being how many are ahead of it (larger,
or equal with a lower id), and writes the experts of ranks 0..k-1: one launch where torch's top-k over rows of four
experts (SwitchHead 262M) was the routing's largest kernel on an H200, and :func:`~switchbench.models.layers.router.
top_by_rank`, which it equals, a handful.

``group``: where a stable sort of the flat expert ids would put each slot, in two launches. ``_count_kernel``: each
program counts its span of slots per expert. ``_place_kernel``: each program reads every span's counts (a few
KiB), so it knows where each expert's run starts and how many of its slots come from earlier spans, then places
its own slots by a running count along its span. The sort it replaces, cub's radix sort, made 288 launches in SwitchHead's 262M
step at batch 8 on an H100.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

_ROWS = 128  # rows a ``top_k`` program ranks
_TILE = 4096  # one-hot entries (slots x experts) a grouping program holds at once
_SPANS = 1024  # at most this many programs group: each reads every span's counts


@triton.jit
def _top_k_kernel(
    scores_ptr, out_ptr, rows, E, stride_row, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    ok = (r < rows)[:, None] & (e < E)[None, :]
    value = tl.load(scores_ptr + r[:, None] * stride_row + e[None, :], mask=ok, other=float("-inf"))
    # NaN, which fails every comparison, counts as the largest, as in torch.topk: else two experts share rank 0 and
    # their ids' sum, past E, would be read as another head's expert
    value = tl.where(value != value, float("inf"), value)
    mine, other = value[:, :, None], value[:, None, :]  # [rows, expert, another]
    lower = e[None, None, :] < e[None, :, None]
    ahead = (other > mine) | ((other == mine) & lower)
    # a padded expert (-inf, past the last id) ranks after every real one
    rank = tl.sum(ahead.to(tl.int32), 2)
    for j in tl.static_range(K):
        expert = tl.sum(tl.where(rank == j, e[None, :], 0), 1)
        tl.store(out_ptr + r * K + j, expert.to(tl.int64), mask=r < rows)


@triton.jit
def _count_kernel(flat_ptr, counts_ptr, M, span, BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * span
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, span, SUB):
        i = start + s0 + tl.arange(0, SUB)
        ids = tl.load(flat_ptr + i, mask=i < M, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + tl.program_id(0) * BLOCK_E + e, counts)


@triton.jit
def _place_kernel(
    flat_ptr,
    counts_ptr,
    order_ptr,
    experts_ptr,
    offsets_ptr,
    M,
    E,
    span,
    n_spans,
    BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    earlier = tl.zeros((BLOCK_E,), dtype=tl.int32)  # this program's experts' slots in earlier spans
    for c0 in range(0, n_spans, SUB):
        c = c0 + tl.arange(0, SUB)
        counts = tl.load(counts_ptr + c[:, None] * BLOCK_E + e[None, :], mask=(c < n_spans)[:, None], other=0)
        total += tl.sum(counts, 0)
        earlier += tl.sum(tl.where((c < pid)[:, None], counts, 0), 0)
    run_start = tl.cumsum(total, 0) - total  # where each expert's run starts
    # the first program writes the offsets: each expert's start, and its end (the next one's start, or M)
    first = (e < E) & (tl.full((BLOCK_E,), pid, tl.int32) == 0)
    tl.store(offsets_ptr + e, run_start.to(tl.int64), mask=first)
    tl.store(offsets_ptr + e + 1, (run_start + total).to(tl.int64), mask=first)
    place = run_start + earlier  # where this program's next slot of each expert goes
    start = pid.to(tl.int64) * span
    for s0 in range(0, span, SUB):
        i = start + s0 + tl.arange(0, SUB)
        ok = i < M
        ids = tl.load(flat_ptr + i, mask=ok, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        ahead = tl.cumsum(onehot, 0) - onehot  # slots of the same expert earlier in the block
        where = tl.sum(onehot * (place[None, :] + ahead), 1)
        tl.store(order_ptr + where, i, mask=ok)
        tl.store(experts_ptr + where, ids, mask=ok)
        place += tl.sum(onehot, 0)


def top_k(candidates: Tensor, k: int) -> Tensor:
    """The experts of the k largest of ``candidates`` [..., E], largest first, ties to the lower id: [..., k] int64.
    Each program holds [rows, E, E] comparisons: for few experts (router.py's FEW_EXPERTS)."""
    *batch, E = candidates.shape
    rows = candidates.reshape(-1, E)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(*batch, k, dtype=torch.long, device=candidates.device)
    if not out.numel():
        return out
    grid, args, constants = _top_k_arguments(rows, out, k)
    with torch.cuda.device_of(rows):
        _top_k_kernel[grid](*args, **constants)
    return out


def group(flat: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order, experts, offsets) of the expert ids ``flat`` [M] (n_experts up to op.py's MAX_GROUPED), as a stable
    sort of them gives: the slot ids expert by expert, the expert of each, and where each expert's run starts [E + 1]."""
    flat = flat.contiguous()
    order, experts = torch.empty_like(flat), torch.empty_like(flat)
    offsets = flat.new_empty(n_experts + 1)
    grid, count_args, place_args, constants = _group_arguments(flat, order, experts, offsets, n_experts)
    counts = flat.new_empty(grid[0] * constants["BLOCK_E"], dtype=torch.int32)
    with torch.cuda.device_of(flat):
        _count_kernel[grid](flat, counts, *count_args, **constants)
        _place_kernel[grid](flat, counts, *place_args, **constants)
    return order, experts, offsets


def _top_k_arguments(rows: Tensor, out: Tensor, k: int):
    E = rows.shape[1]
    constants = {"K": k, "ROWS": _ROWS, "BLOCK_E": triton.next_power_of_2(E)}
    return (triton.cdiv(rows.shape[0], _ROWS),), (rows, out, rows.shape[0], E, rows.stride(0)), constants


def _group_arguments(flat: Tensor, order: Tensor, experts: Tensor, offsets: Tensor, n_experts: int):
    """(grid, the count's arguments after its first two, the placement's after its first two, constexprs): at most
    _SPANS programs, each over a span of whole blocks of SUB slots."""
    block_e = triton.next_power_of_2(n_experts)
    sub = max(16, _TILE // block_e)
    blocks = triton.cdiv(max(flat.numel(), 1), sub)
    span = triton.cdiv(blocks, min(blocks, _SPANS)) * sub
    n_spans = triton.cdiv(max(flat.numel(), 1), span)
    count_args = (flat.numel(), span)
    place_args = (order, experts, offsets, flat.numel(), n_experts, span, n_spans)
    return (n_spans,), count_args, place_args, {"BLOCK_E": block_e, "SUB": sub}


def launches(tokens: int, groups: int, experts_per_group: int, slots: int, rank: bool = True):
    """(pass, kernel, arguments, constexprs) of routing ``tokens`` whose ``slots`` choose among ``groups`` x
    ``experts_per_group`` experts, on meta tensors: what kernel-check compiles ahead of time. ``rank``: whether the
    top-k kernel runs too (few experts a group)."""
    meta = {"device": "meta"}
    flat = torch.empty(tokens * slots, dtype=torch.long, **meta)
    offsets = torch.empty(groups * experts_per_group + 1, dtype=torch.long, **meta)
    grid, count_args, place_args, constants = _group_arguments(flat, flat, flat, offsets, offsets.numel() - 1)
    counts = torch.empty(grid[0] * constants["BLOCK_E"], dtype=torch.int32, **meta)
    out = [
        ("count", _count_kernel, (flat, counts, *count_args), constants),
        ("place", _place_kernel, (flat, counts, *place_args), constants),
    ]
    if rank:
        scores = torch.empty(tokens * groups, experts_per_group, dtype=torch.float32, **meta)
        chosen = torch.empty(tokens * groups, slots // groups, dtype=torch.long, **meta)
        out.insert(0, ("top-k", _top_k_kernel, *_top_k_arguments(scores, chosen, slots // groups)[1:]))
    return out
