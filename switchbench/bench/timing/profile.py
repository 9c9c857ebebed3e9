"""``switchbench profile``: where the time of a training step (or a forward pass) goes, in named shares.

A step runs under ``torch.profiler``. Every unit of device time is counted once: on a GPU each kernel's duration,
on the CPU each operator's self time (its time less its children's). An operator and the kernels it launched are
never both counted. Each unit is given one share by what it belongs to:

- the module it ran in, found through labels that forward hooks put around the routers, the attention core
  and the norms for the profiled step only (the models carry no profiling code);
- for the backward, the module of the forward operator that made the autograd node (the profiler records the
  node's sequence number on both sides);
- the operator itself (a sort is routing, a copy is a copy, a matmul outside any labelled module a dense GEMM);
- the expert matmul's own passes, from its custom operators and the weight-gradient label its implementations
  set.

What no unit covers (the host between operators on the CPU, a GPU with no kernel running) is the share
"outside kernels", so the shares add up to the profiled step.
"""

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent

from switchbench.bench.command import (
    DTYPES,
    add_json,
    add_kernel_choices,
    at_least,
    describe_kernels,
    device_from_args,
    kernel_metadata,
    slug,
)
from switchbench.bench.kernels.bench import dense_equivalent_ms
from switchbench.bench.timing.benches import fitted_batch, model_benches, too_large
from switchbench.bench.timing.speed import GROUPS, MFU_CONVENTION, PAPER_GPU_BATCH, named_once
from switchbench.bench.timing.timer import Timer, intra_op_threads, matmul_peak_tflops
from switchbench.core import optim, precision
from switchbench.core.environment import environment
from switchbench.core.profiler import profiled
from switchbench.core.results import save_run, writable_folder
from switchbench.models import family as registry
from switchbench.models.presets import from_name, language_model
from switchbench.ops.expert_matmul.slot_rows import (
    GATES_LABEL,
    WEIGHT_GRADIENT_KERNELS,
    WEIGHT_GRADIENT_LABEL,
)

EXPERT_FORWARD, EXPERT_INPUT, EXPERT_WEIGHT = (
    "expert matmul: forward",
    "expert matmul: input gradient",
    "expert matmul: weight gradient",
)
SHARES = (
    EXPERT_FORWARD,
    EXPERT_INPUT,
    EXPERT_WEIGHT,
    "attention",
    "routing",
    "dense GEMMs",
    "norms and elementwise",
    "optimizer",
    "copies and casts",
    "other",
    "outside kernels",
)
STEP_LABEL = "switchbench.profile.step"
MODULE_LABEL = "switchbench.module:"  # + role
EXPERT_OP, EXPERT_BACKWARD_OP = "switchbench::expert_matmul", "switchbench::expert_matmul_backward"
BACKWARD_NODE = "autograd::engine::evaluate_function"  # the range of one autograd node's backward
OPERATORS = ("aten::", "switchbench::")  # dispatcher operators; other events are labels and autograd's own

GEMMS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::einsum",
}
ROUTING_OPS = {
    "aten::sort",
    "aten::topk",
    "aten::argsort",
    "aten::cumsum",
    "aten::scatter_add_",
    "aten::bincount",
}
GATHER_OPS = {
    "aten::index",
    "aten::index_select",
    "aten::index_copy_",
    "aten::index_add_",
    "aten::gather",
    "aten::scatter",
    "aten::scatter_",
    "aten::scatter_add_",
    "aten::index_put_",
    "aten::_index_put_impl_",
}
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::to", "aten::cat"}


# Which module a unit of time ran in


def module_roles(model: nn.Module) -> dict[nn.Module, str]:
    """The labelled modules of ``model``: routers, the attention core (scores, softmax, values, positions),
    norms, and the MoE layers whose other work (top-k, sort, counts) is routing."""
    roles = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("router"):
            roles[module] = "routing"
        elif leaf == "attention":
            roles[module] = "attention"
        elif isinstance(module, nn.LayerNorm):
            roles[module] = "norms"
        elif any(child.endswith("router") for child, _ in module.named_children()):
            roles[module] = "moe"
    return roles


class _Labels:
    """Forward hooks that wrap each labelled module's call in a profiler range named after its role."""

    def __init__(self, roles: dict[nn.Module, str]):
        self.roles, self.open = roles, []

    def __enter__(self):
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._exit, always_call=True),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args):
        if module in self.roles:
            label = torch.profiler.record_function(MODULE_LABEL + self.roles[module])
            label.__enter__()
            self.open.append(label)

    def _exit(self, module, args, output):
        if module in self.roles:
            self.open.pop().__exit__(None, None, None)


# From profiler events to timed units with their context


@dataclass(frozen=True)
class Unit:
    """Device time ``us`` of one kernel (or, on the CPU, one operator's self time), named ``name``, run by the
    innermost operator ``op`` inside ``context`` (labels and operators, outermost first)."""

    us: float
    name: str
    op: str
    context: tuple[str, ...]


def _chain(event: FunctionEvent) -> list[FunctionEvent]:
    """``event`` and its ancestors, outermost first."""
    chain = []
    while event is not None:
        chain.append(event)
        event = event.cpu_parent
    return chain[::-1]


def _backward_node(chain: list[FunctionEvent]) -> FunctionEvent | None:
    return next((e for e in reversed(chain) if e.name.startswith(BACKWARD_NODE)), None)


def _forward_contexts(events: Iterable[FunctionEvent]) -> dict[tuple[int, int], tuple[str, ...]]:
    """(thread, sequence number) of each autograd node -> the labels and expert ops around the forward operator
    that made it (the last forward event that carries the number; earlier ones only read the counter)."""
    contexts = {}
    for event in sorted(events, key=lambda e: e.time_range.start):
        if event.sequence_nr < 0:
            continue
        chain = _chain(event)
        if _backward_node(chain) is None:
            names = tuple(e.name for e in chain if e.name.startswith((MODULE_LABEL, EXPERT_OP, GATES_LABEL)))
            contexts[(event.thread, event.sequence_nr)] = names
    return contexts


def units(events: list[FunctionEvent], device: str) -> tuple[list[Unit], float]:
    """The timed units under the profiled steps, and the steps' total time (µs).

    A unit belongs to a step when it starts inside the step's range, on whatever thread: on CUDA autograd runs
    the backward on a device thread of its own, outside the step label's thread. A CUDA kernel takes the context
    of its launch (the runtime call that started it, found by correlation id), which sits inside the labels that
    were open then: the weight-gradient label around a Triton launch, say, which is no operator and so never
    the kernel's innermost one."""
    # the host's range only: on CUDA the label comes back a second time, as a gpu_user_annotation over its kernels
    spans = [
        e.time_range
        for e in events
        if e.name == STEP_LABEL and e.device_type == torch.autograd.DeviceType.CPU
    ]
    forward = _forward_contexts(events)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    inside = [e for e in host if any(s.start <= e.time_range.start <= s.end for s in spans)]
    if device == "cuda":
        found = _kernel_units(events, inside, forward)
    else:  # an operator's self time; labels' and autograd's own are the host's, outside
        found = [
            Unit(e.self_cpu_time_total, e.name, *_op_context(e, forward))
            for e in inside
            if e.name.startswith(OPERATORS)
        ]
    return found, sum(s.elapsed_us() for s in spans)


def _kernel_units(events: list[FunctionEvent], inside: list[FunctionEvent], forward: dict) -> list[Unit]:
    """Each kernel launched inside a step, with its launch's context. The runtime call of a launch and its kernel
    share a correlation id and link to the same operator; where the profiler gives no such link (an older torch),
    a kernel takes its operator's context."""
    linked = [e for e in inside if getattr(e, "linked_correlation_id", 0) > 0]
    if not linked:
        # A kernel is attached to every host event of its launch's correlation id, and a profiler's overhead
        # record may carry its operator's id (pytorch/pytorch#193924): one holder per id, the operator first
        holders = {}
        for e in (e for e in inside if e.kernels):
            if e.id not in holders or (
                e.name.startswith(OPERATORS) > holders[e.id].name.startswith(OPERATORS)
            ):
                holders[e.id] = e
        return [
            Unit(k.duration, k.name, *_op_context(e, forward)) for e in holders.values() for k in e.kernels
        ]
    launches = {(e.id, e.linked_correlation_id): e for e in linked}
    found = []
    for kernel in events:
        launch = launches.get((kernel.id, getattr(kernel, "linked_correlation_id", 0)))
        if kernel.device_type == torch.autograd.DeviceType.CUDA and launch is not None:
            found.append(Unit(kernel.time_range.elapsed_us(), kernel.name, *_op_context(launch, forward)))
    return found


def _op_context(event: FunctionEvent, forward: dict) -> tuple[str, tuple[str, ...]]:
    """The innermost operator around ``event`` (itself included), and its context."""
    chain = _chain(event)
    op = next((e.name for e in reversed(chain) if e.name.startswith(OPERATORS)), "")
    return op, _context(chain, forward)


def _context(chain: list[FunctionEvent], forward: dict) -> tuple[str, ...]:
    node = _backward_node(chain)
    names = tuple(e.name for e in chain)
    if node is None:
        return names
    return forward.get((node.fwd_thread, node.sequence_nr), ()) + names


# Shares


def share(unit: Unit) -> str:
    """The named share of one unit of time (first rule that applies)."""
    context, op = unit.context, unit.op
    if any(name.startswith("Optimizer.") for name in context):
        return "optimizer"
    roles = [name[len(MODULE_LABEL) :] for name in context if name.startswith(MODULE_LABEL)]
    role = roles[-1] if roles else None
    if (
        GATES_LABEL in context
    ):  # gates applied outside the op, forward or (its nodes inherit the label) backward
        return EXPERT_INPUT if any(name.startswith(BACKWARD_NODE) for name in context) else EXPERT_FORWARD
    if EXPERT_BACKWARD_OP in context or EXPERT_OP in context:
        if op in GATHER_OPS:
            return "routing"  # the expert matmul's own gather and scatter (the PyTorch path)
        if WEIGHT_GRADIENT_LABEL in context or unit.name.startswith(WEIGHT_GRADIENT_KERNELS):
            return EXPERT_WEIGHT
        return EXPERT_INPUT if EXPERT_BACKWARD_OP in context else EXPERT_FORWARD
    if role == "routing" or op in ROUTING_OPS:
        return "routing"
    if role == "attention":
        return "attention"
    if op in COPY_OPS:
        return "copies and casts"
    if op in GEMMS:
        return "dense GEMMs"
    if role == "moe" and op and not _accumulation(context):  # not autograd summing two readers' gradients
        return "routing"  # selection bookkeeping of an MoE layer: sigmoid, offsets, the regulariser
    if role == "norms" or op.startswith("aten::"):
        return "norms and elementwise"
    return "other"


def _accumulation(context: tuple[str, ...]) -> bool:
    """Whether the unit is the autograd engine adding a gradient into a tensor that several ops read: an operator
    directly inside a node's evaluate_function range, outside the node's own call (which the profiler names)."""
    nodes = [i for i, name in enumerate(context) if name.startswith(BACKWARD_NODE)]
    return bool(nodes) and nodes[-1] + 1 < len(context) and context[nodes[-1] + 1].startswith(OPERATORS)


def summarise(found: list[Unit], step_us: float, steps: int, top: int) -> tuple[list[dict], list[dict]]:
    """Per step: each share's time and fraction (summing to the step), and the ``top`` kernels by time."""
    by_share: dict[str, float] = defaultdict(float)
    kernels: dict[tuple[str, str], list[float]] = defaultdict(list)  # (kernel, share) -> times
    for unit in found:
        name = share(unit)
        by_share[name] += unit.us
        kernels[(unit.name, name)].append(unit.us)
    by_share["outside kernels"] = max(step_us - sum(by_share.values()), 0.0)
    total = sum(by_share.values())
    shares = [
        {
            "kind": "share",
            "name": name,
            "ms": by_share[name] / steps / 1e3,
            "fraction": by_share[name] / total,
        }
        for name in SHARES
    ]
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    top_rows = [
        {
            "kind": "kernel",
            "name": name,
            "share": share_name,
            "ms": sum(times) / steps / 1e3,
            "fraction": sum(times) / total,
            "calls": len(times) // steps,
        }
        for (name, share_name), times in ranked
    ]
    return shares, top_rows


# What routing and the expert matmul cost beyond dense

MOE_SHARES = ("routing", EXPERT_FORWARD, EXPERT_INPUT, EXPERT_WEIGHT)
# What the MoE overhead subtracts (runs before 2026-11-29: dense matmuls of the ops' own shapes)
MOE_COMPARATOR = "dense projections of the same useful MACs, each row read once"


def dense_equivalent(preset: str, batch: int, device: str, dtype: torch.dtype) -> dict[str, float] | None:
    """Per pass, what dense projections of the same useful MACs as ``preset``'s expert matmuls take on this device:
    every layer's, each timed alone as kernel-bench's dense projection. None for a model without experts."""
    cfg = from_name(preset)
    cases = registry.layer_expert_matmuls(cfg, batch)
    if not cases:
        return None
    timed = [dense_equivalent_ms(c, device, dtype) for c in cases]
    return {p: cfg.n_layers * sum(t[p] for t in timed) for p in timed[0]}


def moe_overhead(shares: list[dict], step_ms: float, what: str, dense: dict[str, float]) -> dict:
    """The step's MoE overhead in ms (and as a fraction of the profiled ``step_ms``, as a share is): its routing
    and expert-matmul shares, less ``dense`` (:func:`dense_equivalent`) of the same pass."""
    equivalent = dense["forward" if what == "forward" else "forward+backward"]
    machinery = sum(r["ms"] for r in shares if r["kind"] == "share" and r["name"] in MOE_SHARES)
    return {
        "kind": "moe overhead",
        "name": "routing + expert matmul - dense projections of the same useful MACs",
        "ms": machinery - equivalent,
        "fraction": (machinery - equivalent) / step_ms,
        "moe_ms": machinery,
        "dense_equivalent_ms": equivalent,
    }


# Running a profile


def profile_step(
    step: Callable[[], object], device: str, steps: int, warmup: int, roles: dict, top: int
) -> tuple[list[dict], dict]:
    """Shares and top kernels of ``step`` profiled ``steps`` times after ``warmup`` calls, and the step timed
    the same number of times without the profiler (its median in ms)."""
    from torch.profiler import ProfilerActivity

    for _ in range(warmup):
        step()
    timer = Timer(device)
    unprofiled = statistics.median(timer(step) for _ in range(steps))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    wall = 0.0
    with _Labels(roles), profiled(activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            with torch.profiler.record_function(STEP_LABEL):
                step()
                if device == "cuda":
                    torch.cuda.synchronize()  # the step's range covers its kernels
            wall += time.perf_counter() - start
    found, step_us = units(list(prof.events()), device)
    shares, top_rows = summarise(found, step_us, steps, top)
    timing = {
        "ms_unprofiled": unprofiled,
        "ms_profiled": step_us / steps / 1e3,
        "ms_wall": 1e3 * wall / steps,
    }
    return shares + top_rows, timing


def run(
    presets: list[str],
    what: list[str],
    batch: int,
    device: str,
    dtype: torch.dtype,
    steps: int,
    warmup: int,
    top: int,
) -> list[dict]:
    rows, peak = [], matmul_peak_tflops(device, dtype) * 1e12
    for preset in presets:
        benches = {b.what: b for b in model_benches(preset, batch, device, dtype)}
        roles = module_roles(benches["train step"].module)
        found = []
        for name in what:
            profiled, timing = profile_step(benches[name].run, device, steps, warmup, roles, top)
            # of the unprofiled step, over the peak it records (so that a file's MFU can be checked)
            timing["matmul_peak_tflops"] = peak / 1e12
            timing["mfu"] = benches[name].flops / (timing["ms_unprofiled"] / 1e3) / peak
            found.append((name, profiled, timing))
        del benches  # the dense equivalents are timed with the model's memory given back
        if device == "cuda":
            torch.cuda.empty_cache()
        dense = dense_equivalent(preset, batch, device, dtype)  # once for both passes
        for name, profiled, timing in found:
            if dense:
                profiled.append(moe_overhead(profiled, timing["ms_profiled"], name, dense))
            rows += [{"preset": preset, "what": name, "batch": batch} | timing | r for r in profiled]
    return _beside_dense(rows, device)


def _beside_dense(rows: list[dict], device: str) -> list[dict]:
    """Each MoE overhead row with the step of the dense preset profiled in the same run, and the overhead as a
    fraction of it. The step on the shares' own clock: on a GPU the unprofiled one (a kernel's duration is the same
    under the profiler, the host's time between kernels is not); on the CPU the profiled one (every operator's time
    there includes the profiler's cost, the overhead's shares too)."""
    clock = "ms_unprofiled" if device == "cuda" else "ms_profiled"
    dense = {
        r["what"]: (r["preset"], r[clock])
        for r in rows
        if r["kind"] == "share" and registry.get(from_name(r["preset"]).model).key == "dense"
    }
    for r in rows:
        if r["kind"] == "moe overhead" and r["what"] in dense:
            preset, step_ms = dense[r["what"]]
            r |= {
                "dense_preset": preset,
                "dense_step_ms": step_ms,
                "fraction_of_dense_step": r["ms"] / step_ms,
            }
    return rows


def default_batch(presets: list[str], device: str, dtype: torch.dtype, fit_from: int | None = None) -> int:
    """From ``fit_from`` (the paper's whole batch of 64, say) or, on a GPU, the paper's batch per GPU of the group
    holding the presets (8 for any other): halved until every preset's training step fits. 2 on the CPU."""
    if fit_from is None and device != "cuda":
        return 2
    start = fit_from or next(
        (PAPER_GPU_BATCH[g] for g in PAPER_GPU_BATCH if set(presets) <= set(GROUPS[g])), 8
    )
    return fitted_batch(tuple(presets), start, device, dtype)


def register(commands) -> None:
    parser = commands.add_parser("profile", help="a training step's device time in named shares, top kernels")
    parser.add_argument("presets", nargs="+", metavar="PRESET", help="presets profiled one after the other")
    parser.add_argument("--forward", action="store_true", help="profile the forward pass too")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--batch", type=int, help="default: 2 on the CPU; on a GPU the paper's, fitted")
    parser.add_argument(
        "--fit-from",
        type=int,
        metavar="N",
        help="the largest batch from N down, halving, at which every preset's training step runs",
    )
    parser.add_argument("--steps", type=int, default=3, help="profiled steps, averaged (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default: %(default)s)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: PyTorch's)")
    parser.add_argument(
        "--out", default="results/profile", help="results go to OUT/<device>/ (default: %(default)s)"
    )
    add_kernel_choices(parser)
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> int:
    device = device_from_args(args.device)
    for preset in args.presets:
        language_model(preset)  # a ValueError: the closest presets, what is wrong with a change, a classifier
    named_once(args.presets)  # a second column of one preset was dropped from the table
    at_least(
        {
            "--steps": (args.steps, 1),
            "--warmup": (args.warmup, 0),
            "--top": (args.top, 1),
            "--batch": (args.batch, 1),
            "--fit-from": (args.fit_from, 1),
            "--threads": (args.threads, 1),
        }
    )
    if args.batch is not None and args.fit_from is not None:
        raise ValueError("--batch and --fit-from: give one")
    writable_folder(Path(args.out))
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    batch = args.batch or default_batch(args.presets, device, dtype, args.fit_from)
    for preset in args.presets:  # found before any work: a case that cannot fit is a usage error
        reason = "not one sequence fits" if batch < 1 else too_large(preset, batch, "model", device, dtype)
        if reason:
            raise ValueError(f"{preset} at batch {batch}: {reason}; try a smaller --batch")
    what = ["train step", "forward"] if args.forward else ["train step"]
    with intra_op_threads(args.threads):
        rows = run(args.presets, what, batch, device, dtype, args.steps, args.warmup, args.top)
        threads = torch.get_num_threads()
    metadata = (
        environment(device)
        | {
            "dtype": dtype_name,
            "precision": precision.describe(dtype_name),
            "optimizer": optim.describe(device),
            "batch": batch,
            "fit_from": args.fit_from,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": threads,  # intra-op: on a busy CPU one thread per core makes every operator wait
            "presets": args.presets,
            "what": what,
            "compile": "eager",
            "counted": "kernel durations (CUDA)" if device == "cuda" else "operator self CPU time",
            "mfu_convention": MFU_CONVENTION,
            "moe_overhead_against": MOE_COMPARATOR,
        }
        | kernel_metadata(args.expert_matmul, device)
    )
    label = f"{dtype_name}-b{batch}-" + "-vs-".join(slug(p) for p in args.presets)
    path = save_run(Path(args.out) / slug(metadata["device"]), label, metadata, rows)
    if args.json:
        print(json.dumps({"metadata": metadata, "rows": rows, "saved": str(path)}, indent=2))
        return 0
    print(
        f"{metadata['device']}, {metadata['precision']}, batch {batch}, {args.steps} profiled steps, "
        f"{threads} intra-op thread{'s' * (threads != 1)}; "
        f"counted: {metadata['counted']}; {describe_kernels(metadata)}"
    )
    print(side_by_side(rows).to_string())
    for line in overhead_lines(rows):
        print(line)
    kernels = pd.DataFrame([r for r in rows if r["kind"] == "kernel"])
    if not kernels.empty:
        print(f"\ntop {args.top} kernels of each step, per step:")
        kernels = kernels.assign(ms=kernels.ms.round(2), fraction=kernels.fraction.map("{:.1%}".format))
        columns = ["preset", "what", "share", "ms", "fraction", "calls", "name"]
        print(kernels[columns].to_string(index=False, max_colwidth=60))
    print(f"saved {path}")
    return 0


def overhead_lines(rows: list[dict]) -> list[str]:
    """A line per MoE overhead row, as a fraction of the dense model's step where the run profiled one."""
    lines = []
    for r in (r for r in rows if r["kind"] == "moe overhead"):
        line = (
            f"{r['preset']}, {r['what']}: MoE overhead {r['ms']:+.2f} ms (routing and expert matmul "
            f"{r['moe_ms']:.2f} ms, dense projections of the same useful MACs {r['dense_equivalent_ms']:.2f} ms)"
        )
        if "fraction_of_dense_step" in r:
            line += f", {100 * r['fraction_of_dense_step']:.1f}% of {r['dense_preset']}'s {r['what']}"
        lines.append(line)
    return lines


def side_by_side(rows: list[dict]) -> pd.DataFrame:
    """The shares of every (preset, what) as columns of ms and percent, one row per share."""
    table = pd.DataFrame([r for r in rows if r["kind"] == "share"])
    table["cell"] = [f"{r.ms:.2f} ms ({100 * r.fraction:.0f}%)" for r in table.itertuples()]
    wide = table.pivot_table(
        index="name", columns=["preset", "what"], values="cell", aggfunc="first", sort=False
    )
    return wide.reindex(SHARES)
