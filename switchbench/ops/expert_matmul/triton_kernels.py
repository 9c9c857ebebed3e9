"""Triton kernels of the expert matmul, for CUDA tensors (and CPU tensors under TRITON_INTERPRET=1).

``scatter_matmul``: tiles of BLOCK_M slots, laid out expert by expert over the sorted slots, gather
their input rows, multiply them by their expert's weight with fp32 accumulation, scale by the gate and write
one row per slot; the rows are then summed per output group (a view when a group has one slot). In the
backward the same kernel gives the input gradient and, as an epilogue, the gate gradient: the row-dot of each
ungated slot gradient with its input row, one partial per N tile, summed afterwards (deterministic, no
atomics). ``grouped_outer`` accumulates the weight gradient x^T g over each expert's slots, in fp32 partial sums
over shares of them (split-K) summed afterwards. No capacity, no dropped token; an expert with no slot gets a
zero gradient.

Feature widths that are not a multiple of 16 elements are zero-padded before a kernel sees them, so every row
is 16-byte aligned: the loads vectorise and pipeline (cp.async) and the masks stay uniform.

Tiles run N-fastest, so the CTAs that share a gathered A tile run together and it is read from DRAM once.
Autotuning is keyed on the token-slot count rounded up to a power of two (capped: every large batch shares
one tuning) and cached on disk. SWITCHBENCH_TRITON_CONFIG pins a configuration instead (see ``pinned``); a GPU
whose name is in the package's table of configurations tuned ahead of time (``switchbench kernel-tune``) uses
those, so its first training step does not stall on autotuning.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from switchbench.core.launch_log import LaunchLog
from switchbench.core.versions import NO_BF16_DOT, interpreted_bf16_dot
from switchbench.ops import tuned as tuning
from switchbench.ops.expert_matmul.slot_rows import aligned, group_sum, weight_gradient_range


@triton.jit
def _tile(offsets_ptr, pid, n_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert of the pid-th tile and its slot range [start, end); empty past the last tile."""
    e_ids = tl.arange(0, BLOCK_E)
    lo = tl.load(offsets_ptr + e_ids, mask=e_ids < n_experts, other=0)
    hi = tl.load(offsets_ptr + e_ids + 1, mask=e_ids < n_experts, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    e = tl.sum((tiles_end <= pid).to(tl.int32), 0)
    mine = e_ids == e
    start = (
        tl.sum(tl.where(mine, lo, 0), 0) + (pid - tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)) * BLOCK_M
    )
    end = tl.sum(tl.where(mine, hi, 0), 0)
    return tl.minimum(e, n_experts - 1), start, end


@triton.jit
def _scatter_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    scores_ptr,
    order_ptr,
    offsets_ptr,
    dot_ptr,  # rows whose dot with each ungated output row is the gate gradient (GATE_GRAD)
    partial_ptr,  # [N tiles, slots in all] fp32 partial gate gradients (GATE_GRAD)
    n_experts,
    d_in,
    d_out,
    slots,
    in_groups,
    dot_groups,
    m_total,
    m_bucket,  # autotuning key only
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_sn,
    stride_se,
    stride_dm,
    stride_dn,
    HAS_GATES: tl.constexpr,
    GATE_GRAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(d_out, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // n_tiles, tl.program_id(0) % n_tiles
    e, start, end = _tile(offsets_ptr, pid_m, n_experts, BLOCK_M, BLOCK_E)
    i = start + tl.arange(0, BLOCK_M)
    row_ok = i < end
    slot = tl.load(order_ptr + i, mask=row_ok, other=0).to(tl.int64)
    token, s = slot // slots, slot % slots
    in_row = token * in_groups + s // (slots // in_groups)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_tile = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(start < end, d_in, 0)  # an empty tile skips the loop
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + in_row[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_ok[:, None] & (k[None, :] < d_in),
            other=0.0,
        )
        b = tl.load(
            w_tile + k[:, None] * stride_wk + n[None, :] * stride_wn,
            mask=(k[:, None] < d_in) & (n[None, :] < d_out),
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out_ok = row_ok[:, None] & (n[None, :] < d_out)
    if GATE_GRAD:
        dot_row = token * dot_groups + s // (slots // dot_groups)
        v = tl.load(dot_ptr + dot_row[:, None] * stride_dm + n[None, :] * stride_dn, mask=out_ok, other=0.0)
        tl.store(partial_ptr + pid_n * m_total + slot, tl.sum(acc * v.to(tl.float32), 1), mask=row_ok)
    if HAS_GATES:
        gate = tl.load(scores_ptr + token * stride_sn + e * stride_se, mask=row_ok, other=0.0)
        acc = acc * gate.to(tl.float32)[:, None]
    tl.store(y_ptr + slot[:, None] * d_out + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _grouped_outer_kernel(
    x_ptr,
    g_ptr,
    dw_ptr,  # [SPLIT or more, E, d_in, d_out] fp32: one partial sum per share of each expert's slots
    scores_ptr,
    order_ptr,
    offsets_ptr,
    n_experts,
    d_in,
    d_out,
    slots,
    in_groups,
    out_groups,
    m_bucket,  # autotuning key only
    stride_xm,
    stride_xk,
    stride_gm,
    stride_gn,
    stride_sn,
    stride_se,
    HAS_GATES: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # An expert's output is a few tiles (1024 x 112 at 262M) over thousands of slots: alone, its tiles would fill
    # a fraction of the GPU's SMs for the whole reduction. SPLIT programs share each tile's slots (split-K, as
    # cuBLAS chooses for GEMMs of a long contraction), each writing its own partial: summed afterwards, no atomics.
    # One expert's programs are adjacent (N fastest, then K, then share): they read its rows while in L2.
    k_tiles, n_tiles = tl.cdiv(d_in, BLOCK_K), tl.cdiv(d_out, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // (SPLIT * k_tiles * n_tiles)
    share = pid // (k_tiles * n_tiles) % SPLIT
    k = (pid // n_tiles) % k_tiles * BLOCK_K + tl.arange(0, BLOCK_K)
    n = pid % n_tiles * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.load(offsets_ptr + e)
    last = tl.load(offsets_ptr + e + 1)
    per_share = tl.cdiv(last - first, SPLIT)
    start = first + share * per_share
    end = tl.minimum(start + per_share, last)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for i0 in range(start, end, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        row_ok = i < end
        slot = tl.load(order_ptr + i, mask=row_ok, other=0).to(tl.int64)
        token, s = slot // slots, slot % slots
        in_row = token * in_groups + s // (slots // in_groups)
        out_row = token * out_groups + s // (slots // out_groups)
        a = tl.load(
            x_ptr + in_row[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=row_ok[:, None] & (k[None, :] < d_in),
            other=0.0,
        )
        b = tl.load(
            g_ptr + out_row[:, None] * stride_gm + n[None, :] * stride_gn,
            mask=row_ok[:, None] & (n[None, :] < d_out),
            other=0.0,
        )
        if HAS_GATES:
            gate = tl.load(scores_ptr + token * stride_sn + e * stride_se, mask=row_ok, other=0.0)
            b = (b.to(tl.float32) * gate.to(tl.float32)[:, None]).to(a.dtype)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    partial = (share * n_experts + e).to(tl.int64) * d_in * d_out
    tl.store(
        dw_ptr + partial + k[:, None] * d_out + n[None, :],
        acc,
        mask=(k[:, None] < d_in) & (n[None, :] < d_out),
    )


def _configs(shapes) -> list:
    """Configurations of (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, SPLIT])."""
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k} | dict(zip(("SPLIT",), split, strict=False)),
            num_warps=w,
            num_stages=s,
        )
        for m, n, k, w, s, *split in shapes
    ]


# Each list holds only configurations that kernel-check compiles to wgmma without a spill on sm_90 at the
# presets' shapes. grouped_outer's MMA rows are BLOCK_K, and wgmma needs 64 of them; its SPLIT shares each
# expert's slots between that many programs (the last candidate shares them fewer ways than the one before it: the
# autotuned-path test's winner, whose sum must leave the other's extra partials out).
CONFIGS = {
    "scatter_matmul": _configs(
        [
            (64, 64, 64, 4, 4),
            (128, 64, 64, 4, 4),
            (64, 128, 64, 4, 4),
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3),
        ]
    ),
    "grouped_outer": _configs(
        [
            (64, 64, 64, 4, 3, 1),
            (64, 128, 64, 4, 3, 1),
            (128, 64, 64, 4, 3, 1),
            (64, 128, 128, 8, 3, 1),
            (64, 256, 128, 8, 3, 1),
            (64, 128, 128, 8, 3, 4),
            (64, 64, 64, 4, 3, 4),
            (128, 64, 64, 4, 3, 2),
        ]
    ),
}
# In the interpreter, one small configuration a kernel (timing there means nothing); grouped_outer's shares its
# slots two ways, so that the tests' small cases check the split.
_INTERPRETER_CONFIGS = {
    "scatter_matmul": triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}),
    "grouped_outer": triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT": 2}),
}
ALIGN = 16  # feature widths are padded to this many elements
_BUCKET_CAP = 1 << 18  # slots; past this every batch is "large" and shares one tuning


def config_label(config) -> str:
    """``M128 N128 K64 w8 s3`` (``M64 N128 K128 SPLIT4 w8 s3``): how kernel-check prints a configuration and
    SWITCHBENCH_TRITON_CONFIG names it."""
    tiles = " ".join(f"{name.removeprefix('BLOCK_')}{value}" for name, value in config.kwargs.items())
    return f"{tiles} w{config.num_warps} s{config.num_stages}"


def pinned(kernel: str):
    """The configuration SWITCHBENCH_TRITON_CONFIG pins for ``kernel``, or None (autotune).

    Format: ``scatter_matmul=M128 N128 K64 w8 s3;grouped_outer=M64 N128 K128 SPLIT1 w8 s3``, each one of CONFIGS.
    """
    label = tuning.pinned(kernel)
    return by_label(kernel, label, tuning.ENV) if label else None


def by_label(kernel: str, label: str, where: str):
    """The configuration of ``kernel`` that ``label`` names; a ValueError naming ``where`` it came from."""
    for config in CONFIGS[kernel]:
        if config_label(config) == label:
            return config
    choices = ", ".join(config_label(c) for c in CONFIGS[kernel])
    raise ValueError(f"{where}: {label!r} is not a {kernel} config; one of: {choices}")


def shape_key(m: int, d_in: int, d_out: int, dtype: torch.dtype, **flags: bool) -> str:
    """The tuning key of a launch: the slot-count bucket, the widths, the dtype and the variant's flags."""
    on = [name.lower() for name, value in sorted(flags.items()) if value]
    return " ".join([f"{_bucket(m)}x{d_in}x{d_out}", str(dtype).removeprefix("torch."), *on])


def prune(configs, named_args, **constexprs) -> list:
    """Drop N tiles wider than the output needs (past 64): they would compute mostly padding; and, with the
    gate-gradient epilogue (its input tile lives beside the accumulator), tiles past 128 x 128: they spill."""
    args = named_args | constexprs
    widest = max(64, triton.next_power_of_2(args["d_out"]))
    largest = 128 * 128 if args.get("GATE_GRAD") else None
    return [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] <= widest
        and (largest is None or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= largest)
    ]


def _zero_partials(args: dict, reset_only: bool = False) -> None:
    """The autotuner launches every candidate into the same buffers, then the winner once more. A candidate
    with wider N tiles writes fewer partial rows than the buffer holds (it is sized for the narrowest), so the
    rows of an earlier, narrower candidate would be summed into the gate gradient: zero them before each
    launch, the winner's included (the autotuner calls this with ``reset_only`` after tuning)."""
    if args.get("partial_ptr") is not None:
        args["partial_ptr"].zero_()


def _tuned(kernel, name):
    key = ["m_bucket", "d_in", "d_out"]
    return triton.autotune(
        CONFIGS[name],
        key=key,
        prune_configs_by={"early_config_prune": prune},
        pre_hook=_zero_partials,
        cache_results=True,
    )(kernel)


_scatter_matmul_tuned = _tuned(_scatter_matmul_kernel, "scatter_matmul")
_grouped_outer_tuned = _tuned(_grouped_outer_kernel, "grouped_outer")
_LOG = LaunchLog()  # while recording, each launch's (kernel, autotuner, args, constexprs)
recording = _LOG.recording


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fixed_config(name: str):
    """The configuration every launch of ``name`` uses, or None (per shape: tuned ahead of time, or autotuned):
    the pinned one, else the interpreter's."""
    return pinned(name) or (_INTERPRETER_CONFIGS.get(name) if _interpreting() else None)


def _launch(kernel, tuned, name, grid, key, *args, **constants):
    """The kernel on the tensors' GPU: with the fixed configuration, the one tuned ahead of time for this GPU
    and ``key``, or the autotuner's choice (remembered for kernel-tune). Returns the configuration that ran, or
    None while recording (nothing ran)."""
    if _LOG.launches is not None:
        _LOG.launches.append((kernel, tuned, args, constants))
        return None
    if interpreted_bf16_dot(args[0].device.type, str(args[0].dtype)):
        raise ValueError(f"the Triton expert matmul {NO_BF16_DOT}")
    config = _config(name, key, args[0].device)
    with torch.cuda.device_of(args[0]):
        if config is None:
            tuned[grid](*args, **constants)
            config = tuned.best_config
            tuning.record(name, key, config_label(config))
        else:
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            kernel[grid(config.kwargs)](*args, **constants, **config.kwargs, **options)
    return config


def _config(name: str, key: str, device: torch.device):
    """The configuration a launch of ``name`` at ``key`` uses, or None: autotune (and record the choice)."""
    fixed = _fixed_config(name)
    label = None if fixed else tuning.ahead_of_time(name, key, device)
    return by_label(name, label, f"{tuning.FILE} ({torch.cuda.get_device_name(device)})") if label else fixed


def _narrowest_n(name: str) -> int:
    """The smallest BLOCK_N a launch of ``name`` may use: it sizes the per-N-tile partials."""
    config = _fixed_config(name)
    return min(c.kwargs["BLOCK_N"] for c in ([config] if config else CONFIGS[name]))


def _precision(dtype: torch.dtype) -> str:
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 and not _interpreting() else "ieee"


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(max(m, 1)), _BUCKET_CAP)


def _scores_strides(scores: Tensor | None) -> tuple[int, int]:
    return (0, 0) if scores is None else scores.stride()


def scatter_matmul(rows, in_groups, weight, scores, slots, order, offsets, dot=None):
    """rows [N * in_groups, d_in], weight [E, d_in, d_out] (any strides; widths multiples of ALIGN), scores
    [N, E] or None -> (one row per slot [N * slots, d_out], gate gradients [N * slots] fp32 or None).

    ``dot`` = (rows [N * groups, d_out], groups): gate gradients are each ungated slot row's dot with its row.
    """
    n_experts, d_in, d_out = weight.shape
    m = order.numel()
    y = rows.new_empty(m, d_out)
    partial = None
    if dot is not None:
        tiles = triton.cdiv(d_out, _narrowest_n("scatter_matmul"))
        partial = torch.zeros(tiles, m, dtype=torch.float32, device=rows.device)
    if m == 0:
        return y, None if partial is None else partial.sum(0)
    dot_rows, dot_groups = dot if dot is not None else (None, 1)

    def grid(meta):
        return ((triton.cdiv(m, meta["BLOCK_M"]) + n_experts) * triton.cdiv(d_out, meta["BLOCK_N"]),)

    key = shape_key(m, d_in, d_out, rows.dtype, gates=scores is not None, gate_grad=dot is not None)
    _launch(
        _scatter_matmul_kernel,
        _scatter_matmul_tuned,
        "scatter_matmul",
        grid,
        key,
        rows,
        weight,
        y,
        scores,
        order,
        offsets,
        dot_rows,
        partial,
        n_experts,
        d_in,
        d_out,
        slots,
        in_groups,
        dot_groups,
        m,
        _bucket(m),
        *rows.stride(),
        *weight.stride(),
        *_scores_strides(scores),
        *((0, 0) if dot_rows is None else dot_rows.stride()),
        HAS_GATES=scores is not None,
        GATE_GRAD=dot is not None,
        PRECISION=_precision(rows.dtype),
        BLOCK_E=triton.next_power_of_2(n_experts),
    )
    return y, None if partial is None else partial.sum(0)


def grouped_outer(x_rows, in_groups, grad_rows, out_groups, scores, slots, order, offsets, n_experts):
    """Sum over each expert's slots of x_row^T (gate * grad_row) -> [E, d_in, d_out] fp32."""
    d_in, d_out = x_rows.shape[1], grad_rows.shape[1]
    m = order.numel()
    # room for the most shares any candidate may use: the autotuner launches each into the same buffer, and
    # only the winner's shares are summed
    shares = _fixed_config("grouped_outer") or max(CONFIGS["grouped_outer"], key=lambda c: c.kwargs["SPLIT"])
    partials = x_rows.new_empty(shares.kwargs["SPLIT"], n_experts, d_in, d_out, dtype=torch.float32)

    def grid(meta):
        return (
            n_experts
            * meta["SPLIT"]
            * triton.cdiv(d_in, meta["BLOCK_K"])
            * triton.cdiv(d_out, meta["BLOCK_N"]),
        )

    ran = _launch(
        _grouped_outer_kernel,
        _grouped_outer_tuned,
        "grouped_outer",
        grid,
        shape_key(m, d_in, d_out, x_rows.dtype, gates=scores is not None),
        x_rows,
        grad_rows,
        partials,
        scores,
        order,
        offsets,
        n_experts,
        d_in,
        d_out,
        slots,
        in_groups,
        out_groups,
        _bucket(m),
        *x_rows.stride(),
        *grad_rows.stride(),
        *_scores_strides(scores),
        HAS_GATES=scores is not None,
        PRECISION=_precision(x_rows.dtype),
    )
    split = ran.kwargs["SPLIT"] if ran else 1
    return partials[0] if split == 1 else partials[:split].sum(0)


# The interface of op.py's implementations: READS_GROUPING, EVERY_EXPERT, unavailable, gates_outside,
# forward and backward.

READS_GROUPING = True  # the routing's slots in expert order
EVERY_EXPERT = False  # the routed slots' products alone
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unavailable(in_groups: int, out_groups: int) -> str | None:
    """None: any groups (where it may run, on CUDA or in the interpreter, the command line checks)."""
    return None


def gates_outside(in_groups: int, out_groups: int, d_in: int, d_out: int) -> bool:
    """False: the gates' gradient comes from the input gradient's epilogue and the inputs."""
    return False


def forward(x, weight, scores, indices, order, experts, offsets, s_out):
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"the Triton expert matmul takes fp32, fp16 or bf16; got {x.dtype} and {weight.dtype}"
        )
    n, s_in, d_in = x.shape
    slots = indices.shape[1]
    x_rows = aligned(x.reshape(n * s_in, d_in), ALIGN)
    weight_rows = aligned(weight, ALIGN)
    y, _ = scatter_matmul(x_rows, s_in, weight_rows, scores, slots, order, offsets)  # [N * S, d_out]
    return group_sum(y, n, s_out, weight.shape[2])


def backward(grad_out, x, weight, scores, indices, order, experts, offsets):
    n, s_in, d_in = x.shape
    s_out, d_out = grad_out.shape[1:]
    slots = indices.shape[1]
    x_rows = aligned(x.reshape(n * s_in, d_in), ALIGN)
    grad_rows = aligned(grad_out.reshape(n * s_out, d_out), ALIGN)
    weight_t = aligned(weight, ALIGN).transpose(1, 2)  # a strided view: the kernel reads W^T in place
    # Gated input gradients per slot; the gate gradients are the ungated ones' row-dot with x (an epilogue).
    dot = None if scores is None else (x_rows, s_in)
    grad_slots, grad_gates = scatter_matmul(grad_rows, s_out, weight_t, scores, slots, order, offsets, dot)
    with weight_gradient_range():
        grad_w = grouped_outer(x_rows, s_in, grad_rows, s_out, scores, slots, order, offsets, weight.shape[0])
    grad_s = x.new_empty(0)
    if scores is not None:
        grad_s = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
        grad_s = grad_s.scatter_add_(1, indices, grad_gates.view(n, slots)).to(scores.dtype)
    return group_sum(grad_slots, n, s_in, d_in), grad_w[:, :d_in, :d_out].to(x.dtype).contiguous(), grad_s
