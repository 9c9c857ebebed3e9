"""Roofline estimate of the expert matmul's forward and backward, pass by pass, against one dense matmul.

Each pass (a kernel or an eager PyTorch op of the current implementation) moves bytes between DRAM and the chip
and does MACs; its time is at least max(bytes / bandwidth, 2 * MACs / peak). Convention: every operand is read
once and every result written once, except a gathered operand of the scatter kernel, which is read again for
each tile of the other dimension when the grid walks the M tiles fastest and it is larger than the L2 (50 MB,
H100/H200). Index and routing arrays are counted; launch overheads and L2 hits on re-read rows are not.
"""

import math

from switchbench.bench.kernels import Case, cases

# bandwidth bytes/s; dense tensor-core peak MAC/s x 2 = FLOP/s (fp32: FMA units, TF32 off), from the datasheets
GPUS = {
    "H100 SXM": (3.35e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    "H200": (4.8e12, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    "A100 SXM": (2.039e12, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
}
L2_BYTES = 50e6
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ROW_TILE = 128  # the BLOCK_N the re-read count assumes


def passes(case: Case, b: int) -> list[tuple[str, float, float]]:
    """(pass, bytes, MACs) of the expert matmul's forward and backward, as implemented."""
    n, s, s_in, s_out, d_in, d_out = (
        case.tokens,
        case.slots,
        case.in_groups,
        case.out_groups,
        case.d_in,
        case.d_out,
    )
    m, e = n * s, case.groups * case.experts_per_group
    macs = m * d_in * d_out
    weight, index = e * d_in * d_out * b, m * 8 + (m * b if case.gated else 0)
    out = [
        ("forward matmul", _gathered(m * d_in * b, d_out) + weight + m * d_out * b + index, macs),
        ("forward slot sum", m * d_out * b + n * s_out * d_out * b, 0),
        ("grad_x matmul", _gathered(m * d_out * b, d_in) + weight + m * d_in * b + m * 8, macs),
        ("grad_w matmul", m * (d_in + d_out) * b + weight + index, macs),
    ]
    unique_x = n * s_in * d_in
    if case.gated:  # the eager gate-gradient tail: fp32 copies, product, row sums, gated copy
        out += [
            ("gate grad: fp32 copies", m * d_in * (b + 4) + unique_x * (b + 4), 0),
            ("gate grad: product", m * d_in * 8 + unique_x * 4, 0),
            ("gate grad: row sums", m * d_in * 4 + m * 4, 0),
            ("grad_x gating", 2 * m * d_in * b + m * b, 0),
        ]
    out.append(("grad_x slot sum", m * d_in * b + unique_x * b, 0))
    return out


def dense_passes(case: Case, b: int) -> list[tuple[str, float, float]]:
    """The same useful MACs as one dense [N * S, d_in] @ [d_in, d_out], forward and backward."""
    m = case.tokens * case.slots
    a, w, y, macs = (
        m * case.d_in * b,
        case.d_in * case.d_out * b,
        m * case.d_out * b,
        m * case.d_in * case.d_out,
    )
    return [
        ("dense forward", a + w + y, macs),
        ("dense grad_x", y + w + a, macs),
        ("dense grad_w", a + y + w, macs),
    ]


def _gathered(nbytes: float, other: int) -> float:
    return nbytes * (math.ceil(other / ROW_TILE) if nbytes > L2_BYTES else 1)


def milliseconds(nbytes: float, macs: float, gpu: str, dtype: str) -> float:
    bandwidth, peak = GPUS[gpu]
    return 1e3 * max(nbytes / bandwidth, 2 * macs / peak[dtype])


def table(sizes: list[str], batch: int, dtypes: list[str]) -> list[dict]:
    """One row per pass of each case, and its total and the dense total, with the estimate per GPU."""
    rows = []
    for dtype in dtypes:
        for size in sizes:
            for case in cases(size, batch)[:-1]:
                steps = passes(case, BYTES[dtype])
                dense = dense_passes(case, BYTES[dtype])
                for name, nbytes, macs in steps:
                    rows.append(_row(case, dtype, name, nbytes, macs))
                rows.append(_total(case, dtype, "total", steps))
                rows.append(_total(case, dtype, "dense total", dense))
    return rows


def _total(case, dtype, name, steps) -> dict:
    row = _row(case, dtype, name, sum(s[1] for s in steps), sum(s[2] for s in steps))
    for gpu in GPUS:  # passes run one after another: their times add, not their bytes and MACs' maxima
        row[f"{gpu} ms"] = sum(milliseconds(nbytes, macs, gpu, dtype) for _, nbytes, macs in steps)
    return row


def _row(case, dtype, name, nbytes, macs) -> dict:
    row = {"case": case.name, "dtype": dtype, "pass": name, "GB": nbytes / 1e9, "GMAC": macs / 1e9}
    return row | {f"{gpu} ms": milliseconds(nbytes, macs, gpu, dtype) for gpu in GPUS}
