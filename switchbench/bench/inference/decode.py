"""``switchbench decode``: what each attention family costs at inference, side by side.

For each preset: the decoding check first (token by token after a chunked prefill, from an empty cache, against one
forward pass in float32; a preset over 1e-4 is "wrong" and not timed), then over a grid of batch x context the KV
cache per token (counted from the family's declaration, beside the allocated cache's bytes), the prefill of a
prompt of ``context`` tokens and one decode step after it, each beside its floor: MACs / the measured matmul peak
for prefill, max(bytes read / the measured memory bandwidth, MACs / peak) for decode. The members of a group are
timed interleaved, one call each per round, and each ratio to the group's first preset (dense, at equal
parameters) is the median of the paired per-round ratios; a preset whose family declares no cache is a "no decode
path" row.

Serving attends to the whole context: every preset runs with its attention span set to the sequence (one chunk of
T = the longest context + 1, no window), built once per group; weights and cache in the run's dtype, as served.
"""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from switchbench.bench.command import (
    DTYPES,
    Distinct,
    add_kernel_choices,
    at_least,
    device_from_args,
    emit,
    kernel_metadata,
    slug,
)
from switchbench.bench.cost.measure import (
    attention_kernel,
    counted_macs,
    free_memory,
    is_oom,
    some_case_fits,
    total_memory,
)
from switchbench.bench.inference import sizing
from switchbench.bench.timing.benches import release_memory, unless_oom
from switchbench.bench.timing.speed import preset_groups
from switchbench.bench.timing.timer import (
    Timer,
    intra_op_threads,
    iqr,
    matmul_peak_tflops,
    memory_bandwidth_gbs,
)
from switchbench.core import schema
from switchbench.core.environment import environment
from switchbench.core.results import new_run_stem, nothing_measured, save_run, writable_folder
from switchbench.models.config import LARGEST_INT
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import from_name

GPU_GROUPS, CPU_GROUPS = ("262m",), ("tiny", "tiny-rope")
GRIDS = {"cuda": ((1, 16, 64), (512, 2048, 8192)), "cpu": ((1, 4), (64, 256))}
TIMING = {"rounds": 10, "warmup": 2, "prefill_rounds": 3}  # defaults of the timing flags
TOLERANCE = 1e-4  # the decoding check in float32
PREFILL_CHUNK = 512  # prompt tokens per prefill call: a chunk's attention maps, not the prompt's, are held


def decoding_check(preset: str, device: str) -> float:
    """Max |logits| difference between decoding (a 24-token prefill in chunks of 10, then token by token) and one
    forward pass over 40 tokens, float32, the preset's family and positions with chunks of 16 (so XL's window
    is crossed)."""
    base = from_name(preset)
    cfg = base.replace(T=16, context_blocks=min(base.context_blocks, 1), dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lm = LanguageModel(cfg).to(device).eval()
        tokens = torch.randint(cfg.vocab, (2, 40)).to(device)
    cache = lm.new_cache(2, 40)
    with torch.no_grad():
        full = lm(tokens).logits
        pieces = [lm.decode(tokens[:, i : i + n], cache) for i, n in ((0, 10), (10, 10), (20, 4))]
        pieces += [lm.decode(tokens[:, i : i + 1], cache) for i in range(24, 40)]
    return (torch.cat(pieces, 1) - full).abs().max().item()


def served(preset: str, capacity: int, device: str, dtype: torch.dtype) -> LanguageModel:
    """``preset`` as served: its weights in ``dtype``, built on the device, attending to the whole sequence of up
    to ``capacity`` tokens (one chunk of T = capacity, no window)."""
    cfg = from_name(preset).replace(T=capacity, context_blocks=0, dropout=0.0)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        return LanguageModel(cfg).to(dtype).eval()


class Member:
    """One served model at one batch and context: a cache for the prompt and one more token, the prompt, and the
    calls the timer times."""

    def __init__(self, preset: str, lm: LanguageModel, batch: int, context: int):
        self.preset, self.lm, self.cfg, self.batch, self.context = preset, lm, lm.cfg, batch, context
        gen = torch.Generator().manual_seed(1)
        device = lm.head.weight.device
        self.prompt = torch.randint(self.cfg.vocab, (batch, context + 1), generator=gen).to(device)
        self.cache = lm.new_cache(batch, context + 1)

    @torch.no_grad()
    def prefill(self) -> None:
        self.cache.rewind(0)
        for start in range(0, self.context, PREFILL_CHUNK):
            self.lm.decode(self.prompt[:, start : min(start + PREFILL_CHUNK, self.context)], self.cache)

    @torch.no_grad()
    def decode(self) -> None:
        self.cache.rewind(self.context)
        self.lm.decode(self.prompt[:, self.context :], self.cache)


def time_cell(
    models: dict, batch: int, context: int, device, dtype, grid: "Grid", baseline: str
) -> list[dict]:
    """One cell of the grid: every member (a served model of ``models``) given its cache and prompt, or refused,
    counted, then timed interleaved; a member that runs out of memory while timed is an OOM row. Ratios are to
    ``baseline`` (the group's first preset), and none where it was not timed."""
    width = torch.empty((), dtype=dtype).element_size()
    rows, members = [], []
    for preset, lm in models.items():
        release_memory()  # what earlier members left in the allocator's cache counts as free
        cfg = from_name(preset)  # its weights are resident already
        need = sizing.peak_bytes(cfg, batch, context + 1, min(context, PREFILL_CHUNK), width)
        need -= sizing.weight_bytes(cfg, width)
        if need > free_memory(device):
            rows.append(_refused(preset, batch, context, f"needs at least {need / 2**30:.1f} GiB more"))
            continue
        try:
            member = Member(preset, lm, batch, context)
            member.prefill()  # XL's distances are projected once per model: not counted in every prefill
            member.prefill_macs, member.decode_macs = (
                counted_macs(member.prefill),
                counted_macs(member.decode),
            )
            # as speed does: SDPA picks by mask and grouped heads, so a member may fall back to the unfused kernel
            # where dense runs a fused one (XL's float mask, GQA's and MoA's grouped heads on CUDA)
            member.kernels = {
                "prefill": attention_kernel(member.prefill),
                "decode": attention_kernel(member.decode),
            }
            members.append(member)
        except (RuntimeError, MemoryError) as error:
            if not is_oom(error):
                raise
            rows.append(_refused(preset, batch, context, "out of memory"))
        member = None  # no cache of a refused member outlives the check of the next
    times = _time_interleaved(members, Timer(device), grid)
    rows += [
        _refused(m.preset, batch, context, "out of memory while timed")
        for m in members
        if m.preset not in times
    ]
    measured = [_row(m, times[m.preset], width) for m in members if m.preset in times]
    del members
    release_memory()
    return _with_ratios(_flag_mixed_attention(measured), times, baseline) + rows


def _flag_mixed_attention(rows: list[dict]) -> list[dict]:
    """Mark the cell's rows of a phase whose members ran different attention kernels: their ratio compares
    kernels, not families (the fairness rule)."""
    for what in ("prefill", "decode"):
        if len({r[f"attention_{what}"] for r in rows}) > 1:
            for r in rows:
                r[f"attention_{what}_mixed"] = True
    return rows


def _time_interleaved(members: list, timer: Timer, grid: "Grid") -> dict[str, dict[str, list]]:
    """Each member's prefill and decode times, one call each per round; a member out of memory drops out. Prefill,
    already run twice (to build XL's table, then counted), is timed in the first ``grid.prefill_rounds`` rounds
    after the warm-up: at long contexts it is the cell's longest call, and the steadiest."""
    times = {m.preset: {"prefill": [], "decode": []} for m in members}
    for round_ in range(-grid.warmup, grid.rounds):
        for member in members:
            if member.preset not in times:
                continue
            timed = ("prefill", "decode") if 0 <= round_ < grid.prefill_rounds else ("decode",)
            ms = unless_oom(lambda member=member, timed=timed: [timer(getattr(member, w)) for w in timed])
            if ms is None:
                del times[member.preset]
            elif round_ >= 0:
                for what, t in zip(timed, ms, strict=True):
                    times[member.preset][what].append(t)
    return times


def _refused(preset: str, batch: int, context: int, reason: str) -> dict:
    return {"preset": preset, "batch": batch, "context": context, "status": "OOM", "reason": reason}


def _row(member: Member, times: dict, width: int) -> dict:
    cfg, batch, context = member.cfg, member.batch, member.context
    prefill, decode = statistics.median(times["prefill"]), statistics.median(times["decode"])
    tables = member.cache.tables
    return {
        "preset": member.preset,
        "batch": batch,
        "context": context,
        "status": "ok",
        "attention_prefill": member.kernels["prefill"],
        "attention_decode": member.kernels["decode"],
        "kv_cache_bytes_per_token_measured": member.cache.nbytes / (batch * member.cache.capacity),
        "position_table_bytes": sum(
            t.numel() * t.element_size() for k, t in tables.items() if k != "capacity"
        ),
        "prefill_ms": prefill,
        "prefill_ms_iqr": iqr(times["prefill"]),
        "prefill_tokens_per_s": batch * context / prefill * 1e3,
        "prefill_macs": member.prefill_macs,
        "decode_ms": decode,
        "decode_ms_iqr": iqr(times["decode"]),
        "decode_tokens_per_s": batch / decode * 1e3,
        "decode_macs": member.decode_macs,
        "decode_bytes_read": sizing.decode_bytes(cfg, batch, context, width),
        "max_batch_at_context": None,  # filled with the run's memory
    }


def _with_ratios(rows: list[dict], times: dict, base: str) -> list[dict]:
    """Each member's paired per-round time ratios to ``base`` (the group's dense baseline), if it was timed."""
    if base not in times:
        return rows
    for row in rows:
        for what in ("prefill", "decode"):
            paired = [a / b for a, b in zip(times[row["preset"]][what], times[base][what], strict=True)]
            row[f"ratio_{what}_time"] = statistics.median(paired)
        row["baseline"] = base
    return rows


def with_floors(rows: list[dict], peak_tflops: float, bandwidth_gbs: float, memory: int, width: int) -> None:
    """Each timed row's floors (MACs at the matmul peak; decode also bytes at the memory bandwidth), its time
    over them, its fraction of the peak, the largest batch at its context, and the floor ratios to its
    baseline."""
    for row in rows:
        if row.get("status") != "ok":
            continue
        cfg = from_name(row["preset"])
        row["prefill_floor_ms"] = row["prefill_macs"] * 2 / (peak_tflops * 1e9)
        compute = row["decode_macs"] * 2 / (peak_tflops * 1e9)
        row["decode_floor_ms"] = max(compute, row["decode_bytes_read"] / (bandwidth_gbs * 1e6))
        row["decode_bound"] = "memory" if row["decode_floor_ms"] > compute else "compute"
        for what in ("prefill", "decode"):
            row[f"{what}_time_over_floor"] = row[f"{what}_ms"] / row[f"{what}_floor_ms"]
        row["prefill_fraction_of_matmul_peak"] = row["prefill_floor_ms"] / row["prefill_ms"]
        row["max_batch_at_context"] = sizing.max_batch(cfg, row["context"], memory, width)
    by_cell = {(r["preset"], r["batch"], r["context"]): r for r in rows if r.get("status") == "ok"}
    for row in by_cell.values():
        base = by_cell.get((row.get("baseline"), row["batch"], row["context"]))
        if base is None:  # the baseline was not timed: no ratio
            continue
        for what in ("prefill", "decode"):
            row[f"ratio_{what}_floor"] = row[f"{what}_floor_ms"] / base[f"{what}_floor_ms"]
        row["ratio_kv_cache_bytes"] = row["kv_cache_bytes_per_token"] / base["kv_cache_bytes_per_token"]


def preset_rows(presets, device: str, width: int) -> tuple[list[str], list[dict]]:
    """The presets that pass the decoding check, and one row per preset: its family, cache per token and check (or
    why it is not timed)."""
    ready, rows = [], []
    for preset in presets:
        cfg = from_name(preset)
        row = {
            "preset": preset,
            "family": cfg.family.label,
            "kv_cache_bytes_per_token": sizing.kv_bytes_per_token(cfg, width),
        }
        if cfg.family.kv_cache is None:
            rows.append(row | {"status": "no decode path"})
            continue
        diff = decoding_check(preset, device)
        row["max_abs_diff_vs_forward"] = diff
        if not diff <= TOLERANCE:  # NaN too
            rows.append(
                row | {"status": "wrong", "reason": f"decoding differs from the forward pass by {diff:.3g}"}
            )
            continue
        ready.append(preset)
        rows.append(row)
    return ready, rows


def run(grid: "Grid", device: str, dtype: torch.dtype, saved=lambda rows: None, earlier=()) -> list[dict]:
    """Every group's cells in turn, but those of ``earlier`` (the rows of a run stopped midway, continued);
    ``saved`` is given the rows so far after each cell, so a run stopped midway (a GPU node's slice of time
    ending) keeps what it measured."""
    from tqdm import tqdm

    width = torch.empty((), dtype=dtype).element_size()
    done = _cells(earlier)
    rows = list(earlier)
    for group, presets in grid.groups.items():
        cells = [(b, c) for b in grid.batches for c in grid.contexts if (group, b, c) not in done]
        if not cells:
            continue
        ready, checked = preset_rows(presets, device, width)
        per_preset = {r["preset"]: r for r in checked}
        if not any(r["group"] == group for r in earlier):  # else the earlier part holds them
            rows += [r | {"group": group} for r in checked if r.get("status") in ("no decode path", "wrong")]
        # built once for the group, long enough for its longest context: a cell gives each its cache
        models = {preset: served(preset, max(grid.contexts) + 1, device, dtype) for preset in ready}
        for batch, context in tqdm(cells, desc=f"decode {group}", disable=None):
            cell = time_cell(models, batch, context, device, dtype, grid, baseline=presets[0])
            rows += [per_preset[r["preset"]] | r | {"group": group} for r in cell]
            saved(rows)
        del models
        release_memory()
    return rows


def _cells(rows) -> set[tuple]:
    """The (group, batch, context) cells that ``rows`` measured or refused."""
    return {(r["group"], r["batch"], r["context"]) for r in rows if "batch" in r}


def count_rows(groups: dict, contexts, memory: int, width: int) -> list[dict]:
    """Per preset, counted only: what its cache holds per token, and the largest batch of each context in
    ``memory``, with ratios to the group's first preset."""
    rows = []
    for group, presets in groups.items():
        base = sizing.kv_bytes_per_token(from_name(presets[0]), width)
        for preset in presets:
            cfg = from_name(preset)
            per_token = sizing.kv_bytes_per_token(cfg, width)
            row = {
                "group": group,
                "preset": preset,
                "family": cfg.family.label,
                "kv_cache_bytes_per_token": per_token,
            }
            if per_token is None:
                rows.append(row | {"status": "no decode path"})
                continue
            entries = cfg.family.kv_cache(cfg)
            row["cache_entries"] = ", ".join(f"{e.what} ({e.heads} x {e.width})" for e in entries)
            row["ratio_kv_cache_bytes"] = per_token / base if base else None
            row |= {f"max_batch_at_{c}": sizing.max_batch(cfg, c, memory, width) for c in contexts}
            rows.append(row)
    return rows


def register(commands) -> None:
    parser = commands.add_parser(
        "decode", help="inference: KV cache per token, prefill and decode, ratios to dense"
    )
    parser.add_argument("presets", nargs="*", help="one group, the first its baseline (default: --groups)")
    parser.add_argument(
        "--groups",
        nargs="+",
        help=f"preset groups (default: {', '.join(GPU_GROUPS)} on a GPU, {', '.join(CPU_GROUPS)} on the CPU)",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="weights and cache (default: bf16 on a GPU, fp32 on the CPU)"
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        type=int,
        action=Distinct,
        help="sequences decoded together (default: 1 16 64 on a GPU, 1 4 on the CPU)",
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        action=Distinct,
        help="tokens in the cache (default: 512 2048 8192 on a GPU, 64 256 on the CPU)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=TIMING["rounds"],
        help="timed rounds after warm-up (default %(default)s)",
    )
    parser.add_argument(
        "--warmup", type=int, default=TIMING["warmup"], help="untimed rounds first (default: %(default)s)"
    )
    parser.add_argument(
        "--prefill-rounds",
        type=int,
        default=TIMING["prefill_rounds"],
        help="of the timed rounds, those that time prefill too (default %(default)s)",
    )
    parser.add_argument("--threads", type=int, help="intra-op threads on the CPU (default: PyTorch's)")
    parser.add_argument(
        "--memory-gib", type=float, help="memory for the largest batch per context (default: the device's)"
    )
    parser.add_argument(
        "--count",
        action="store_true",
        help="the cache sizes and largest batches only, counted (no model built)",
    )
    parser.add_argument(
        "--out", default="results/decode", help="results go to OUT/<device>/ (default: %(default)s)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run in OUT/<device>/ stopped midway on this grid: its finished cells are kept,"
        " the others measured into its files (without one, a new run)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_kernel_choices(parser)
    parser.set_defaults(run=_run)


def _nothing_timed(args) -> None:
    """A one-line ValueError naming the flags given to --count that only a timed run reads (--count ignored them)."""
    given = [
        f"--{name.replace('_', '-')}" for name, default in TIMING.items() if getattr(args, name) != default
    ]
    given += [flag for flag, value in (("--batches", args.batches), ("--threads", args.threads)) if value]
    given += ["--resume"] * args.resume
    if given:
        raise ValueError(f"{', '.join(given)}: --count times nothing (it counts caches and largest batches)")


def _run(args) -> int:
    device = device_from_args(args.device)
    writable_folder(Path(args.out))
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    batches, contexts = args.batches or GRIDS[device][0], args.contexts or GRIDS[device][1]
    at_least({"--batches": (min(batches), 1), "--contexts": (min(contexts), 1), "--rounds": (args.rounds, 1)})
    at_least({"--prefill-rounds": (args.prefill_rounds, 1), "--warmup": (args.warmup, 0)})
    if max(contexts) >= LARGEST_INT:  # a model is served one longer than its longest context
        raise ValueError(
            f"--contexts must be <= {LARGEST_INT - 1} (a model is served one token longer); got {max(contexts)}"
        )
    # prefill is timed in the first of the timed rounds: the default (3) shrinks to fewer rounds, a count given does not
    if args.prefill_rounds > args.rounds and args.prefill_rounds != TIMING["prefill_rounds"]:
        raise ValueError(f"--prefill-rounds ({args.prefill_rounds}) must be <= --rounds ({args.rounds})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1; got {args.threads}")
    if args.memory_gib is not None and not 0 < args.memory_gib <= 2**20:
        raise ValueError(f"--memory-gib must be a positive number of GiB up to 2**20; got {args.memory_gib}")
    groups = preset_groups(args.presets, args.groups, GPU_GROUPS if device == "cuda" else CPU_GROUPS)
    memory = int(args.memory_gib * 2**30) if args.memory_gib else total_memory(device)
    width = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    if args.count:
        _nothing_timed(args)
        sized = {"dtype": dtype_name, "memory_for_max_batch_bytes": memory}  # what every count depends on
        rows = [r | sized for r in count_rows(groups, contexts, memory, width)]
        if not args.json:
            print(f"{dtype_name} cache ({width} bytes a number)")
        emit(rows, args.json, [_counted(r, contexts) for r in rows])
        if not args.json:
            print(_max_batch_note(rows, memory, args.memory_gib is not None))
        return 0
    needs = {
        f"{preset} at batch {b}, context {c}": sizing.peak_bytes(cfg, b, c + 1, min(c, PREFILL_CHUNK), width)
        for preset in dict.fromkeys(p for presets in groups.values() for p in presets)
        if (cfg := from_name(preset)).family.kv_cache is not None
        for b in batches
        for c in contexts
    }
    some_case_fits(needs, free_memory(device))
    grid = Grid(
        groups, tuple(batches), tuple(contexts), args.rounds, args.warmup, memory, args.prefill_rounds
    )
    with intra_op_threads(args.threads):
        metadata, rows, path = measure(
            grid, device, dtype_name, Path(args.out), args.expert_matmul, resume=args.resume
        )
    if args.json:
        print(json.dumps({"metadata": metadata, "rows": rows, "saved": str(path)}, indent=2))
    else:
        print(
            f"{metadata['device']}, {dtype_name}; matmul peak {metadata['matmul_peak_tflops']:.3g} TFLOP/s, "
            f"memory bandwidth {metadata['memory_bandwidth_gbs']:.3g} GB/s (both measured)"
        )
        print(pd.DataFrame([_printed(r) for r in rows]).to_string(index=False))
        print(_max_batch_note(rows, memory, args.memory_gib is not None))
        print(f"saved {path}")
    return nothing_measured(rows, "decode", path, timed="decode_ms")


@dataclass(frozen=True)
class Grid:
    """What a decode run measures: its groups (the first preset of each its baseline), batch x context, the rounds
    timed after warm-up (prefill in the first ``prefill_rounds`` of them), and the memory the largest batch per
    context is sized for."""

    groups: dict
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    rounds: int
    warmup: int
    memory: int
    prefill_rounds: int = 3


def measure(
    grid: Grid,
    device: str,
    dtype_name: str,
    out: Path,
    expert_matmul: str,
    extra: dict | None = None,
    resume: bool = False,
):
    """Run ``grid``, put each row beside its floors, save the run under ``out``/<device>/; -> (metadata, rows,
    the JSON's path). ``extra``: more metadata (a job's provenance). ``resume``: continue the newest run there
    that stopped midway on the same grid (its finished cells kept, the rest measured into its files)."""
    dtype = DTYPES[dtype_name]
    width = torch.empty((), dtype=dtype).element_size()
    kernels = kernel_metadata(expert_matmul, device)
    folder = out / slug(environment(device)["device"])
    # each run read, and a broken one named, before the yardsticks are measured
    runs = _runs(folder) if resume else {}
    measured = _metadata(grid, device, dtype_name) | {k: kernels[k] for k in SAME_KERNELS} | (extra or {})
    earlier, stem = [], new_run_stem(folder, f"{dtype_name}-decode")
    if resume and (unfinished := _unfinished(runs, measured)):
        stem, earlier_run = unfinished.with_suffix(""), runs[unfinished]
        earlier = earlier_run["rows"]
        kept = {k: earlier_run["metadata"].get(k) for k in ("commit", "time", "cells_done")}
        # this part's own yardsticks go on record; every row's floors stay against the first part's, so the cells
        # kept are as they were and all cells of the run are put beside one peak and one bandwidth
        here = {f"{k}_here": measured[k] for k in YARDSTICKS}
        measured |= {k: earlier_run["metadata"][k] for k in YARDSTICKS}
        measured["resumed"] = [*earlier_run["metadata"].get("resumed", []), kept | here]
    cells = len(grid.groups) * len(grid.batches) * len(grid.contexts)

    def save(rows: list[dict]) -> tuple[dict, list[dict], Path]:
        """The run so far, each row beside its floors, written over the last save: one run, one pair of files."""
        rows = [dict(r) for r in rows]
        with_floors(
            rows, measured["matmul_peak_tflops"], measured["memory_bandwidth_gbs"], grid.memory, width
        )
        done = len(_cells(rows))
        metadata = measured | kernel_metadata(expert_matmul, device) | {"cells_done": done, "cells": cells}
        return metadata, rows, save_run(folder, stem.name, metadata, rows, stem)

    return save(run(grid, device, dtype, save, earlier))


# What makes a stopped run one to continue: the same device and grid, measured the same way (threads and kernels)
SAME_KERNELS = ("expert_matmul", "attention", "routing_resolved")
SAME_GRID = (
    "device",
    "dtype",
    "groups",
    "batches",
    "contexts",
    "rounds",
    "warmup",
    "prefill_rounds",
    "memory_for_max_batch_bytes",
    "threads",
    "bytes_read",  # how a decode step's bytes are counted: a run counted otherwise is not continued
    *SAME_KERNELS,
)
YARDSTICKS = ("matmul_peak_tflops", "memory_bandwidth_gbs")  # what every row's floors are computed against
# What with_floors reads of each timed row a resumed run keeps
FLOORED = dict.fromkeys(
    (
        "prefill_ms",
        "decode_ms",
        "prefill_macs",
        "decode_macs",
        "decode_bytes_read",
        "kv_cache_bytes_per_token",
    ),
    schema.NUMBER,
)
# What --resume reads of a run's metadata
RESUMED = {k: schema.NUMBER for k in YARDSTICKS} | {"cells_done": schema.INTEGER, "cells": schema.INTEGER}


def _read_run(path: Path) -> dict:
    """A decode run's JSON with what --resume reads of it; a one-line ValueError naming ``path`` where it has not
    (--resume would guess, or fail after measuring)."""
    try:
        run = schema.read_run(path, "decode")
        schema.check_fields(
            path, run.get("metadata", {}), RESUMED, "metadata", optional=("cells_done", "cells")
        )
        for i, row in enumerate(run["rows"]):
            cell = {"batch": schema.INTEGER, "context": schema.INTEGER} if "batch" in row else {}
            schema.check_fields(path, row, {"group": schema.TEXT} | cell, f"row {i}")
            if cell and not all(1 <= row[k] < LARGEST_INT for k in cell):
                raise ValueError(f"{path}: row {i}: batch and context must be in [1, {LARGEST_INT})")
            if row.get("status") == "ok":
                schema.check_fields(path, row, {"preset": schema.TEXT} | FLOORED, f"row {i}")
                if not all(math.isfinite(row[k]) and row[k] > 0 for k in FLOORED):
                    raise ValueError(f"{path}: row {i}: {', '.join(FLOORED)} must be finite and > 0")
                from_name(row["preset"])
        if not all(math.isfinite(run["metadata"][k]) and run["metadata"][k] > 0 for k in YARDSTICKS):
            raise ValueError(f"{path}: metadata: {', '.join(YARDSTICKS)} must be finite and > 0")
    except ValueError as error:
        raise ValueError(f"--resume: {error}; move it away, or run without --resume") from None
    return run


def _runs(folder: Path) -> dict[Path, dict]:
    """The decode runs in ``folder``, newest first."""
    return {
        p: _read_run(p) for p in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    }


def _unfinished(runs: dict[Path, dict], metadata: dict) -> Path | None:
    """The newest of ``runs`` stopped before its last cell on the grid ``metadata`` describes, or None."""
    for path, run in runs.items():
        earlier = run.get("metadata", {})
        same = all(earlier.get(key) == metadata[key] for key in SAME_GRID)
        if same and earlier.get("cells_done", 0) < earlier.get("cells", 0):
            return path
    return None


def _metadata(grid: Grid, device: str, dtype_name: str) -> dict:
    dtype = DTYPES[dtype_name]
    return environment(device) | {
        "dtype": dtype_name,
        "matmul_peak_tflops": matmul_peak_tflops(device, dtype),
        "memory_bandwidth_gbs": memory_bandwidth_gbs(device),
        "memory_for_max_batch_bytes": grid.memory,
        "rounds": grid.rounds,
        "warmup": grid.warmup,
        "prefill_rounds": min(grid.prefill_rounds, grid.rounds),
        "threads": torch.get_num_threads(),
        "batches": list(grid.batches),
        "contexts": list(grid.contexts),
        "clock": "wall",
        "prefill_chunk": PREFILL_CHUNK,
        "attention_span": "the whole sequence (one chunk of T = the longest context + 1, no window)",
        "groups": {g: list(p) for g, p in grid.groups.items()},
        "bytes_read": sizing.BYTES_READ,
    }


def _max_batch_note(rows: list[dict], memory: int, given: bool) -> str:
    """What the max batch columns are sized for, which a measured batch does not depend on; and what a 0 means."""
    where = "--memory-gib" if given else "the device's memory"
    note = f"max batch: the most sequences whose caches fit {memory / 2**30:.4g} GiB ({where}) beside the weights"
    zero = any(v == 0 for r in rows for k, v in r.items() if k.startswith("max_batch_at_"))
    return note + ("; 0: not one sequence's cache fits" if zero else "")


def _counted(r: dict, contexts) -> dict:
    per_token = r["kv_cache_bytes_per_token"]
    return {
        "preset": r["preset"],
        "family": r["family"],
        "KV bytes/token": "no decode path" if per_token is None else f"{per_token:,}",
        "vs first": f"{r['ratio_kv_cache_bytes']:.2f}" if r.get("ratio_kv_cache_bytes") is not None else "",
        **{f"max batch @{c}": f"{r[f'max_batch_at_{c}']:,}" for c in contexts if f"max_batch_at_{c}" in r},
        "cached per token and layer": r.get("cache_entries", ""),
    }


def below_floor(r: dict, what: str = "decode") -> bool:
    """Whether a phase's time ratio beats the ratio of its members' floors: the baseline then ran further below
    what its hardware allows, not the model fast (``speed.below_floor`` for a training step)."""
    ratio, floor = r.get(f"ratio_{what}_time"), r.get(f"ratio_{what}_floor")
    return ratio is not None and floor is not None and ratio < floor


def _relative(r: dict, what: str) -> str:
    """A phase's time against its baseline's, marked where its members ran different attention kernels or where
    it beats the floor ratio."""
    if r.get(f"ratio_{what}_time") is None:
        return ""
    marks = [" (mixed!)"] if r.get(f"attention_{what}_mixed") else []
    marks += [" (baseline suspect)"] if below_floor(r, what) else []
    return f"{r[f'ratio_{what}_time']:.2f}" + "".join(marks)


def _printed(r: dict) -> dict:
    def fmt(key, spec=".3g"):
        return format(r[key], spec) if r.get(key) is not None else ""

    return {
        "preset": r["preset"],
        "batch": r.get("batch", ""),
        "context": r.get("context", ""),
        "KV B/token": fmt("kv_cache_bytes_per_token", ",") if r.get("kv_cache_bytes_per_token") else "-",
        "prefill ms": fmt("prefill_ms") or r.get("status", ""),
        "prefill/floor": fmt("prefill_time_over_floor", ".2f"),
        "rel. prefill": _relative(r, "prefill"),
        "rel. prefill floor": fmt("ratio_prefill_floor", ".2f"),
        "prefill of peak": fmt("prefill_fraction_of_matmul_peak", ".1%"),
        "decode ms": fmt("decode_ms"),
        "tokens/s": fmt("decode_tokens_per_s", ",.0f"),
        "decode/floor": fmt("decode_time_over_floor", ".2f"),
        "rel. decode": _relative(r, "decode"),
        "rel. decode floor": fmt("ratio_decode_floor", ".2f"),
        "rel. KV": fmt("ratio_kv_cache_bytes", ".2f"),
        "max batch": fmt("max_batch_at_context", ","),
        "attention (decode)": r.get("attention_decode", ""),
    }
