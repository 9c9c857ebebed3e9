"""Expert-matmul throughput: the Triton and PyTorch paths and the peers a kernel engineer would reach for
(``torch.nn.functional.grouped_mm`` on expert-sorted rows, a loop of one matmul per expert), against one dense
matmul doing the same useful MACs.

Cases are the expert-matmul shapes of the 47M and 262M presets (SwitchHead V and O, sigma-MoE up and down, MoA
Q and O) and one expert-sized matmul as the paper measured its kernel. Every implementation is checked against
the PyTorch path in its output and in every gradient before it is timed.
"""

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from switchbench.models.expert_matmul import expert_matmul, route
from switchbench.models.presets import PRESETS

from .command import DTYPES, add_json, device_from_args, emit, slug
from .environment import environment
from .measure import free_memory, is_oom
from .results import save_run, writable_folder

SIZES = {
    "47m": ("c4-47m-switchhead-h2", "c4-47m-switchall-h2", "wikitext103-47m-moa-h4"),
    "262m": ("c4-262m-switchhead-h4", "c4-262m-switchall-h4", "wikitext103-262m-moa-h8"),
}


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int  # N
    in_groups: int  # S_in
    slots: int  # S
    out_groups: int  # S_out
    experts_per_group: int  # experts a slot chooses from (its head's E, or the whole pool)
    groups: int  # routers (heads) over a flat axis of groups x experts_per_group experts
    d_in: int
    d_out: int
    gated: bool

    @property
    def macs(self) -> int:
        """Useful multiply-accumulates of the forward pass."""
        return self.tokens * self.slots * self.d_in * self.d_out


def cases(size: str, batch: int) -> list[Case]:
    """The six expert-matmul uses of one size, and one expert-sized matmul, at ``batch`` sequences."""
    switchhead, switchall, moa = (PRESETS[name] for name in SIZES[size])
    H, E, k, d, D = (
        switchhead.n_heads,
        switchhead.n_experts,
        switchhead.k,
        switchhead.d_model,
        switchhead.d_head,
    )
    window = batch * switchhead.T * (1 + switchhead.context_blocks)  # the source side sees the memory too
    tokens = batch * switchhead.T
    NE, G, K = switchall.mlp_experts, switchall.mlp_expert_size, switchall.mlp_k
    MH, ME, MD = moa.n_heads, moa.n_experts, moa.d_head
    return [
        Case(f"{size} switchhead-v", window, 1, H * k, H, E, H, d, D, True),
        Case(f"{size} switchhead-o", tokens, H, H * k, 1, E, H, D, d, True),
        Case(f"{size} sigma-moe-up", tokens, 1, K, K, NE, 1, d, G, False),
        Case(f"{size} sigma-moe-down", tokens, K, K, 1, NE, 1, G, d, True),
        Case(f"{size} moa-q", tokens, 1, MH, MH, ME, 1, d, MD, False),
        Case(f"{size} moa-o", tokens, MH, MH, 1, ME, 1, MD, d, True),
        # One expert's share of the SwitchHead V projection, as a single expert
        Case(f"{size} expert-sized", window * k // E, 1, 1, 1, 1, 1, d, D, False),
    ]


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """Seeded inputs: k distinct experts per group and token, chosen uniformly."""
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
    out["routing"] = route(choice.reshape(case.tokens, case.slots).to(device), n_experts)
    out["dense"] = weight[0].to(device, dtype).requires_grad_()
    rows = x[:, :1].expand(case.tokens, case.slots, case.d_in).reshape(-1, case.d_in)
    out["rows"] = rows.to(device, dtype).requires_grad_()
    out["sorted"] = _sorted_rows(case, out)[0].detach().requires_grad_()  # for the kernel-only peer
    out["ends"] = out["routing"].offsets[1:].to(torch.int32)
    return out


def _expert(impl: str) -> Callable:
    def run(case: Case, inputs: dict):
        return expert_matmul(
            inputs["x"], inputs["weight"], inputs["routing"], inputs["scores"], case.out_groups, impl=impl
        )

    return run


def _dense(case: Case, inputs: dict):
    """The same useful MACs as one dense matmul: [N * S, d_in] @ [d_in, d_out]."""
    return inputs["rows"] @ inputs["dense"]


def _sorted_rows(case: Case, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The input row of every slot in expert order [M, d_in], and each sorted slot's token."""
    routing = inputs["routing"]
    token, s = routing.order // case.slots, routing.order % case.slots
    return inputs["x"][token, s // (case.slots // case.in_groups)], token


def _unsorted(case: Case, inputs: dict, y_sorted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Gate the expert-ordered rows, put them back in slot order and sum each output group."""
    routing = inputs["routing"]
    if inputs["scores"] is not None:
        y_sorted = y_sorted * inputs["scores"][token, routing.experts][:, None]
    y = torch.empty_like(y_sorted).index_copy(0, routing.order, y_sorted)  # [N * S, d_out]
    return y.view(case.tokens, case.out_groups, -1, case.d_out).sum(2)


def _grouped_mm(case: Case, inputs: dict):
    """torch's grouped GEMM over the expert-sorted rows."""
    rows, token = _sorted_rows(case, inputs)
    return _unsorted(
        case, inputs, torch.nn.functional.grouped_mm(rows, inputs["weight"], offs=inputs["ends"]), token
    )


def _grouped_mm_kernel(case: Case, inputs: dict):
    """The grouped GEMM alone, on rows already gathered in expert order: no sort, gather, gate or unsort."""
    return torch.nn.functional.grouped_mm(inputs["sorted"], inputs["weight"], offs=inputs["ends"])


def _sorted_loop(case: Case, inputs: dict):
    """The reference of the kernel-only peer: one float64 matmul per expert over the same sorted rows."""
    ends, rows = inputs["routing"].offsets.tolist(), inputs["sorted"]
    pairs = zip(ends[:-1], ends[1:], inputs["weight"], strict=True)
    return torch.cat([rows[a:b].double() @ w.double() for a, b, w in pairs]).to(rows.dtype)


def _loop(case: Case, inputs: dict):
    """One matmul (cuBLAS on a GPU) per expert over its sorted rows."""
    rows, token = _sorted_rows(case, inputs)
    ends = inputs["routing"].offsets.tolist()
    y = torch.cat([rows[a:b] @ w for a, b, w in zip(ends[:-1], ends[1:], inputs["weight"], strict=True)])
    return _unsorted(case, inputs, y, token)


def unsupported(impl: str, case: Case, dtype: torch.dtype) -> str | None:
    """Why ``impl`` cannot run ``case`` here, or None."""
    if impl not in ("grouped_mm", "grouped_mm-kernel"):
        return None
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if dtype != torch.bfloat16:
        return "grouped_mm takes bf16 only"
    if (case.d_in * 2) % 16 or (case.d_out * 2) % 16:
        return f"grouped_mm needs 16-byte rows; d_in {case.d_in}, d_out {case.d_out}"
    return None


IMPLEMENTATIONS = {
    "triton": _expert("triton"),
    "torch": _expert("torch"),
    "grouped_mm": _grouped_mm,
    "loop": _loop,
    "grouped_mm-kernel": _grouped_mm_kernel,
    "dense": _dense,
}
EXPERT_IMPLS = ("triton", "torch", "grouped_mm", "loop")  # the ones that compute the expert matmul itself
# A peer timed kernel to kernel (its glue left out), and the reference it is checked against.
KERNEL_ONLY = {"grouped_mm-kernel": _sorted_loop}
PASSES = ("forward", "forward+backward")


def timer(device: str) -> Callable[..., list[float]]:
    """Milliseconds of each timed fn() call, with every tensor in ``grad_to_none`` reset before each call (not
    timed): triton's do_bench (L2 flushed, warm-up excluded) on a GPU."""
    if device == "cuda":
        import triton  # optional, and only installed where there is a GPU

        def gpu(fn, grad_to_none=()):
            return triton.testing.do_bench(fn, 25, 100, grad_to_none=list(grad_to_none), return_mode="all")

        return gpu

    def cpu(fn, grad_to_none=(), repeats=5):
        fn()
        times = []
        for _ in range(repeats):
            for t in grad_to_none:
                t.grad = None
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return times

    return cpu


def _leaves(inputs: dict) -> list[torch.Tensor]:
    names = ("x", "weight", "scores", "rows", "dense", "sorted")
    return [inputs[name] for name in names if inputs[name] is not None]


def outputs(case: Case, inputs: dict, impl: str | Callable, seed: int = 1) -> dict[str, torch.Tensor]:
    """Output of ``impl`` and the gradients of its inputs (x, weight and scores; the sorted rows and weight for a
    kernel-only peer) for a seeded output gradient."""
    for leaf in _leaves(inputs):
        leaf.grad = None
    out = (IMPLEMENTATIONS[impl] if isinstance(impl, str) else impl)(case, inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(grad)
    sorted_rows = impl in KERNEL_ONLY or impl in KERNEL_ONLY.values()
    names = (
        ["sorted", "weight"]
        if sorted_rows
        else [n for n in ("x", "weight", "scores") if inputs[n] is not None]
    )
    result = {"out": out.detach().float()} | {f"grad_{n}": inputs[n].grad.float() for n in names}
    for leaf in _leaves(inputs):
        leaf.grad = None
    return result


def check(case: Case, inputs: dict, impl: str, dtype: torch.dtype) -> tuple[float, str | None]:
    """Largest error of ``impl`` against the PyTorch path (a kernel-only peer: its own reference) over the output
    and every gradient, each relative to its reference's largest value; and what is wrong, or None when every
    one is within tolerance."""
    reference, got = outputs(case, inputs, KERNEL_ONLY.get(impl, "torch")), outputs(case, inputs, impl)
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    worst, wrong = 0.0, None
    for name, ref in reference.items():
        error = ((got[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        if not error <= tolerance and wrong is None:
            wrong = f"{name} relative error {error:.2e} above {tolerance:.0e}"
        worst = max(worst, error) if error == error else float("inf")  # NaN counts as the worst
    return worst, wrong


def estimated_bytes(case: Case) -> int:
    """A lower bound of what measuring ``case`` holds: its fp32 inputs as drawn (x, weight, scores, the dense
    peer's rows) and one output row per slot. Used to refuse a case before it starts."""
    slots = case.tokens * case.slots
    n_experts = case.groups * case.experts_per_group
    floats = (
        case.tokens * case.in_groups * case.d_in
        + n_experts * case.d_in * case.d_out
        + (case.tokens * n_experts if case.gated else 0)
        + slots * (case.d_in + case.d_out)
    )
    return 4 * floats


def measure(case: Case, impl: str, device: str, dtype: torch.dtype) -> list[dict]:
    """Forward and forward+backward timings (median and spread) of one implementation on one case; a case
    that gives a wrong result is a "wrong" row with the error, and is not timed."""
    reason = unsupported(impl, case, dtype)
    if reason:  # a row without "ms": strict JSON has no NaN
        return _untimed(case, impl, "skipped", skipped=reason)
    inputs = make_inputs(case, device, dtype)
    fn = IMPLEMENTATIONS[impl]
    checked = impl in KERNEL_ONLY or (impl in EXPERT_IMPLS and impl != "torch")
    error, wrong = check(case, inputs, impl, dtype) if checked else (0.0, None)
    if wrong:
        return _untimed(case, impl, "wrong", error=wrong, max_rel_error=error)
    out = fn(case, inputs)
    grad = torch.randn_like(out)
    ms = timer(device)
    forward = ms(lambda: fn(case, inputs))
    both = ms(lambda: fn(case, inputs).backward(grad), grad_to_none=_leaves(inputs))
    rows = []
    for what, times, macs in zip(PASSES, (forward, both), (case.macs, 3 * case.macs), strict=True):
        t = statistics.median(times)
        row = {
            "case": case.name,
            "impl": impl,
            "pass": what,
            "status": "ok",
            "ms": t,
            "tflops": 2 * macs / t / 1e9,
        }
        spread = {"ms_min": min(times), "ms_max": max(times), "repeats": len(times)}
        rows.append(row | spread | {"max_rel_error": error, **_shape(case)})
    return rows


def _untimed(case: Case, impl: str, status: str, **why) -> list[dict]:
    return [
        {"case": case.name, "impl": impl, "pass": p, "status": status, **why, **_shape(case)} for p in PASSES
    ]


def _shape(case: Case) -> dict:
    return {f"shape_{k}": v for k, v in asdict(case).items()}


def default_impls(device: str) -> list[str]:
    """Every implementation on a GPU; off one, Triton runs in its interpreter: correct but not worth timing."""
    return list(IMPLEMENTATIONS) if device == "cuda" else ["torch", "dense"]


def run(sizes: list[str], batch: int, device: str, dtype: torch.dtype, impls: list[str]) -> list[dict]:
    """Every case and implementation; one too large for the free memory, or that runs out of it, is an "OOM"
    row, one that computes a wrong result a "wrong" row, and the sweep goes on."""
    rows = []
    for size in sizes:
        for case in cases(size, batch):
            need, free = estimated_bytes(case), free_memory(device)
            if need > free:
                reason = f"needs at least {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                rows += [r for impl in impls for r in _untimed(case, impl, "OOM", reason=reason)]
                continue
            for impl in impls:
                try:
                    rows += measure(case, impl, device, dtype)
                except (RuntimeError, MemoryError) as error:
                    if not is_oom(error):
                        raise
                    rows += _untimed(case, impl, "OOM", reason="out of memory")
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    dense = {(r["case"], r["pass"]): r["ms"] for r in rows if r["impl"] == "dense" and "ms" in r}
    for r in rows:
        key = (r["case"], r["pass"])
        r["vs_dense"] = dense[key] / r["ms"] if key in dense and "ms" in r else None
    return rows


def register(commands) -> None:
    parser = commands.add_parser("kernel-bench", help="expert-matmul throughput against one dense matmul")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--batch", type=int, help="sequences (default: 64 on a GPU, 1 on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--out", default="results/kernels", help="folder for the JSON and CSV results")
    add_json(parser)
    parser.set_defaults(run=_run)


def _run(args) -> int:
    device = device_from_args(args.device)
    writable_folder(Path(args.out))
    batch = args.batch if args.batch is not None else 64 if device == "cuda" else 1
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    rows = run(args.sizes, batch, device, DTYPES[args.dtype], default_impls(device))
    precision = f"inputs in {args.dtype}, as autocast hands them to the op; fp32 accumulation"
    metadata = environment(device) | {"dtype": args.dtype, "precision": precision, "batch": batch,
                                      "sizes": args.sizes}  # fmt: skip
    path = save_run(Path(args.out), f"{slug(metadata['device'])}-{args.dtype}-b{batch}", metadata, rows)
    table = [
        {"case": r["case"], "pass": r["pass"], "impl": r["impl"], "ms": f"{r['ms']:.3f}" if "ms" in r else r["status"],
         "TFLOP/s": f"{r['tflops']:.3g}" if "ms" in r else "",
         "vs dense": "" if r["vs_dense"] is None else f"{100 * r['vs_dense']:.0f}%"}
        for r in rows
    ]  # fmt: skip
    if not args.json:
        print(f"{metadata['device']}, {args.dtype}, batch {batch}; vs dense = dense-matmul time / this time")
    emit({"metadata": metadata, "rows": rows, "saved": str(path)}, args.json, table)
    wrong = [r for r in rows if r["status"] == "wrong"]
    if not args.json:
        print(f"saved {path} and its .csv")
    for r in wrong:
        print(f"switchbench kernel-bench: {r['impl']} on {r['case']} is wrong: {r['error']}", file=sys.stderr)
    return 1 if wrong else 0
