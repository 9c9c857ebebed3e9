"""Ahead-of-time compilation of the suite's Triton kernels for a named GPU, without one.

Each kernel launch of the expert matmul's forward and backward, of the position bias's (Transformer-XL's
relative term as SDPA reads it) and of routing's Triton top-k and grouping, is recorded on meta tensors of a preset's shapes, then compiled with
``triton.compile`` for ``GPUTarget("cuda", cc, 32)`` once per autotune configuration the launcher offers, with the
ptxas that ships in the triton wheel. The arguments are specialised the way the JIT
specialises them (an integer 1 becomes a constant, multiples of 16 and tensor pointers are marked 16-divisible).
From the result: registers and stack frame (spills: these kernels have no local arrays) from
``cuobjdump --dump-resource-usage``, shared memory from the metadata, and from the PTX whether the matmul uses
``wgmma`` (Hopper), ``mma.sync`` (Ampere) or plain FMA and whether loads are pipelined (``cp.async``/TMA).

Compilation runs in a subprocess with ``TRITON_INTERPRET`` unset: under the interpreter ``triton.jit`` builds
no compilable functions.
"""

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from switchbench.bench.command import DTYPES, Distinct
from switchbench.bench.kernels import roofline
from switchbench.bench.kernels.bench import Case, add_sizes, attention_shapes, cases
from switchbench.models import family as registry
from switchbench.models.layers.router import FEW_EXPERTS
from switchbench.models.presets import PRESETS

ARCHS = {"sm_90": 90, "sm_80": 80}
# Shared memory one block may take (CUDA's programming guide, compute capabilities): a kernel over it compiles but
# cannot launch
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
_POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.uint8: "*u8",
}
EXPERT_KERNELS = "switchbench.ops.expert_matmul.triton_kernels"
POSITION_KERNELS = "switchbench.ops.attention.position_kernels"
FLASH_KERNELS = "switchbench.ops.attention.flash"
ROUTING_KERNELS = "switchbench.ops.expert_matmul.routing_kernels"
SLOT_KERNELS = "switchbench.ops.expert_matmul.slot_kernels"
# kernels with no MMA to expect: the position bias's memory-bound copies, routing's comparisons and counts,
# all_experts' passes around its GEMMs
MATMUL_FREE = ("spread", "gather", "top_k", "count", "place", "lay_out", "gate_sum", "pick")
JIT_DEFAULTS = {"num_warps": 4, "num_stages": 3}  # how a kernel launched without a configuration compiles
COLUMNS = [
    "kernel",
    "case",
    "dtype",
    "arch",
    "config",
    "compiled",
    "registers",
    "spill_bytes",
    "shared_bytes",
]
COLUMNS += ["mma", "pipelined"]


def register(commands) -> None:
    parser = commands.add_parser(
        "kernel-check",
        help="compile the Triton kernels (expert matmul, flash attention, position bias, routing) for a GPU, "
        "no GPU needed",
    )
    parser.add_argument(
        "--arch",
        nargs="+",
        choices=list(ARCHS),
        default=["sm_90"],
        action=Distinct,
        help="targets (default sm_90: Hopper)",
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=list(DTYPES), default=["bf16"], action=Distinct, help="default bf16"
    )
    add_sizes(parser)  # both, as kernel-bench and kernel-tune: a bare run skipped the 47M shapes
    parser.add_argument("--batch", type=int, default=64, help="sequences, for the roofline (default 64)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    if args.batch < 1:
        raise ValueError(f"batch must be >= 1; got {args.batch}")
    rows = pd.DataFrame(check(args.arch, args.dtype, args.sizes), columns=COLUMNS)
    estimate = pd.DataFrame(roofline.table(args.sizes, args.batch, args.dtype))
    failed = rows[failing(rows)]
    compiler = f"Triton {importlib.metadata.version('triton')}"  # spills differ between versions
    if args.json:
        out = {"rows": rows.to_dict("records"), "roofline": estimate.to_dict("records")}
        print(json.dumps(out | {"failed": len(failed), "compiler": compiler}, indent=2, default=str))
    else:
        print(rows.to_markdown(index=False))
        print(f"\nroofline at batch {args.batch} (ms; bytes and MACs per pass, fwd+bwd):")
        print(estimate.to_markdown(index=False, floatfmt=".4g"))
        print(
            f"\n{len(rows)} cases compiled by {compiler}, {len(failed)} failing (compile error, spill, shared memory"
            " or no tensor-core MMA)"
        )
    return 1 if len(failed) else 0  # a CI step can tell a spill on sm_90 from a clean build


def failing(rows: pd.DataFrame) -> pd.Series:
    """A compile error, a spill, more shared memory than a block of the arch may take, or a matmul kernel without
    the arch's tensor-core MMA (wgmma on sm_90, mma.sync before)."""
    expected = rows.arch.map(lambda arch: "wgmma" if ARCHS[arch] >= 90 else "mma.sync")
    matmul = ~rows.kernel.str.startswith(MATMUL_FREE)
    too_much_shared = rows.shared_bytes.fillna(0) > rows.arch.map(SHARED_LIMIT)
    return (
        ~rows.compiled.astype(bool)
        | (rows.spill_bytes.fillna(0) > 0)
        | too_much_shared
        | (matmul & (rows.mma != expected))
    )


def check(archs: list[str], dtypes: list[str], sizes: list[str]) -> list[dict]:
    """One row per kernel x case x dtype x arch x config, compiled in a clean subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning; the default it keeps
    request = json.dumps({"archs": archs, "dtypes": dtypes, "sizes": sizes})
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen([sys.executable, "-m", __name__], text=True, env=env, **pipes) as worker:
        worker.stdin.write(request)
        worker.stdin.close()
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(worker.stdout.read()))
        reader.start()
        errors = _follow(worker.stderr)
        reader.join()
    if worker.returncode:
        raise RuntimeError(f"kernel-check worker failed:\n{''.join(errors)[-4000:]}")
    return json.loads(out[0])


# How the worker reports each compiled kernel on its stderr: PROGRESS done total
PROGRESS = "kernel-check-progress"


def _follow(stderr) -> list[str]:
    """The worker's stderr, read to its end: its progress lines shown as a bar (a terminal's alone: tqdm's
    disable=None), every other line kept for the error."""
    errors = []
    with tqdm(desc="kernel-check: compiling", unit="kernel", disable=None) as bar:
        for line in stderr:
            if line.startswith(PROGRESS):
                done, bar.total = map(int, line.split()[1:])
                bar.update(done - bar.n)
            else:
                errors.append(line)
    return errors


def launches(case: Case, dtype: torch.dtype) -> list[tuple[str, object, object, tuple, dict]]:
    """(pass, kernel, autotuner, args, constexprs) of every kernel launch of the op at ``case``'s shapes."""
    from switchbench.ops.expert_matmul import triton_kernels as kernels

    n, e = case.tokens, case.groups * case.experts_per_group
    meta = {"device": "meta"}
    x = torch.empty(n, case.in_groups, case.d_in, dtype=dtype, **meta)
    weight = torch.empty(e, case.d_in, case.d_out, dtype=dtype, **meta)
    scores = torch.empty(n, e, dtype=dtype, **meta) if case.gated else None
    indices = torch.empty(n, case.slots, dtype=torch.long, **meta)
    order = experts = torch.empty(n * case.slots, dtype=torch.long, **meta)
    offsets = torch.empty(e + 1, dtype=torch.long, **meta)
    grad_out = torch.empty(n, case.out_groups, case.d_out, dtype=dtype, **meta)
    routing = (indices, order, experts, offsets)
    with kernels.recording() as forward:
        kernels.forward(x, weight, scores, *routing, case.out_groups)
    with kernels.recording() as backward:
        kernels.backward(grad_out, x, weight, scores, *routing)
    return [("forward", *launch) for launch in forward] + [("backward", *launch) for launch in backward]


def all_experts_launches(case: Case, dtype: torch.dtype) -> list[tuple[str, object, tuple, dict]]:
    """(pass, kernel, args, constexprs) of the Triton passes all_experts runs around its GEMMs on CUDA at ``case``'s
    shapes: in the form of one input group each slot's row picked from every expert's output, the gating and its
    gradients (gated) and the output gradient laid out by expert; in that of one output group the (gated) input
    rows laid out (in the forward, and the same again for the weight gradient) and the input gradient picked back
    from the experts' places. None for groups it cannot run."""
    from switchbench.ops.expert_matmul import all_experts, slot_kernels

    n, s, e, d_in, d_out = case.tokens, case.slots, case.n_experts, case.d_in, case.d_out
    if all_experts.unavailable(case.in_groups, case.out_groups):
        return []
    meta = {"dtype": dtype, "device": "meta"}
    indices = torch.empty(n, s, dtype=torch.long, device="meta")
    scores = torch.empty(n, e, **meta) if case.gated else None
    x = torch.empty(n, case.in_groups, d_in, **meta)
    y = torch.empty(n, s, d_out, **meta)  # the slots' ungated outputs, where the gates are applied outside
    grad = torch.empty(n, case.out_groups, d_out, **meta)
    by_input = all_experts.gates_outside(case.in_groups, case.out_groups, d_in, d_out)
    with slot_kernels.recording() as forward:
        if not by_input:
            slot_kernels.lay_out(x, indices, e, scores)
        else:  # each slot's row of every expert's output (one a slot where gated), then the gating
            groups = s if scores is not None else case.out_groups
            slot_kernels.pick(torch.empty(n, e, d_out, **meta), indices, groups)
            if scores is not None:
                slot_kernels.gate_sum(y, scores, indices, case.out_groups)
    with slot_kernels.recording() as backward:
        if not by_input:
            slot_kernels.pick(torch.empty(n, e, d_in, **meta), indices, case.in_groups, scores, x)
        elif scores is not None:
            slot_kernels.gate_sum_backward(grad, y, scores, indices)
            slot_kernels.lay_out(y, indices, e)  # the op's output gradient: a row a slot
        else:
            slot_kernels.lay_out(grad, indices, e)
    return [("forward", *launch) for launch in forward] + [("backward", *launch) for launch in backward]


def _specialise(fn, args: tuple, constants: dict) -> tuple[dict, dict, dict]:
    """signature, constexprs and 16-divisible arguments as the JIT would derive them from these arguments."""
    values = dict(zip(fn.arg_names, args, strict=False)) | constants
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = values[name]
        if name in constants or value is None or (type(value) is int and value == 1):
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = _POINTER[value.dtype], 16
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = 16
    return signature, constexprs, attrs


def _jobs(archs, dtypes, sizes) -> list[tuple[dict, tuple]]:
    """(row, compile job) for every case; equal jobs compile once."""
    from switchbench.ops.expert_matmul.triton_kernels import config_label

    out = []
    for size in sizes:
        for dtype_name in dtypes:
            for case_name, module, phase, fn, args, constants, config in _launches(size, DTYPES[dtype_name]):
                signature, constexprs, attrs = _specialise(fn, args, constants | config.kwargs)
                label = config_label(config)
                job = (module, fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(attrs))
                for arch in archs:
                    row = {"kernel": f"{fn.__name__.strip('_').removesuffix('_kernel')} ({phase})"}
                    row |= {"case": case_name, "dtype": dtype_name, "arch": arch, "config": label}
                    out.append((row, (*job, config.num_warps, config.num_stages, ARCHS[arch])))
    return out


def _launches(size: str, dtype: torch.dtype):
    """(case, module, pass, kernel, arguments, constexprs, configuration) of every launch to compile at ``size``:
    each autotune configuration of the expert matmul's cases; the position bias at the dense preset's window; each
    candidate of flash attention over every family's window; and each router's Triton routing (``--routing
    triton``), with the configuration the JIT gives a launch that names none."""
    import triton

    from switchbench.ops.attention import flash, position_kernels
    from switchbench.ops.expert_matmul import routing_kernels

    for case in cases(size, batch=1)[:-1]:  # the six expert-matmul uses; the last is one dense expert
        for phase, fn, tuned, args, constants in launches(case, dtype):
            for config in _configs(tuned, fn, args, constants):
                yield case.name, EXPERT_KERNELS, phase, fn, args, constants, config
        for phase, fn, args, constants in all_experts_launches(case, dtype):
            config = triton.Config({k: constants.pop(k) for k in ("TOKENS", "WIDTH")}, **JIT_DEFAULTS)
            yield f"{case.name} all_experts", SLOT_KERNELS, phase, fn, args, constants, config
    cfg = PRESETS[registry.get("transformer").roles[size]]
    t, S = cfg.T, cfg.T * (1 + cfg.context_blocks)
    for phase, fn, args, constants in position_kernels.launches(t, S, cfg.n_heads, dtype):
        config = triton.Config({"BLOCK": constants.pop("BLOCK")}, **JIT_DEFAULTS)
        yield f"{size} position bias", POSITION_KERNELS, phase, fn, args, constants, config
    # Triton's flash attention (--attention triton) over every family's distinct window, XL's and RoPE's
    for shape in attention_shapes(size):
        dims = (shape.heads, shape.key_heads, shape.queries, shape.keys, shape.width)
        for phase, fn, args, constants in flash.launches(1, *dims, dtype, shape.term):
            blocks = {name: constants.pop(name) for name in ("BLOCK_M", "BLOCK_N")}
            warps, stages = constants.pop("num_warps"), constants.pop("num_stages")
            config = triton.Config(blocks, num_warps=warps, num_stages=stages)
            yield shape.label, FLASH_KERNELS, phase, fn, args, constants, config
    routings: dict[tuple, str] = {}  # each router's shape, named by the first case it drives
    for c in cases(size, batch=1):
        if c.n_experts > 1:
            routings.setdefault((c.tokens, c.groups, c.experts_per_group, c.slots), c.name)
    for (tokens, groups, experts, slots), name in routings.items():
        ranked = experts <= FEW_EXPERTS  # more are ranked by torch's top-k
        for phase, fn, args, constants in routing_kernels.launches(tokens, groups, experts, slots, ranked):
            config = triton.Config(constants, **JIT_DEFAULTS)
            yield f"{name} routing", ROUTING_KERNELS, phase, fn, args, {}, config


def _configs(tuned, fn, args, constants) -> list:
    """The configurations the autotuner may pick for these arguments (after its pruning, if any)."""
    prune = getattr(tuned, "early_config_prune", None)
    if prune is None:
        return list(tuned.configs)
    return list(prune(tuned.configs, dict(zip(fn.arg_names, args, strict=False)) | constants))


def _compile(job: tuple) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constexprs, divisible, num_warps, num_stages, capability = job
    target = GPUTarget("cuda", capability, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": num_warps, "num_stages": num_stages}
    )
    attrs = {index: [["tt.divisibility", 16]] for index in divisible}
    source = ASTSource(
        getattr(importlib.import_module(module), name), dict(signature), dict(constexprs), attrs
    )
    try:
        compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as error:  # a failed compile is a result of the check, reported in its row
        return {
            "compiled": False,
            "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
        }
    ptx = compiled.asm["ptx"]
    mma = next((kind for kind in ("wgmma", "mma.sync", "fma") if kind in ptx), "none")
    return {
        "compiled": True,
        **_resources(compiled.asm["cubin"]),
        "shared_bytes": compiled.metadata.shared,
        "mma": mma,
        "pipelined": "cp.async" in ptx,  # cp.async.bulk (TMA) included
    }


def _resources(cubin: bytes) -> dict:
    """Registers per thread and stack frame bytes of a cubin, from the wheel's cuobjdump."""
    import tempfile

    import triton.backends.nvidia

    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", file.name], capture_output=True, text=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(match[1]), "spill_bytes": int(match[2])}


def _worker() -> None:
    import multiprocessing

    request = json.loads(sys.stdin.read())
    jobs = _jobs(request["archs"], request["dtypes"], request["sizes"])
    unique = list(dict.fromkeys(job for _, job in jobs))
    context = multiprocessing.get_context("spawn")
    results = {}
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        for done, (job, result) in enumerate(zip(unique, pool.map(_compile, unique), strict=True), 1):
            results[job] = result
            print(PROGRESS, done, len(unique), file=sys.stderr, flush=True)
    print(json.dumps([row | results[job] for row, job in jobs]))


if __name__ == "__main__":
    _worker()
