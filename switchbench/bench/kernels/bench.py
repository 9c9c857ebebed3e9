"""Expert-matmul throughput, op to op and kernel to kernel: every implementation of the op (PyTorch, Triton,
torch's grouped GEMM) and a practitioner's loop of one matmul per expert, against one dense matmul doing the same
useful MACs.

Each implementation is timed twice. The whole op: the routing left out (a router shares it between the
projections it drives), the gather, gate, scatter and group sums in. Its kernel alone: on rows already in expert
order, with widths already padded to 16 elements, one slot per row and no gate, so what the kernel is worth stands
apart from what its glue costs. Forward and forward+backward each, every one checked against a float64 loop of one
matmul per expert on the same inputs before it is timed; throughput as TFLOP/s, as a fraction of the dense
matmul's time and as a fraction of this device's matmul peak, measured in the same run.

The routing is timed on its own (a router's sigmoid top-k and the grouping of the slots by expert), and each case's
MoE overhead is what it costs beyond dense: its share of the routing (a router's routing is split between the
projections it drives) plus the chosen implementation's whole op, less the dense matmul of the same useful MACs.

Cases are the expert-matmul shapes of the 47M and 262M presets (SwitchHead V and O, sigma-MoE up and down, MoA Q
and O) and one expert-sized matmul as the paper measured its kernel.
"""

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path

import torch

from switchbench.bench.command import (
    DTYPES,
    Distinct,
    add_json,
    add_kernel_choices,
    device_from_args,
    emit,
    kernel_metadata,
    slug,
)
from switchbench.bench.cost import scaling
from switchbench.bench.cost.measure import free_memory, is_oom, some_case_fits
from switchbench.bench.timing.benches import unless_oom
from switchbench.bench.timing.timer import Timer, matmul_peak_tflops
from switchbench.core.environment import environment
from switchbench.core.results import nothing_measured, save_run, writable_folder
from switchbench.core.schema import first_line
from switchbench.core.sync import syncs_raise
from switchbench.models import family as registry
from switchbench.models.layers.router import sigmoid_topk
from switchbench.models.presets import PRESETS
from switchbench.ops.attention import choice as attention_choice
from switchbench.ops.attention.kernels import flash_width
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.ops.expert_matmul import grouped as expert_matmul_grouped
from switchbench.ops.expert_matmul.cases import Case
from switchbench.ops.expert_matmul.op import (
    ROUTINGS,
    expert_matmul,
    reads_grouping,
    route,
    routing_method,
    routing_selected,
    unavailable,
)
from switchbench.ops.expert_matmul.slot_rows import aligned

SIZES = ("47m", "262m")  # the roles whose presets give the shapes


def cases(role: str, batch: int) -> list[Case]:
    """Every family's expert-matmul uses at one role (its preset of that role: a size, or a speed group's RoPE
    sibling), at ``batch`` sequences; at a size of SIZES also, last, one expert's share of the first of them as a
    single matmul (SwitchHead's V: the matmul the paper measured)."""
    found = [
        replace(case, name=f"{role} {case.name}")
        for family in registry.families()
        if family.expert_matmuls and role in family.roles
        for case in family.expert_matmuls(PRESETS[family.roles[role]], batch)
    ]
    if role not in SIZES:
        return found
    first = found[0]
    share = first.tokens * (first.slots // first.groups) // first.experts_per_group
    return [*found, Case(f"{role} expert-sized", share, 1, 1, 1, 1, 1, first.d_in, first.d_out, False)]


@dataclass(frozen=True)
class AttentionShape:
    """A family's training window on Triton's flash attention, as its kernels are given it."""

    role: str  # the preset's speed group: an XL size or its RoPE sibling
    model: str
    heads: int  # query heads
    key_heads: int  # key and value heads: fewer where grouped (GQA's groups, MoA's one shared head)
    queries: int
    keys: int  # the chunk and its cached chunks
    width: int  # head channels, padded as the kernel is given them
    term: bool  # Transformer-XL's position term (RoPE has none)

    @property
    def label(self) -> str:
        return f"{self.role} {self.model} attention d{self.width}"


def attention_shapes(size: str) -> list[AttentionShape]:
    """The distinct training windows of every family at ``size`` and at its RoPE sibling (a family running
    another's attention, as SwitchAll runs SwitchHead's, adds none), each named by its first family. Its key heads
    are those the family caches for decoding; a family with no cache, or heads wider than the kernel takes (MoA at
    262M: 146 channels; ``--attention triton`` refuses it), has none."""
    families = [f for f in registry.families() if f.attention_name in (None, "dense") and f.kv_cache]
    found: dict[tuple, AttentionShape] = {}  # by everything but the role and the family
    for role in scaling.SIZES[size]:
        for family in (f for f in families if role in f.roles):
            cfg = PRESETS[family.roles[role]]
            keys = next(entry for entry in family.kv_cache(cfg) if entry.name == "k")
            S, term = cfg.T * (1 + cfg.context_blocks), cfg.pos == "xl"
            shape = AttentionShape(
                role, family.name, cfg.n_heads, keys.heads, cfg.T, S, flash_width(cfg.d_head), term
            )
            if shape.width <= attention_choice.WIDEST["triton"]:
                found.setdefault(astuple(shape)[2:], shape)
    return list(found.values())


ALIGN = 16  # elements: the kernel-only views' rows are padded to it (16 bytes and more for every dtype)


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Seeded inputs: k distinct experts per group and token, chosen uniformly. For the whole op: x, weight, scores
    and the routing; for the kernels alone, made here outside any timed region: the input rows in expert order
    ("sorted"), the same rows scattered into the PyTorch path's [E, capacity] buffer ("padded"), the weight with
    padded widths, the int32 expert ends and a routing of the sorted rows (each its own slot); for the dense
    comparators, N * S rows and one expert's weight (the op's shape), and the rows and weight of
    ``Case.projection_shape`` (a dense projection's)."""
    gen = torch.Generator().manual_seed(seed)
    k = case.slots // case.groups
    scores = torch.rand(case.tokens, case.groups, case.experts_per_group, generator=gen)
    choice = scores.argsort(-1)[..., :k] + torch.arange(case.groups)[:, None] * case.experts_per_group
    n_experts = case.groups * case.experts_per_group
    x = torch.randn(case.tokens, case.in_groups, case.d_in, generator=gen) / case.d_in**0.25
    weight = torch.randn(n_experts, case.d_in, case.d_out, generator=gen) / case.d_in**0.25
    scores = torch.rand(case.tokens, n_experts, generator=gen) if case.gated else None
    tensors = {"x": x, "weight": weight, "scores": scores}
    out = {name: None if t is None else t.to(device, dtype).requires_grad_() for name, t in tensors.items()}
    routing = route(choice.reshape(case.tokens, case.slots).to(device), n_experts)
    out["routing"] = routing
    out["dense"] = weight[0].to(device, dtype, copy=True).requires_grad_()
    rows = x[:, :1].expand(case.tokens, case.slots, case.d_in).reshape(-1, case.d_in)
    out["rows"] = rows.to(device, dtype, copy=True).requires_grad_()
    projection = (t.to(device, dtype).requires_grad_() for t in _projection_operands(case, gen))
    out["projection_rows"], out["projection"] = projection
    sorted_rows = aligned(_sorted_rows(case, out).detach(), ALIGN)  # [M, d_in']
    # detached: a view cannot be a timed leaf, which do_bench_cudagraph detaches in place before every call
    out["padded"] = _capacity_buffer(sorted_rows, routing).detach().requires_grad_()
    out["sorted"] = sorted_rows.requires_grad_()
    out["weight_aligned"] = aligned(out["weight"].detach(), ALIGN).clone().requires_grad_()
    out["ends"] = expert_matmul_grouped.expert_ends(routing.offsets)
    out["in_order"] = route(routing.experts[:, None], n_experts)  # sorted rows: the identity order
    return out


def _sorted_rows(case: Case, inputs: dict) -> torch.Tensor:
    """The input row of every slot in expert order [M, d_in]."""
    order = inputs["routing"].order
    token, s = order // case.slots, order % case.slots
    return inputs["x"][token, s // (case.slots // case.in_groups)]


def _capacity_buffer(rows: torch.Tensor, routing) -> torch.Tensor:
    """Expert-ordered rows [M, d] in an [E, capacity, d] buffer, zero past each expert's rows (the PyTorch path's
    layout; capacity = the busiest expert's rows)."""
    counts = routing.offsets.diff()
    capacity = int(counts.max()) if rows.shape[0] else 0
    rank = torch.arange(rows.shape[0], device=rows.device) - routing.offsets[routing.experts]
    buffer = rows.new_zeros(routing.n_experts * capacity, rows.shape[1])
    return buffer.index_copy_(0, routing.experts * capacity + rank, rows).view(
        routing.n_experts, capacity, -1
    )


# The timed calls: the whole op of each implementation and of the loop peer, each kernel alone, and the dense
# comparator. Each takes (case, inputs) and returns a tensor whose backward the forward+backward timing runs.


def _op(impl: str) -> Callable:
    def run(case: Case, inputs: dict):
        return expert_matmul(
            inputs["x"], inputs["weight"], inputs["routing"], inputs["scores"], case.out_groups, impl=impl
        )

    return run


def _loop(case: Case, inputs: dict):
    """One matmul (cuBLAS on a GPU) per expert over its sorted rows, gated and put back in slot order: what a
    practitioner writes first."""
    routing = inputs["routing"]
    ends = routing.offsets.tolist()
    rows = _sorted_rows(case, inputs)
    y = torch.cat([rows[a:b] @ w for a, b, w in zip(ends[:-1], ends[1:], inputs["weight"], strict=True)])
    if inputs["scores"] is not None:
        y = y * inputs["scores"][routing.order // case.slots, routing.experts][:, None]
    y = torch.empty_like(y).index_copy(0, routing.order, y)  # [N * S, d_out]
    return y.view(case.tokens, case.out_groups, -1, case.d_out).sum(2)


def _torch_kernel(case: Case, inputs: dict):
    """The PyTorch path's kernel: one bmm over the [E, capacity, d_in] buffer."""
    return torch.bmm(inputs["padded"], inputs["weight_aligned"])


def _triton_kernel(case: Case, inputs: dict):
    """The Triton kernels on rows already in expert order: each row its own slot, no gate, nothing to sum."""
    rows = inputs["sorted"][:, None]  # [M, 1, d_in']
    return expert_matmul(rows, inputs["weight_aligned"], inputs["in_order"], None, 1, impl="triton")[:, 0]


def _grouped_mm_kernel(case: Case, inputs: dict):
    """torch's grouped GEMM on rows already in expert order, its backward the library's own (the same two grouped
    GEMMs as the op's: through W^T, and K-grouped for the weight)."""
    return expert_matmul_grouped.grouped_mm(inputs["sorted"], inputs["weight_aligned"], inputs["ends"])


def _dense(case: Case, inputs: dict):
    """The same useful MACs as one dense matmul of the op's shape, [N * S, d_in] @ [d_in, d_out]: what the op's
    kernels would take without routing (``vs_dense``)."""
    return inputs["rows"] @ inputs["dense"]


def _projection(case: Case, inputs: dict):
    """The same useful MACs as a dense model's projection, each row read and written once
    (``Case.projection_shape``): what the MoE overhead is counted against."""
    return inputs["projection_rows"] @ inputs["projection"]


def _projection_operands(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded [M, K] rows and [K, N] weight of the dense projection."""
    m, k, n = case.projection_shape
    return torch.randn(m, k, generator=gen) / k**0.25, torch.randn(k, n, generator=gen) / k**0.25


def router_logits(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded router logits [N, groups, experts per group], in at least fp32 as routers keep them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(case.tokens, case.groups, case.experts_per_group, generator=gen)
    return logits.to(device, torch.promote_types(dtype, torch.float32))


def _routing(case: Case, logits: torch.Tensor, grouped: bool = True):
    """What a router does before its projections: sigmoid top-k over each group's experts, the choices on the flat
    expert axis, and where an implementation reads it, the slots grouped by expert (:func:`route`, by the method
    in force)."""
    _, chosen = sigmoid_topk(logits, case.slots // case.groups)
    first = torch.arange(case.groups, device=chosen.device)[:, None] * case.experts_per_group
    routing = route((chosen + first).reshape(case.tokens, case.slots), case.n_experts)
    if grouped:
        routing.grouped  # noqa: B018 (made on first use: here, inside the timed call)
    return routing


# The float64 references: one matmul per expert, on the inputs of the kernel-only views.


def _sorted_loop(case: Case, inputs: dict):
    ends, rows = inputs["routing"].offsets.tolist(), inputs["sorted"]
    pairs = zip(ends[:-1], ends[1:], inputs["weight_aligned"], strict=True)
    return torch.cat([rows[a:b] @ w for a, b, w in pairs])


def _capacity_loop(case: Case, inputs: dict):
    return torch.stack([rows @ w for rows, w in zip(inputs["padded"], inputs["weight_aligned"], strict=True)])


def _by_expert(case: Case, inputs: dict):
    """The loop peer's reference, which cannot be the loop itself: each expert's product over the slots whose
    router index names it, found from the indices alone (not the routing's grouping, order or ends), put in place."""
    indices = inputs["routing"].indices  # [N, S]
    rows = inputs["x"].repeat_interleave(case.slots // case.in_groups, 1)  # [N, S, d_in]
    y = rows.new_zeros(case.tokens, case.slots, case.d_out)
    for e, w in enumerate(inputs["weight"]):
        token, slot = (indices == e).nonzero(as_tuple=True)
        y = y.index_put((token, slot), rows[token, slot] @ w)
    if inputs["scores"] is not None:
        y = y * inputs["scores"].gather(1, indices)[..., None]
    return y.view(case.tokens, case.out_groups, -1, case.d_out).sum(2)


@dataclass(frozen=True)
class Peer:
    """One timed call: the implementation it measures ("" for the dense comparator), whether it is the whole op
    or the kernel alone, the inputs whose gradients it is checked in, and the float64 loop it is checked against
    (None: the dense comparator, which computes something else)."""

    run: Callable
    implementation: str
    view: str  # "op", "kernel", "dense" (the op's shape) or "projection" (a dense projection's)
    leaves: tuple[str, ...]
    reference: Callable | None


_OP = ("x", "weight", "scores")
_SORTED, _PADDED = ("sorted", "weight_aligned"), ("padded", "weight_aligned")
PEERS = {
    "torch": Peer(_op("torch"), "torch", "op", _OP, _loop),
    "triton": Peer(_op("triton"), "triton", "op", _OP, _loop),
    "grouped_mm": Peer(_op("grouped_mm"), "grouped_mm", "op", _OP, _loop),
    "all_experts": Peer(_op("all_experts"), "all_experts", "op", _OP, _loop),
    "loop": Peer(_loop, "loop", "op", _OP, _by_expert),
    "torch-kernel": Peer(_torch_kernel, "torch", "kernel", _PADDED, _capacity_loop),
    "triton-kernel": Peer(_triton_kernel, "triton", "kernel", _SORTED, _sorted_loop),
    "grouped_mm-kernel": Peer(_grouped_mm_kernel, "grouped_mm", "kernel", _SORTED, _sorted_loop),
    "dense": Peer(_dense, "", "dense", ("rows", "dense"), None),
    "dense projection": Peer(_projection, "", "projection", ("projection_rows", "projection"), None),
}
DENSE = ("dense", "dense projection")  # the comparators
PASSES = ("forward", "forward+backward")


def unsupported(impl: str, case: Case) -> str | None:
    """Why peer ``impl`` cannot run ``case`` here, or None. Widths the grouped GEMM cannot take are padded, not
    refused."""
    implementation = PEERS[impl].implementation
    if implementation in ("", "loop"):  # the dense comparator and the loop run anywhere
        return None
    return unavailable(implementation, case.in_groups, case.out_groups)


def timer(device: str, graphs: bool = False) -> Callable[..., list[float]]:
    """Milliseconds of each timed fn() call, with every tensor in ``grad_to_none`` reset before each call (not
    timed): triton's do_bench on a GPU (L2 flushed, warm-up excluded, its repeats chosen by time: a kernel of
    microseconds needs hundreds), or with ``graphs`` its do_bench_cudagraph (the calls captured in one CUDA graph
    and replayed: the GPU's time without the host's launches, L2 not flushed); the suite's Timer on the CPU."""
    if device == "cuda":
        import triton  # optional, and only installed where there is a GPU

        def gpu(fn, grad_to_none=()):
            if graphs:
                return triton.testing.do_bench_cudagraph(
                    fn, 20, grad_to_none=list(grad_to_none), return_mode="all"
                )
            return triton.testing.do_bench(fn, 25, 100, grad_to_none=list(grad_to_none), return_mode="all")

        return gpu

    clock = Timer("cpu")

    def cpu(fn, grad_to_none=(), repeats=5):
        fn()
        times = []
        for _ in range(repeats):
            for t in grad_to_none:  # as do_bench_cudagraph resets them, which refuses a view
                t.detach_().requires_grad_()
                t.grad = None
            times.append(clock(fn))
        return times

    return cpu


def _leaves(inputs: dict, names: tuple[str, ...]) -> list[torch.Tensor]:
    return [inputs[name] for name in names if inputs[name] is not None]


def outputs(case: Case, inputs: dict, impl: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Output of ``impl`` and the gradients of the inputs it is checked in, for a seeded output gradient."""
    return _outputs(case, inputs, PEERS[impl].run, PEERS[impl].leaves, seed)


def _outputs(case: Case, inputs: dict, fn: Callable, names: tuple[str, ...], seed: int = 1) -> dict:
    leaves = _leaves(inputs, names)
    for leaf in leaves:
        leaf.grad = None
    out = fn(case, inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(grad)
    result = {"out": out.detach().float()} | {
        f"grad_{n}": inputs[n].grad.float() for n in names if inputs[n] is not None
    }
    for leaf in leaves:
        leaf.grad = None
    return result


def reference(case: Case, inputs: dict, impl: str) -> dict[str, torch.Tensor]:
    """The float64 loop's output and gradients on the same values as ``impl``'s inputs."""
    peer = PEERS[impl]
    exact = inputs | {
        n: inputs[n].detach().double().requires_grad_() for n in peer.leaves if inputs[n] is not None
    }
    return _outputs(case, exact, peer.reference, peer.leaves)


def check(case: Case, inputs: dict, impl: str, dtype: torch.dtype, references: dict | None = None):
    """Largest error of ``impl`` against its float64 loop over the output and every gradient, each relative to
    the reference's largest value; and what is wrong, or None when every one is within tolerance. ``references``
    caches the loop's results by the inputs they were computed on (the same for every implementation of a case)."""
    references = {} if references is None else references
    key = (PEERS[impl].reference, PEERS[impl].leaves)
    if key not in references:
        references[key] = reference(case, inputs, impl)
    exact, got = references[key], outputs(case, inputs, impl)
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    worst, wrong = 0.0, None
    for name, ref in exact.items():
        error = ((got[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        if not error <= tolerance and wrong is None:
            wrong = f"{name} relative error {error:.2e} above {tolerance:.0e}"
        worst = max(worst, error) if error == error else float("inf")  # NaN counts as the worst
    return worst, wrong


def estimated_bytes(case: Case) -> int:
    """A lower bound of what measuring ``case`` holds: its fp32 inputs as drawn (x, weight, scores, the dense
    peers' rows and weights) and one output row per slot. Used to refuse a case before it starts."""
    m, k, n = case.projection_shape
    slots, n_experts = case.tokens * case.slots, case.groups * case.experts_per_group
    floats = (
        case.tokens * case.in_groups * case.d_in
        + n_experts * case.d_in * case.d_out
        + (case.tokens * n_experts if case.gated else 0)
        + slots * (case.d_in + case.d_out)
        + m * k
        + k * n
    )
    return 4 * floats


def measure(
    case: Case,
    impl: str,
    device: str,
    dtype: torch.dtype,
    references: dict | None = None,
    graphs: bool = False,
) -> list[dict]:
    """Forward and forward+backward timings (median and spread) of one timed call on one case, after its check
    against the float64 loop; a case that gives a wrong result is a "wrong" row with the error, and is not timed.
    With ``graphs`` each call is replayed from a CUDA graph; one that waits on the host cannot be captured and is
    an "uncapturable" row with the reason."""
    reason = unsupported(impl, case)
    if reason:  # a row without "ms": strict JSON has no NaN
        return _untimed(case, impl, "skipped", skipped=reason)
    inputs = make_inputs(case, device, dtype)
    peer = PEERS[impl]
    checked = {}
    if peer.reference is not None:
        error, wrong = check(case, inputs, impl, dtype, references)
        if wrong:  # a non-finite error (NaN, inf) is said in ``wrong``; strict JSON has no number for it
            return _untimed(
                case, impl, "wrong", error=wrong, max_rel_error=error if math.isfinite(error) else None
            )
        checked = {"max_rel_error": error}
    # the output's shape without its graph: a graph kept alive keeps the leaves' AccumulateGrad nodes on the stream
    # they were made on, and a backward captured on another waits on that stream, which ends the capture (an H200,
    # torch 2.11: "operation would make the legacy stream depend on a capturing blocking stream")
    with torch.no_grad():
        grad = torch.randn_like(peer.run(case, inputs))

    def forward():
        return peer.run(case, inputs)

    def both():
        peer.run(case, inputs).backward(grad)

    reason = (host_wait(forward) or host_wait(both)) if graphs else None
    if reason:
        return _untimed(case, impl, "uncapturable", reason=reason)
    ms = timer(device, graphs)
    try:
        times = ms(forward), ms(both, grad_to_none=_leaves(inputs, peer.leaves))
    except RuntimeError as error:
        return _untimed(case, impl, "uncapturable", reason=_failed_capture(error, graphs))
    rows = []
    for what, timed, macs in zip(PASSES, times, (case.macs, 3 * case.macs), strict=True):
        t = statistics.median(timed)
        row = {
            "case": case.name,
            "impl": impl,
            "view": peer.view,
            "pass": what,
            "status": "ok",
            "ms": t,
            "tflops": 2 * macs / t / 1e9,
        }
        rows.append(row | _spread(timed) | checked | _shape(case))
    return rows


# The routings timed per case, each as an "implementation" of view "routing": the top-k and the grouping of the
# slots by expert that the routed implementations read, and the top-k alone, all that all_experts reads
TIMED_ROUTINGS = {"routing": True, "top-k": False}


def routing_methods(device: str) -> list[str]:
    """The routing methods timed side by side on ``device``: every one, Triton's on a GPU alone (off one it runs in
    its interpreter: correct, not worth timing)."""
    return [m for m in ROUTINGS if m != "triton" or device == "cuda"]


def routing_name(name: str, method: str | None) -> str:
    """The implementation name of routing ``name`` by ``method``: the method in force (None) gives NAME, the one
    an op's routing share reads; another "NAME (METHOD)", beside it."""
    return name if method is None else f"{name} ({method})"


def routing_rows(
    case: Case,
    device: str,
    dtype: torch.dtype,
    name: str = "routing",
    graphs: bool = False,
    method: str | None = None,
) -> list[dict]:
    """The time of routing ``name`` (of TIMED_ROUTINGS) for ``case``, in a row for each pass: a router runs it once
    per step, and its backward (the gates') is in the op's. ``method``: routed that way (its rows named
    "NAME (METHOD)") rather than by the method in force (named NAME, the ones an op's routing share reads)."""
    logits = router_logits(case, device, dtype)
    impl = routing_name(name, method)

    def call():
        with routing_selected(method):
            return _routing(case, logits, TIMED_ROUTINGS[name])

    reason = host_wait(call) if graphs else None
    if reason:
        return _untimed(case, impl, "uncapturable", reason=reason)
    try:
        times = timer(device, graphs)(call)
    except RuntimeError as error:
        return _untimed(case, impl, "uncapturable", reason=_failed_capture(error, graphs))
    row = {"impl": impl, "routing": name, "view": "routing", "status": "ok", "ms": statistics.median(times)}
    method = {"method": method or routing_method(torch.device(device).type)}
    return [{"case": case.name, "pass": p} | row | _spread(times) | method | _shape(case) for p in PASSES]


def host_wait(call: Callable) -> str | None:
    """Why ``call()`` cannot be captured in a CUDA graph, found by running it once with CUDA's synchronising calls
    made errors (a copy to the host, a value read back), or None. Out of memory is raised, not a reason."""
    try:
        with syncs_raise():
            call()
    except RuntimeError as error:
        if is_oom(error):
            raise
        return str(error).strip().splitlines()[0]
    return None


def _failed_capture(error: RuntimeError, graphs: bool) -> str:
    """The reason for a row whose capture failed where host_wait saw no sync (torch ends the capture as it
    raises), so that the other implementations are still timed: kernel-tune lost every row to one, on an H200.
    Out of memory (a result its callers record) and any error outside a capture (a bug) are raised."""
    if not graphs or is_oom(error):
        raise error
    return first_line(error)


def _spread(times: list[float]) -> dict:
    return {"ms_min": min(times), "ms_max": max(times), "repeats": len(times)}


def dense_equivalent_ms(case: Case, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Median ms, per pass, of the dense projection of ``case``'s useful MACs alone (``Case.projection_shape``:
    what a dense model pays for the same work; profile's MoE overhead subtracts it)."""
    gen = torch.Generator().manual_seed(0)
    rows, weight = _projection_operands(case, gen)
    inputs = {
        name: t.to(device, dtype).requires_grad_()
        for name, t in (("projection_rows", rows), ("projection", weight))
    }
    grad = torch.randn(rows.shape[0], weight.shape[1], generator=gen).to(device, dtype)
    ms, leaves = timer(device), list(inputs.values())
    forward = ms(lambda: _projection(case, inputs))
    both = ms(lambda: _projection(case, inputs).backward(grad), grad_to_none=leaves)
    return {p: statistics.median(times) for p, times in zip(PASSES, (forward, both), strict=True)}


def routing_times(rows: list[dict], method: str | None = None) -> dict[tuple, float]:
    """{(case, tokens, pass, routing): ms} of the timed routing rows by ``method`` (default: the method in force,
    whose rows are named by their routing alone). The tokens tell a case's batches apart (kernel-tune's)."""
    return {
        (r["case"], r["shape_tokens"], r["pass"], r["routing"]): r["ms"]
        for r in rows
        if r["view"] == "routing"
        and "ms" in r
        and (r["impl"] == r["routing"] if method is None else r["method"] == method)
    }


def routing_share(routings: dict[tuple, float], row: dict) -> float | None:
    """The ms of routing that the op of ``row`` pays: what its implementation reads (the top-k, and the grouping
    of the slots by expert where it reads that), split evenly between the projections its router drives, which
    share one routing a step (``shared_by``). 0 for a case with one expert, which routes nothing; None where the
    case's routing was not timed. ``routings``: :func:`routing_times`."""
    if row["shape_groups"] * row["shape_experts_per_group"] == 1:
        return 0.0
    routing = "routing" if reads_grouping(row["impl"]) else "top-k"
    ms = routings.get((row["case"], row["shape_tokens"], row["pass"], routing))
    return None if ms is None else ms / row["shape_shared_by"]


def moe_overhead(rows: list[dict]) -> None:
    """On each chosen whole-op row of a routed case: ``routing_ms``, its share of its router's routing
    (:func:`routing_share`), and ``moe_overhead_ms``, that share plus the op less the dense projection of the same
    useful MACs: what the case costs beyond dense, in ms (negative: it saves)."""
    routings = routing_times(rows)
    dense = {(r["case"], r["pass"]): r["ms"] for r in rows if r["view"] == "projection" and "ms" in r}
    for r in rows:
        if not (r.get("chosen") and "ms" in r):
            continue
        routing, equivalent = routing_share(routings, r), dense.get((r["case"], r["pass"]))
        if routing is not None and equivalent is not None:
            r["routing_ms"], r["moe_overhead_ms"] = routing, routing + r["ms"] - equivalent


def _untimed(case: Case, impl: str, status: str, **why) -> list[dict]:
    return [
        {
            "case": case.name,
            "impl": impl,
            "view": PEERS[impl].view if impl in PEERS else "routing",  # else one of TIMED_ROUTINGS
            "pass": p,
            "status": status,
            **why,
            **_shape(case),
        }
        for p in PASSES
    ]


def _shape(case: Case) -> dict:
    """The case's shape as row fields (its test routing pattern is no shape: the benchmark draws its own)."""
    return {f"shape_{k}": v for k, v in asdict(case).items() if k != "routing"}


def default_impls(device: str, choice: str = "auto") -> list[str]:
    """With ``auto``, every implementation (off a GPU Triton runs in its interpreter: correct but not worth timing,
    so it is left out) and the loop peer; with a named one, that one; each as the whole op and its kernel alone,
    and the dense comparator."""
    if choice != "auto":
        return [name for name in (choice, f"{choice}-kernel", *DENSE) if name in PEERS]
    return [name for name, peer in PEERS.items() if device == "cuda" or peer.implementation != "triton"]


def run(
    sizes: list[str], batch: int, device: str, dtype: torch.dtype, impls: list[str], graphs: bool = False
) -> list[dict]:
    """Every case and timed call; one too large for the free memory, or that runs out of it, is an "OOM" row,
    one that computes a wrong result a "wrong" row, and the sweep goes on."""
    rows = []
    for size in sizes:
        for case in cases(size, batch):
            found = case_rows(case, device, dtype, impls, graphs)
            rows += [r | {"bucket": expert_matmul_choice.case_bucket(case, dtype)} for r in found]
    for name, field in (("dense", "vs_dense"), ("dense projection", "vs_projection")):
        dense = {(r["case"], r["pass"]): r["ms"] for r in rows if r["impl"] == name and "ms" in r}
        for r in rows:
            key = (r["case"], r["pass"])
            timed = key in dense and "ms" in r and r["view"] != "routing"
            r[field] = dense[key] / r["ms"] if timed else None
    return rows


def case_rows(
    case: Case, device: str, dtype: torch.dtype, impls: list[str], graphs: bool = False
) -> list[dict]:
    """The rows of ``impls`` on ``case`` and, where it routes, of its routings (TIMED_ROUTINGS); "OOM" rows where
    the case cannot fit or a call runs out of memory. ``graphs``: each call timed from a CUDA graph."""
    need, free = estimated_bytes(case), free_memory(device)
    if need > free:
        reason = f"needs at least {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return [r for impl in impls for r in _untimed(case, impl, "OOM", reason=reason)]
    references = {}  # the float64 loop's results, shared by the implementations of the case
    timed = {impl: lambda impl=impl: measure(case, impl, device, dtype, references, graphs) for impl in impls}
    if case.n_experts > 1:  # its routings: by the method in force, then by each other one beside it
        in_force = routing_method(torch.device(device).type)
        methods = [None, *(m for m in routing_methods(device) if m != in_force)]
        routings = {
            routing_name(name, method): lambda name=name, method=method: routing_rows(
                case, device, dtype, name, graphs, method
            )
            for method in methods
            for name in TIMED_ROUTINGS
        }
        timed = routings | timed
    rows = []
    for impl, rows_of in timed.items():
        found = unless_oom(rows_of)
        rows += _untimed(case, impl, "OOM", reason="out of memory") if found is None else found
    return rows


def mark_choice(rows: list[dict], device: str, choice: str) -> dict[str, str]:
    """Mark the whole-op rows of the implementation ``choice`` resolves to for each case (``chosen``); returns what
    it resolved to per case, and why."""
    resolved = {}
    for r in rows:
        resolution = expert_matmul_choice.lookup(torch.device(device), r["bucket"], choice)
        resolved[r["case"]] = resolution.describe()
        r["chosen"] = r["view"] == "op" and r["impl"] == resolution.impl
    return resolved


def add_sizes(parser: argparse.ArgumentParser) -> None:
    """``--sizes``: the presets whose shapes a kernel command takes, all by default (as every one of them does)."""
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        default=list(SIZES),
        action=Distinct,
        help="the presets' shapes (default: all)",
    )


def register(commands) -> None:
    parser = commands.add_parser("kernel-bench", help="expert-matmul throughput against one dense matmul")
    add_sizes(parser)
    parser.add_argument("--batch", type=int, help="sequences (default: 64 on a GPU, 1 on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bf16",
        help="the inputs' type, as autocast hands them over (default: bf16)",
    )
    parser.add_argument(
        "--out", default="results/kernels", help="folder for the JSON and CSV results (default: %(default)s)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="time each call replayed from a CUDA graph: the GPU's time without the host's launches",
    )
    add_kernel_choices(parser)
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> int:
    device = device_from_args(args.device)
    writable_folder(Path(args.out))
    batch = args.batch if args.batch is not None else 64 if device == "cuda" else 1
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if args.cuda_graphs and device != "cuda":
        raise ValueError("--cuda-graphs needs a CUDA device: a CUDA graph captures one GPU's work")
    dtype = DTYPES[args.dtype]
    impls = default_impls(device, args.expert_matmul)
    needs = {case.name: estimated_bytes(case) for size in args.sizes for case in cases(size, batch)}
    some_case_fits(needs, free_memory(device))
    rows = run(args.sizes, batch, device, dtype, impls, args.cuda_graphs)
    by_case = mark_choice(rows, device, args.expert_matmul)
    moe_overhead(rows)
    peak, peak_source = _yardstick(rows, device, dtype)
    for r in rows:
        if peak and "tflops" in r:
            r["fraction_of_matmul_peak"] = r["tflops"] / peak
    precision = f"inputs in {args.dtype}, as autocast hands them to the op; fp32 accumulation"
    metadata = environment(device) | {
        "dtype": args.dtype,
        "precision": precision,
        "batch": batch,
        "sizes": args.sizes,
        "cuda_graphs": args.cuda_graphs,
        "matmul_peak_tflops": peak,
        "matmul_peak_source": peak_source,
        **kernel_metadata(args.expert_matmul, device),
        "expert_matmul_by_case": by_case,
    }
    label = f"{slug(metadata['device'])}-{args.dtype}-b{batch}" + ("-graphs" if args.cuda_graphs else "")
    path = save_run(Path(args.out), label, metadata, rows)
    table = [
        {
            "case": r["case"],
            "pass": r["pass"],
            "impl": r["impl"] + (" *" if r["chosen"] else ""),
            "view": r["view"],
            "ms": f"{r['ms']:.3f}" if "ms" in r else r["status"],
            "TFLOP/s": f"{r['tflops']:.3g}" if "tflops" in r else "",
            "vs dense": _against(r["vs_dense"]),
            "vs projection": _against(r["vs_projection"]),
            "of peak": f"{100 * r['fraction_of_matmul_peak']:.0f}%" if "fraction_of_matmul_peak" in r else "",
            "MoE overhead": f"{r['moe_overhead_ms']:+.3f} ms" if "moe_overhead_ms" in r else "",
        }
        for r in rows
    ]
    if not args.json:
        print(
            f"{metadata['device']}, {args.dtype}, batch {batch}; vs dense = time of a dense matmul of the op's shape "
            "/ this time; vs projection = the same for a dense projection of the same MACs (each row read once); "
            f"of peak: of the measured matmul peak ({_tflops(peak)}"
            f"{'' if peak_source in (None, 'square product') else ', of ' + peak_source}); * = what --expert-matmul "
            f"{args.expert_matmul} runs for the case; MoE overhead = routing share + that op - dense projection; "
            "! = faster than a dense matmul of the same MACs: the comparator ran further below its peak (a flag on "
            "it, not a result)"
        )
    emit({"metadata": metadata, "rows": rows, "saved": str(path)}, args.json, table)
    wrong = [r for r in rows if r["status"] == "wrong"]
    if not args.json:
        print(f"saved {path} and its .csv")
    for r in wrong:
        print(f"switchbench kernel-bench: {r['impl']} on {r['case']} is wrong: {r['error']}", file=sys.stderr)
    return 1 if wrong else nothing_measured(rows, "kernel-bench", path)


def _against(ratio: float | None) -> str:
    """A dense comparator's time over an op's, marked above 1: the op did the same MACs faster than dense."""
    return "" if ratio is None else f"{100 * ratio:.0f}%" + (" !" if ratio > 1 else "")


def _yardstick(rows: list[dict], device: str, dtype: torch.dtype) -> tuple[float | None, str | None]:
    """The peak each row's fraction is of, and where it comes from: the device's square-product peak, or the
    fastest dense comparator of the run where that beat it (bf16 on a CPU without its support, whose square products
    run slower than the cases' thin ones). A dense matmul is the kind of product the peak measures, so none of them
    shows above 100%; an op that does beats every dense matmul of the run. None when nothing was timed."""
    if not any("ms" in r for r in rows):
        return None, None
    peak = matmul_peak_tflops(device, dtype)
    dense = max(
        (r for r in rows if r["impl"] in DENSE and "tflops" in r), key=lambda r: r["tflops"], default=None
    )
    if dense is None or dense["tflops"] <= peak:
        return peak, "square product"
    source = f"dense {dense['case']} {dense['pass']}: faster than the square product's {peak:.3g}"
    return dense["tflops"], source


def _tflops(peak: float | None) -> str:
    return "not measured" if peak is None else f"{peak:.3g} TFLOP/s"
