"""Wall-clock and peak memory of whole training steps, forward passes and single attention layers.

Models of one group (a dense baseline and the models compared with it) are timed interleaved, one call of each
per round, and every ratio is the median over rounds of the paired ratio, so slow drifts of the machine cancel.
On a GPU calls are timed with CUDA events after an L2 flush; peak memory is torch.cuda.max_memory_allocated over
one training step, above what was allocated just before it. On the CPU memory is the activation bytes autograd keeps for one training step.
The per-round paired ratios are kept, so the gate can put a confidence interval on each median; the CPU gate
times one intra-op thread by its CPU time, which other processes on the machine do not inflate.
"""

import json
import platform
import statistics
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from switchbench.bench.command import (
    DTYPES,
    Distinct,
    add_kernel_choices,
    at_least,
    describe_kernels,
    device_from_args,
    first_repeated,
    kernel_metadata,
    slug,
)
from switchbench.bench.cost.accounting import exact_cost
from switchbench.bench.cost.measure import free_memory, some_case_fits
from switchbench.bench.published import WALLCLOCK
from switchbench.bench.timing.benches import (
    EAGER,
    Bench,
    CaptureFailed,
    StepMode,
    estimated_bytes,
    fitted_batch,
    layer_benches,
    model_benches,
    release_memory,
    too_large,
    unless_oom,
)
from switchbench.bench.timing.heap import keep_freed_memory
from switchbench.bench.timing.timer import Timer, intra_op_threads, iqr, kernel_ms, matmul_peak_tflops
from switchbench.core import compiling, distributed, optim, precision
from switchbench.core.environment import device_name
from switchbench.core.results import nothing_measured, save_run, writable_folder
from switchbench.models import family as registry
from switchbench.models.presets import OVERRIDES, PRESETS, from_name, language_model
from switchbench.ops.attention import choice as attention_choice

# Each group: a dense baseline first, then the models compared with it: every family's preset of that size.
GROUPS = {group: registry.role_presets(group) for group in registry.SPEED_GROUPS}
GPU_GROUPS = ("47m", "45m-rope", "262m", "244m-rope")
# The paper's batch per GPU (64 sequences over 1 GPU at 47M and 8 GPUs at 262M, Table 5): each GPU group starts
# there and halves until every member's training step fits the card.
PAPER_GPU_BATCH = {"47m": 64, "45m-rope": 64, "262m": 8, "244m-rope": 8}
CPU_GROUPS = ("tiny", "tiny-rope")
# The CI gate: one SwitchHead against one dense attention layer at the 47M shapes, and the exact cost ratios.
GATE_LAYERS = ("wikitext103-47m-transformer-h10", "wikitext103-47m-switchhead-h2")
# One intra-op thread, timed by its CPU time: with PyTorch's default of one thread per core, busy neighbours
# on a shared CI runner stall the thread pool and the SwitchHead/dense ratio moved by 2x (issue 12).
GATE_THREADS = 1
GATE_ROUNDS = 30
# What a row's fraction_of_matmul_peak (its MFU) counts
MFU_CONVENTION = (
    "model FLOPs per device per second over this device's measured matmul peak; model FLOPs = 2 x the exact MACs "
    "(the k experts used, every head run, attention over the whole window, the causal mask's half not taken off, "
    "as PaLM's MFU counts it: the explicit, SDPA and cuDNN kernels compute it, Triton's flash and FlexAttention skip "
    "its whole tiles) x 3 for a training step (forward + backward)"
)


def time_group(
    benches: list[Bench],
    timer: Timer,
    rounds: int,
    warmup: int,
    progress=None,
    world: distributed.World = distributed.ONE,
    baseline: str | None = None,
) -> list[dict]:
    """Time the benches round-robin; ratios against the ``baseline`` preset's bench of each (scope, what), by
    default the first bench's, are paired medians. Under several processes the ranks meet at a barrier before each
    call, and each call's time is the slowest rank's."""
    times: dict[int, list[float]] = {i: [] for i in range(len(benches))}
    failed: dict[int, str] = {}
    for r in range(warmup + rounds):
        for i, bench in enumerate(benches):
            if i in failed:
                continue
            distributed.barrier(world)
            t = _timed_call(timer, bench)
            # every rank drops it together, so they stay in step
            if distributed.anywhere(isinstance(t, str), world):
                failed[i] = t if isinstance(t, str) else "failed on another process"
            elif r >= warmup:
                times[i].append(t)
        if progress is not None:
            progress.update(1)
    times, failed = _slowest_rank(times, failed, world)
    rows = []
    baseline = baseline or (benches[0].preset if benches else None)
    for i, bench in enumerate(benches):
        # The group's baseline is its first preset; if it failed (or was never built), nothing gets a ratio.
        base = next(
            (
                j
                for j, b in enumerate(benches)
                if (b.preset, b.scope, b.what) == (baseline, bench.scope, bench.what)
            ),
            None,
        )
        row = {
            "preset": bench.preset,
            "scope": bench.scope,
            "what": bench.what,
            "status": failed.get(i, "ok"),
        }
        if i not in failed:
            row |= {
                "ms": statistics.median(times[i]),
                "ms_iqr": iqr(times[i]),
                "tflops": bench.flops / statistics.median(times[i]) / 1e9,
                "tokens_per_s_per_device": bench.tokens / statistics.median(times[i]) * 1e3,
                "memory_bytes": _memory(bench),
            }
            # read off one more call each, after the rounds: a training step's is a differentiated forward of the
            # whole batch, which may not fit beside a captured step's pool; then it goes unsaid, not the run lost
            measured = {
                "op_calls": bench.op_calls(),
                "attention": unless_oom(bench.attention),
                "expert_matmul": unless_oom(bench.expert_matmul),
            }
            row |= {name: value for name, value in measured.items() if value is not None}
            if timer.device == "cuda":  # one more call, profiled: how much of the step the GPU is busy
                row["kernel_ms"] = kernel_ms(bench.run)
                row["gpu_busy"] = row["kernel_ms"] / row["ms"]
            if base is not None and base not in failed:
                paired = [a / b for a, b in zip(times[i], times[base], strict=True)]
                floor = bench.flops / benches[base].flops  # the exact MAC ratio: what compute alone allows
                row |= {
                    "ratio_time": statistics.median(paired),
                    "ratio_time_rounds": paired,
                    "ratio_macs": floor,
                    "time_over_floor": statistics.median(paired) / floor,
                }
                executed = _executed(bench) / _executed(benches[base])
                if executed != floor:  # an implementation that computes every expert: what it allows
                    row["ratio_macs_executed"] = executed
                row |= _scores(row["preset"], baseline, bench.scope)
                row["baseline"] = baseline
        rows.append(row)
    _flag_mixed_attention(rows)
    for row in rows:  # memory ratios need every row's memory first
        base = next(
            (
                r
                for r in rows
                if (r["preset"], r["scope"], r["what"]) == (baseline, row["scope"], row["what"])
            ),
            None,
        )
        if row.get("memory_bytes") and base and base.get("memory_bytes"):
            row["ratio_memory"] = row["memory_bytes"] / base["memory_bytes"]
    return rows


def _timed_call(timer: Timer, bench: Bench) -> float | str:
    """One timed call's time, or the status of a call that has none: out of memory ("OOM"), or compiled past
    torch.compile's limit (its code would run eager beside compiled members). Anything else is a bug and is
    raised."""
    try:
        t = unless_oom(lambda: timer(bench.run))
    except Exception as error:
        if not compiling.past_the_limit(error):
            raise
        return "past the recompile limit"
    return "OOM" if t is None else t


def _slowest_rank(times: dict, failed: dict, world: distributed.World) -> tuple[dict, dict]:
    """Each call's time the slowest rank's (the ranks agreed on every failure as it happened)."""
    every = distributed.gathered({i: t for i, t in times.items() if i not in failed}, world)
    return {
        i: [max(per_rank) for per_rank in zip(*(t[i] for t in every), strict=True)] for i in every[0]
    }, failed


def _flag_mixed_attention(rows: list[dict]) -> None:
    """Mark every row of a (scope, what) whose members ran different attention kernels (a fused dense baseline
    against a math-path model, or the reverse): its time ratios compare kernels, not architectures. A training
    step and a no-grad forward may run different SDPA kernels (XL on CUDA: memory-efficient and cuDNN) without
    any member differing from another. A member whose kernel went unread (out of memory for the readout) beside
    members whose kernel was read counts as differing: nothing says it ran theirs."""
    for scope, what in {(r["scope"], r["what"]) for r in rows}:
        members = [r for r in rows if (r["scope"], r["what"]) == (scope, what) and r["status"] == "ok"]
        kernels = {r.get("attention") for r in members}
        if len(kernels) > 1 and kernels != {None}:
            for r in members:
                r["attention_mixed"] = True


def _executed(bench: Bench) -> float:
    return bench.executed_flops or bench.flops


def _memory(bench: Bench) -> float | None:
    return unless_oom(bench.memory)


def describe(rows: list[dict], device: str, dtype_name: str, **settings) -> dict:
    """The run's metadata; each timed row gains its fraction of this device's matmul peak, measured now."""
    from switchbench.core.environment import environment

    peak = matmul_peak_tflops(device, DTYPES[dtype_name])
    for row in rows:
        if "tflops" in row:
            row["fraction_of_matmul_peak"] = row["tflops"] / peak
    return environment(device) | {
        "dtype": dtype_name,
        "precision": precision.describe(dtype_name),
        "optimizer": optim.describe(device),
        "matmul_peak_tflops": peak,
        "mfu_convention": MFU_CONVENTION,
        **settings,
    }


def count_ratios() -> list[dict]:
    """Exact MAC and memory ratios of one attention layer against its group's dense baseline (no timing)."""
    rows = []
    for group in GROUPS.values():
        base = exact_cost(PRESETS[group[0]])
        for preset in group[1:]:
            cost = exact_cost(PRESETS[preset])
            rows.append(
                {
                    "preset": preset,
                    "scope": "count",
                    "what": "exact",
                    "status": "ok",
                    "baseline": group[0],
                    "ratio_macs": cost.macs / base.macs,
                    "ratio_memory": cost.mem / base.mem,
                    "ratio_scores": cost.scores / base.scores,
                }
            )
    return rows


def run(
    groups: dict[str, tuple[str, ...]],
    scopes: tuple[str, ...],
    device: str,
    dtype: torch.dtype,
    batch: int | None,
    rounds: int,
    warmup: int,
    world: distributed.World = distributed.ONE,
    clock: str = "wall",
    mode: StepMode = EAGER,
    fit_from: int | None = None,
) -> list[dict]:
    """Every group and scope timed interleaved at one batch per group (``batch``, or on a GPU the paper's batch
    per GPU halved until the group fits); a case too large for the free memory, or that runs out of it, is an
    "OOM" row; the exact cost ratios of the presets added."""
    from tqdm import tqdm

    timer, rows = Timer(device, clock), []
    with tqdm(
        total=len(groups) * len(scopes) * (rounds + warmup), desc="timing", unit="round", disable=None
    ) as bar:
        for group, presets in groups.items():
            start = fit_from or PAPER_GPU_BATCH.get(group, 64)
            size = batch or fitted_batch(presets, start, device, dtype)
            for scope in scopes:
                while True:
                    # From --fit-from, a halved batch is made up by accumulating its halves' gradients
                    steps = (
                        replace(mode, accumulation=start // size) if fit_from and not batch and size else mode
                    )
                    benches, failures = _build_group(presets, scope, size, device, dtype, world, steps)
                    # Each member fitted alone; together (all resident, interleaved) they may not: halve and
                    # rebuild. An H200 built three of the 262M group at 64 and had 18 GiB left for the others
                    if batch or size <= 1 or not distributed.anywhere(_ran_out(failures), world):
                        break
                    del benches
                    release_memory()
                    size //= 2
                rows += [
                    {"preset": f["preset"], "scope": scope, "what": "build", "status": f["status"]}
                    | {"reason": f["reason"], "group": group, "batch": size}
                    for f in failures
                ]
                timed = time_group(benches, timer, rounds, warmup, bar, world, baseline=presets[0])
                made_up = {"accumulation": steps.accumulation} if steps.accumulation > 1 else {}
                # only a training step accumulates: a forward and a layer's passes run one micro-batch
                rows += [
                    r | {"group": group, "batch": size} | (made_up if r["what"] == "train step" else {})
                    for r in timed
                ]
                del benches
                release_memory()
    return rows + [r | {"group": "count"} for r in count_ratios()]


def _build_group(
    presets, scope: str, batch: int, device: str, dtype, world, mode: StepMode
) -> tuple[list, list[dict]]:
    """Every member's benches, all resident at once as they are timed, and a row for each member that failed."""
    benches, failures = [], []
    for preset in presets:
        failed = _build(benches, preset, scope, batch, device, dtype, world, mode)
        if failed:
            failures.append({"preset": preset, "status": failed[0], "reason": failed[1]})
    return benches, failures


def _ran_out(failures: list[dict]) -> bool:
    """Whether a member did not fit beside the others (its estimate or its build ran out of memory)."""
    return any(f["status"] == "OOM" for f in failures)


def _build(
    benches: list, preset: str, scope: str, batch: int, device: str, dtype, world, mode: StepMode
) -> tuple[str, str] | None:
    """Add the benches of ``preset`` to ``benches``; or the status and reason why it cannot run: too large, out
    of memory ("OOM"), or its step not capturable in a CUDA graph. The group's other members run either way."""
    reason = "not one sequence fits" if batch < 1 else too_large(preset, batch, scope, device, dtype)
    # agreed by every rank before any builds: a rank that built would wait for the others in DDP's first broadcast
    reason = next((r for r in distributed.gathered(reason, world) if r), None)
    if reason:
        return "OOM", reason
    try:
        if scope == "model":
            built = unless_oom(lambda: model_benches(preset, batch, device, dtype, world, mode))
        else:
            built = unless_oom(lambda: layer_benches(preset, batch, device, dtype, mode.compile))
    except CaptureFailed as error:
        failed = str(error)
    else:
        if built is None:
            return "OOM", "out of memory while building"
        benches += built
        return None
    release_memory()  # outside the handler (see unless_oom); the next capture takes a new pool
    return "not capturable", failed


def register(commands) -> None:
    """The ``speed`` command."""
    parser = commands.add_parser("speed", help="wall-clock and peak memory, interleaved, ratios to dense")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument(
        "--batch",
        type=int,
        help="sequences per step, over all processes (default on a GPU: the paper's batch per GPU, halved until "
        "each group fits; 2 on the CPU)",
    )
    parser.add_argument(
        "--fit-from",
        type=int,
        help="on a GPU without --batch, fit each group's batch from this one down, and make a halved batch up by "
        "accumulating gradients (default: the paper's batch per GPU, halved without accumulating; 64: its whole "
        "batch on one GPU)",
    )
    parser.add_argument(
        "--groups",
        nargs="+",
        help=f"preset groups (default: {', '.join(GPU_GROUPS)} on a GPU, {', '.join(CPU_GROUPS)} on the CPU)",
    )
    parser.add_argument("--presets", nargs="+", help="one custom group: the first is the baseline")
    parser.add_argument(
        "--scopes",
        nargs="+",
        choices=["model", "layer"],
        default=["model", "layer"],
        action=Distinct,
        help="what is timed: whole models' steps, one attention layer's passes (default: both)",
    )
    parser.add_argument(
        "--rounds", type=int, help=f"timed rounds after warm-up (default 20; {GATE_ROUNDS} with --quick)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: %(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        help=f"intra-op threads (default: PyTorch's; {GATE_THREADS} with --quick on the CPU)",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        help="CPU timing: wall-clock, or the timing thread's CPU time (needs --threads 1; default with --quick)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="every member under torch.compile (default backend inductor), as a practitioner would train",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="each member's whole training step (forward, backward, AdamW) captured in one CUDA graph and replayed",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the CI gate: 47M attention layers on the CPU at batch 4, one thread timed by its CPU clock, "
        f"{GATE_ROUNDS} rounds (with --groups or --presets: those, at the gate's settings)",
    )
    parser.add_argument(
        "--out", default="results/speed", help="results go to OUT/<device>/ (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_kernel_choices(parser)
    parser.set_defaults(run=_run)


def _run(args) -> int:
    device = device_from_args(args.device or ("cpu" if args.quick else None))  # the gate is the CPU's
    writable_folder(Path(args.out))
    with distributed.process_group(device) as world:
        return _measure(args, device, world)


def _measure(args, device: str, world: distributed.World) -> int:
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    batch = args.batch
    if batch is None and device == "cpu":
        batch = 4 if args.quick else 2
    elif batch is None and world.distributed:
        batch = 64  # processes fit their share; fitting a batch is for one GPU
    rounds = args.rounds if args.rounds is not None else GATE_ROUNDS if args.quick else 20
    gate = args.quick and device == "cpu"
    threads = args.threads if args.threads is not None or not gate else GATE_THREADS
    # first: the clock's check below reads the threads
    at_least({"--rounds": (rounds, 1), "--warmup": (args.warmup, 0), "--threads": (threads, 1)})
    # The thread clock leaves out the other threads' work: under several processes, gloo's all-reduce
    clock = args.clock or ("thread" if gate and not world.distributed else "wall")
    if clock == "thread" and (device == "cuda" or threads != 1 or world.distributed):
        raise ValueError(
            "--clock thread times the CPU with one intra-op thread in one process: use --device cpu --threads 1"
        )
    if batch is not None:
        distributed.share(batch, world)  # a ValueError unless it splits evenly
    if args.compile is not None and args.compile not in _compile_backends():
        raise ValueError(
            f"--compile {args.compile!r} is no torch.compile backend (inductor, cudagraphs, aot_eager, ...)"
        )
    # halved until it fits and made up by accumulation: an odd batch would lose a sequence at a halving (5: 2 x 2)
    if args.fit_from is not None and (args.fit_from < 1 or args.fit_from & (args.fit_from - 1)):
        raise ValueError(f"--fit-from must be a power of two; got {args.fit_from}")
    if args.fit_from is not None and (args.batch is not None or device != "cuda" or world.distributed):
        raise ValueError("--fit-from fits one GPU's batch: it goes without --batch, on one CUDA device")
    if args.cuda_graphs and (device != "cuda" or world.distributed):
        raise ValueError(
            "--cuda-graphs needs one process on a CUDA device: CUDA graphs capture one GPU's work"
        )
    groups, scopes = _groups(args, device)
    for preset in dict.fromkeys(p for presets in groups.values() for p in presets):
        attention_choice.check_width(from_name(preset).d_head, preset)
    per_process = None if batch is None else batch // world.size
    if per_process is not None:  # the ranks agree, so that none waits for a refused one
        free = min(distributed.gathered(free_memory(device), world))
        some_case_fits(
            {
                f"{preset} ({scope})": estimated_bytes(preset, per_process, scope, DTYPES[dtype_name])
                for presets in groups.values()
                for preset in presets
                for scope in scopes
            },
            free,
        )
    # on the CPU the clock then times the computation, not page faults (timing/heap.py)
    allocator = keep_freed_memory() if device == "cpu" else "as is"
    with intra_op_threads(threads):
        rows = run(
            groups,
            scopes,
            device,
            DTYPES[dtype_name],
            per_process,
            rounds,
            args.warmup,
            world,
            clock,
            StepMode(args.compile, args.cuda_graphs),
            args.fit_from,
        )
        rank_devices = distributed.gathered(_device_of(device, world), world)
        if not world.main:
            return 0
        metadata = describe(
            rows,
            device,
            dtype_name,
            batch=batch if batch is not None else "fitted per group",
            batches=sequences_per_step(rows, world),
            processes=world.size,
            world_size=world.size,
            backend=world.backend,
            rank_devices=rank_devices,
            rounds=rounds,
            warmup=args.warmup,
            threads=torch.get_num_threads(),
            clock=clock,
            allocator=allocator,
            compile=args.compile or "eager",
            cuda_graphs=args.cuda_graphs,
            groups={g: list(p) for g, p in groups.items()},
            **kernel_metadata(args.expert_matmul, device),
        )
    folder = Path(args.out) / slug(metadata["device"])
    label = f"{dtype_name}-b{batch if batch is not None else 'fit'}" + ("-quick" if args.quick else "")
    label += f"-compiled-{args.compile}" if args.compile else ""
    label += "-graphs" if args.cuda_graphs else ""
    label += f"-x{world.size}" if world.distributed else ""
    path = save_run(folder, label, metadata, rows)
    if args.json:
        print(json.dumps({"metadata": metadata, "rows": rows, "saved": str(path)}, indent=2))
        return nothing_measured(_timed(rows), "speed", path)
    timed_with = (
        "CUDA events" if device == "cuda" else f"{metadata['threads']} intra-op thread(s), {clock} clock"
    )
    print(
        f"{metadata['device']}, {metadata['precision']}, batch {metadata['batches']}, {world.size} process(es), "
        f"{timed_with}; "
        f"ratios are medians of paired ratios over {rounds} interleaved rounds; "
        f"matmul peak {metadata['matmul_peak_tflops']:.3g} TFLOP/s (measured); {describe_kernels(metadata)}"
    )
    print(pd.DataFrame([_printed(r) for r in rows if r["scope"] != "count"]).to_string(index=False))
    print(f"MFU: {MFU_CONVENTION}")
    print("\nPaper Table 5 (whole training steps):")
    print(_published_wallclock().to_string(index=False))
    print(f"saved {path}")
    return nothing_measured(_timed(rows), "speed", path)


def sequences_per_step(rows: list[dict], world: distributed.World) -> dict[str, int]:
    """Each group's sequences in a training step: its micro-batch times the micro-batches accumulated, over every
    rank (the rows record the micro-batch)."""
    found: dict[str, int] = {}
    for r in rows:  # the largest: a member that failed to build records its batch, not an accumulation
        if "batch" in r:
            found[r["group"]] = max(
                found.get(r["group"], 0), r["batch"] * r.get("accumulation", 1) * world.size
            )
    return found


def _device_of(device: str, world: distributed.World) -> str:
    if device == "cuda":
        return f"cuda:{world.local_rank} {torch.cuda.get_device_name(world.local_rank)}"
    return f"{device_name(device)} (CPU, {platform.node()})"


def _timed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["scope"] != "count"]  # the exact cost ratios are counted, never timed


def _groups(args, device: str) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    if args.quick and not (args.groups or args.presets):
        return {"gate": GATE_LAYERS}, ("layer",)
    default = GPU_GROUPS if device == "cuda" else CPU_GROUPS
    scopes = tuple(args.scopes)  # a classifier's attention layer times as any other; its model is no LM
    return preset_groups(args.presets, args.groups, default, models="model" in scopes), scopes


def named_once(named: list[str]) -> None:
    """A ValueError naming the first member or group of ``named`` named twice (a table would show it once)."""
    if (repeated := first_repeated(named)) is not None:
        raise ValueError(f"{repeated} is named twice: each member or group is measured once")


def preset_groups(
    presets: list[str] | None, groups: list[str] | None, default: tuple[str, ...] = (), models: bool = True
) -> dict[str, tuple[str, ...]]:
    """The groups a command compares: ``presets`` as one custom group (the first its baseline) when given, else the
    named ``groups``, else ``default``'s; a ValueError names any unknown or repeated one, or both given, or (where
    whole ``models`` run, language models all) a ListOps classifier."""
    if presets and groups:
        raise ValueError("the presets given make one group and --groups names groups: give one")
    named_once(presets or groups or [])
    if presets:
        unknown = [p for p in presets if p.partition(OVERRIDES)[0] not in PRESETS]
        if unknown:
            raise ValueError(f"unknown presets: {', '.join(unknown)}")
        for preset in presets:
            (language_model if models else from_name)(preset)  # a ValueError says what is wrong with it
        return {"custom": tuple(presets)}
    groups = groups or default
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown groups {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    return {g: GROUPS[g] for g in groups}


def _scores(preset: str, baseline: str, scope: str) -> dict:
    """``ratio_scores``: the model's attention scores over its baseline's (models/cost.py), for a group's row, where
    both presets are known. Beside the MAC floor it says how much of the work MACs leave out each one does: a
    family of fewer heads may beat the floor through it without its baseline being slow."""
    if any(name.partition(OVERRIDES)[0] not in PRESETS for name in (preset, baseline)):
        return {}
    a, b = from_name(preset), from_name(baseline)
    layers = (a.n_layers, b.n_layers) if scope == "model" else (1, 1)
    return {"ratio_scores": layers[0] * exact_cost(a).scores / (layers[1] * exact_cost(b).scores)}


def scores_ratio(r: dict) -> float | None:
    """A row's ratio of attention scores to its baseline's: as it was written, or, for a row written before the
    suite counted them, from its presets."""
    if "ratio_scores" in r:
        return r["ratio_scores"]
    names = r.get("preset"), r.get("baseline")
    if not all(isinstance(name, str) for name in names) or r.get("scope") not in ("model", "layer"):
        return None
    try:
        return _scores(*names, r["scope"]).get("ratio_scores")
    except ValueError:  # a preset's overrides this code no longer reads: no ratio, not a report lost
        return None


def below_floor(r: dict) -> bool:
    """Whether a row's time ratio beats what compute allows against its baseline: its MAC floor, or, where the
    model executed more (an expert matmul computing every expert), the executed floor. That says the baseline ran
    further below the GPU's peak, not that the model is fast."""
    floors = [r[key] for key in ("ratio_macs", "ratio_macs_executed") if r.get(key) is not None]
    return r.get("ratio_time") is not None and bool(floors) and r["ratio_time"] < max(floors)


def _over_floor(r: dict) -> str:
    """The time over its compute floor, marked where the ratio beats a floor."""
    if "time_over_floor" not in r:
        return ""
    return f"{r['time_over_floor']:.3f}" + (" (baseline suspect)" if below_floor(r) else "")


def _printed(r: dict) -> dict:
    memory, scores = r.get("memory_bytes"), scores_ratio(r)
    return {
        "group": r["group"],
        "preset": r["preset"],
        "scope": r["scope"],
        "what": r["what"],
        "ms": f"{r['ms']:.2f}" if "ms" in r else r["status"],
        "rel. time": f"{r['ratio_time']:.2f}" if "ratio_time" in r else "",
        "MAC floor": f"{r['ratio_macs']:.2f}" if "ratio_macs" in r else "",
        "time/floor": _over_floor(r),
        "executed floor": f"{r['ratio_macs_executed']:.2f}" if "ratio_macs_executed" in r else "",
        "scores": "" if scores is None else f"{scores:.2f}",
        "attention": r.get("attention", "") + (" (mixed!)" if r.get("attention_mixed") else ""),
        "expert matmul": r.get("expert_matmul", ""),
        "memory": "" if memory is None else f"{memory / 2**20:,.1f} MiB",
        "rel. memory": f"{r['ratio_memory']:.2f}" if "ratio_memory" in r else "",
        "op calls": r.get("op_calls", ""),
        "tokens/s/device": f"{r['tokens_per_s_per_device']:,.0f}" if "tokens_per_s_per_device" in r else "",
        "TFLOP/s": f"{r['tflops']:.3g}" if "tflops" in r else "",
        "MFU": f"{100 * r['fraction_of_matmul_peak']:.1f}%" if "fraction_of_matmul_peak" in r else "",
        "GPU busy": f"{r['gpu_busy']:.2f}" if "gpu_busy" in r else "",
    }


def _published_wallclock() -> pd.DataFrame:
    with WALLCLOCK.open(newline="") as f:
        table = pd.read_csv(f, dtype=str, keep_default_na=False)  # printed as published
    table["gpu_mem_gb"] = table["gpu_mem_gb"].astype(str) + "G"
    table["GPUs"] = table["n_gpus"].astype(str) + "x " + table["gpu"]
    names = {
        "size": "size",
        "model": "model",
        "n_heads_active": "heads",
        "ms_per_iter": "ms/iter",
        "rel_time": "rel. time",
        "gpu_mem_gb": "GPU memory",
        "rel_mem": "rel. memory",
        "GPUs": "GPUs",
    }
    return table[list(names)].rename(columns=names)


def _compile_backends() -> list[str]:
    """The backends torch.compile takes here (checked before any model is built: torch names a bad one only then)."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())
