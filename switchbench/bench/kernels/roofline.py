"""Roofline estimate of the expert matmul's forward and backward, pass by pass, against one dense matmul: the
routed (Triton) kernels, and the dense GEMMs over every expert of ``all_experts``.

Each pass (a kernel or an eager PyTorch op of the current implementation) moves bytes between DRAM and the chip
and does MACs; its time is at least max(bytes / bandwidth, 2 * MACs / peak). Convention: every operand is read
once and every result written once (the kernels walk N tiles fastest, so the CTAs sharing a gathered tile run
together); a gathered operand costs one row per slot. Feature widths count padded to ALIGN. Index and routing
arrays are counted; launch overheads, L2 hits on rows gathered twice and the gate scatter ([N, E]) are not.
"""

import math

from switchbench.bench.kernels.bench import Case, cases
from switchbench.ops.expert_matmul import all_experts as expert_matmul_all_experts

# bandwidth bytes/s; dense tensor-core peak MAC/s x 2 = FLOP/s (fp32: FMA units, TF32 off), from the datasheets
GPUS = {
    "H100 SXM": (3.35e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    "H200": (4.8e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    "A100 SXM": (2.039e12, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ALIGN, NARROWEST_N = 16, 64  # expert_matmul_triton's padding and its smallest BLOCK_N


def passes(case: Case, b: int) -> list[tuple[str, float, float]]:
    """(pass, bytes, MACs) of the expert matmul's forward and backward, as implemented."""
    n, s, s_in, s_out = case.tokens, case.slots, case.in_groups, case.out_groups
    d_in, d_out = _padded(case.d_in), _padded(case.d_out)
    m, e = n * s, case.groups * case.experts_per_group
    macs = m * d_in * d_out
    weight, index = e * d_in * d_out * b, m * 8 + (m * b if case.gated else 0)
    out = _pad(case.d_in, n * s_in, b, "forward: pad x")
    out += [("forward matmul", m * d_in * b + weight + m * d_out * b + index, macs)]
    out += _slot_sum(case.d_out, m, n * s_out, b, "forward slot sum")
    out += _pad(case.d_in, n * s_in, b, "backward: pad x") + _pad(
        case.d_out, n * s_out, b, "backward: pad grad"
    )
    grad_x = m * d_out * b + weight + m * d_in * b + index
    if (
        case.gated
    ):  # the gate-gradient epilogue: x rows gathered, fp32 partials per N tile zeroed, written, summed
        grad_x += m * d_in * b + 3 * math.ceil(d_in / NARROWEST_N) * m * 4
    out += [("grad_x matmul", grad_x, macs), ("grad_w matmul", m * (d_in + d_out) * b + weight + index, macs)]
    return out + _slot_sum(case.d_in, m, n * s_in, b, "grad_x slot sum")


def _padded(width: int) -> int:
    return math.ceil(width / ALIGN) * ALIGN


def _pad(width: int, rows: int, b: int, name: str) -> list:
    return [] if width % ALIGN == 0 else [(name, rows * (width + _padded(width)) * b, 0)]


def _slot_sum(width: int, slots: int, rows: int, b: int, name: str) -> list:
    """Summing slots into rows reads every slot row; one slot per row is a view, or a copy when padded."""
    if slots == rows and width % ALIGN == 0:
        return []
    return [(name, (slots * _padded(width) + rows * width) * b, 0)]


def all_experts_passes(case: Case, b: int) -> list[tuple[str, float, float]]:
    """(pass, bytes, MACs) of the all_experts implementation's forward and backward (``all_experts.py``) on CUDA:
    GEMMs over every expert at the model's widths, E / S times the routed MACs, and the passes around them, each a
    separate read and write: the Triton kernels that lay rows out by expert (every place written, no zero fill),
    pick each slot's row back, and gate and sum slots (``slot_kernels.py``). A case whose groups it cannot run has
    none."""
    n, s, s_in, s_out, e = case.tokens, case.slots, case.in_groups, case.out_groups, case.n_experts
    d_in, d_out, idx, gates = case.d_in, case.d_out, n * s * 8, n * s * b if case.gated else 0
    weight, macs = e * d_in * d_out * b, n * e * d_in * d_out
    if expert_matmul_all_experts.unavailable(s_in, s_out):
        return []
    if expert_matmul_all_experts.gates_outside(s_in, s_out, d_in, d_out):  # one input group: Y = x W_cat
        wide, slot, out = n * e * d_out * b, n * s * d_out * b, n * s_out * d_out * b
        steps = [
            ("forward GEMM", n * d_in * b + weight + wide, macs),
            # each slot's row read once; ungated, summed into its output group in the same pass
            ("forward: pick slots", slot + idx + (slot if case.gated else out), 0),
            ("forward: gate and slot sum", slot + gates + out if case.gated else 0, 0),
            ("backward: gate gradients", out + gates + 2 * slot + n * s * b if case.gated else 0, 0),
            ("backward: lay out by expert", slot + idx + wide, 0),
            ("grad_x GEMM", wide + weight + n * d_in * b, macs),
            ("grad_w GEMM", n * d_in * b + wide + 3 * weight, macs),  # and its expert-major copy
        ]
    else:  # one output group: out = X_cat W_flat, the gated input rows laid out by expert
        wide, slot, rows = n * e * d_in * b, n * s * d_in * b, n * s_in * d_in * b
        score_grads = (
            (rows + n * e * b) if case.gated else 0
        )  # x read, once a group; the scores' gradient written
        steps = [
            ("forward: lay out by expert", slot + gates + idx + wide, 0),
            ("forward GEMM", wide + weight + n * d_out * b, macs),
            ("grad_x GEMM", n * d_out * b + weight + wide, macs),
            ("backward: pick, gate and sum", slot + gates + idx + rows + score_grads, 0),
            ("backward: lay out by expert", slot + gates + idx + wide, 0),
            ("grad_w GEMM", wide + n * d_out * b + weight, macs),
        ]
    return [(f"all_experts: {name}", nbytes, m) for name, nbytes, m in steps if nbytes or m]


def dense_passes(case: Case, b: int, projection: bool = False) -> list[tuple[str, float, float]]:
    """The same useful MACs as one dense matmul, forward and backward: of the op's shape, [N * S, d_in] @
    [d_in, d_out], or with ``projection`` a dense projection's, each row read and written once
    (``Case.projection_shape``)."""
    m, k, n = case.projection_shape if projection else (case.tokens * case.slots, case.d_in, case.d_out)
    a, w, y, macs = m * k * b, k * n * b, m * n * b, m * k * n
    return [
        ("dense forward", a + w + y, macs),
        ("dense grad_x", y + w + a, macs),
        ("dense grad_w", a + y + w, macs),
    ]


def milliseconds(nbytes: float, macs: float, gpu: str, dtype: str) -> float:
    bandwidth, peak = GPUS[gpu]
    return 1e3 * max(nbytes / bandwidth, 2 * macs / peak[dtype])


def table(sizes: list[str], batch: int, dtypes: list[str]) -> list[dict]:
    """One row per pass of each case, its total, and the totals of a dense matmul of its shape and of a dense
    projection of its MACs, with the estimate per GPU."""
    rows = []
    for dtype in dtypes:
        for size in sizes:
            for case in cases(size, batch)[:-1]:
                steps = passes(case, BYTES[dtype])
                every = all_experts_passes(case, BYTES[dtype])
                for name, nbytes, macs in steps + every:
                    rows.append(_row(case, dtype, name, nbytes, macs))
                rows.append(_total(case, dtype, "total", steps))
                if every:
                    rows.append(_total(case, dtype, "all_experts total", every))
                rows.append(_total(case, dtype, "dense total", dense_passes(case, BYTES[dtype])))
                projection = dense_passes(case, BYTES[dtype], projection=True)
                rows.append(_total(case, dtype, "dense projection total", projection))
    return rows


def _total(case, dtype, name, steps) -> dict:
    row = _row(case, dtype, name, sum(s[1] for s in steps), sum(s[2] for s in steps))
    for gpu in GPUS:  # passes run one after another: their times add, not their bytes and MACs' maxima
        row[f"{gpu} ms"] = sum(milliseconds(nbytes, macs, gpu, dtype) for _, nbytes, macs in steps)
    return row


def _row(case, dtype, name, nbytes, macs) -> dict:
    row = {"case": case.name, "dtype": dtype, "pass": name, "GB": nbytes / 1e9, "GMAC": macs / 1e9}
    return row | {f"{gpu} ms": milliseconds(nbytes, macs, gpu, dtype) for gpu in GPUS}
