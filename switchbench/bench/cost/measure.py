"""Counts measured on the real modules: one attention layer, one sequence, forward pass.

Three independent measurements: fvcore's FlopCountAnalysis (TorchScript trace, MACs), torch's FlopCounterMode
(dispatched ops, FLOPs / 2) and saved-tensor hooks (floats autograd keeps, storages de-duplicated, parameters
excluded). Ops neither counter knows are given formulas here; any other op that could hide MACs is an error.
fvcore is optional: where it is not installed its cells say so, and the other two still count.
The speed gate also counts the operator calls of a layer step with the PyTorch profiler.
"""

import warnings
from collections.abc import Callable
from functools import cache

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from switchbench.bench.cost import accounting
from switchbench.core.profiler import profiled
from switchbench.models.config import ModelConfig
from switchbench.models.layers.window import make_window
from switchbench.ops.attention import choice as attention_choice

# Ops of the layers that fvcore has no handle for and that perform no multiply-accumulate (elementwise, routing,
# sorting). Any other op without a handle is an error rather than a silent zero.
NO_MACS = {
    "aten::add",
    "aten::sub",
    "aten::rsub",
    "aten::mul",
    "aten::div",
    "aten::neg",
    "aten::pow",
    "aten::sin",
    "aten::cos",
    "aten::sigmoid",
    "aten::softmax",
    "aten::topk",
    "aten::lt",  # a choice among few experts ranks them by comparisons (router.top_by_rank)
    "aten::__or__",
    "aten::argmax",
    "aten::sort",
    "aten::searchsorted",  # where each expert's run of sorted slots starts
    "aten::cumsum",
    "aten::scatter_add_",
    "aten::ones_like",
    "aten::pad",
    "aten::repeat_interleave",
    "aten::scatter",
    "aten::sum",
    "aten::new_ones",
    "aten::zeros_like",
    "aten::mean",
}


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure, on a GPU or on the CPU: a result to record, not a bug."""
    message = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or any(
        text in message for text in ("out of memory", "can't allocate memory", "cannot allocate memory")
    )


def free_memory(device: str) -> int:
    """Bytes that can still be allocated on ``device``: the GPU's free memory once PyTorch's allocator has given
    back the blocks it caches unused (an allocation that would not fit gets them too, so an estimate must count
    them: a group's members are built one after another, each freeing its warm-up steps into the cache), or the
    system's available memory."""
    if device == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    return _meminfo("MemAvailable")  # it counts reclaimable caches, unlike the free pages


def total_memory(device: str) -> int:
    """Bytes of the device's memory: the GPU's, or the system's."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return _meminfo("MemTotal")


def some_case_fits(needs: dict[str, int], free: int) -> None:
    """A one-line ValueError when not one case of a run fits ``free`` bytes by its lower bound (``needs``: each
    case's, by name): a run that could only write rows of OOM is refused before any work, not after it."""
    if needs and min(needs.values()) > free:
        name = min(needs, key=needs.__getitem__)
        raise ValueError(
            f"no case fits the {free / 2**30:.1f} GiB free: the smallest, {name}, needs at least "
            f"{needs[name] / 2**30:.1f} GiB"
        )


def _meminfo(field: str) -> int:
    """Bytes of one line of the system's /proc/meminfo (it states kB)."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[field].split()[0]) * 1024


def layer_bytes_lower_bound(cfg: ModelConfig) -> int:
    """Bytes a measurement of ``cfg``'s attention layer holds at least: its float32 weights (counted on the meta
    device, no memory) and the floats its forward keeps for backward."""
    try:
        with torch.device("meta"):
            weights = sum(p.numel() for p in cfg.family.attention(cfg).parameters())
    except RuntimeError as error:  # a weight past 2**63 bytes: torch cannot size even its meta tensor
        if "overflow" not in str(error):
            raise
        return 2**63
    return 4 * (weights + accounting.exact_cost(cfg).mem)


def _or_oom(measure: Callable[[ModelConfig], int], cfg: ModelConfig, fits: bool) -> int | str:
    """A measurement, or "OOM" where it does not fit in this machine's memory: not started where the layer's
    lower bound does not ``fits`` the free memory (past it, Linux's OOM killer ends the process, with no error to
    catch), caught where the allocator says so."""
    if not fits:
        return "OOM"
    try:
        return measure(cfg)
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
        return "OOM"


def layer_and_inputs(cfg: ModelConfig, seed: int = 0, batch: int = 1):
    """The attention module of ``cfg`` and the inputs of ``batch`` sequences: T tokens after (C - 1) T cached
    ones."""
    cfg = cfg.replace(moa_cv_coef=0.0, moa_switch_coef=0.0, moa_z_coef=0.0, entropy_reg=0.0, dropout=0.0)
    torch.manual_seed(seed)
    layer = cfg.family.attention(cfg)
    x = torch.randn(batch, cfg.T, cfg.d_model, requires_grad=True)
    mem = torch.randn(batch, cfg.mem_len, cfg.d_model) if cfg.mem_len else None
    window = make_window(cfg.mem_len, cfg.mem_len, cfg.T, cfg.T, cfg.context_blocks, cfg.causal, "cpu")
    return layer, x, mem, window


class _Traceable(nn.Module):
    """The layer as a function of tensors only, for the TorchScript tracer."""

    def __init__(self, layer, window):
        super().__init__()
        self.layer, self.window = layer, window

    def forward(self, x, mem):
        return self.layer(x, mem, self.window)[0]


def _expert_matmul_macs(x_shape, weight_shape, indices_shape) -> int:
    return indices_shape[0] * indices_shape[1] * weight_shape[1] * weight_shape[2]


def _projections_macs(x_shape, weight_shapes) -> int:
    """x [..., d_in] through weights [d_out, d_in]: d_in MACs per output element."""
    return int(torch.Size(x_shape).numel()) * sum(shape[0] for shape in weight_shapes)


def _l2_norm_macs(x_shape) -> int:
    """An L2 norm (MoH's norm router): one multiply-add per element, its square added to the sum."""
    return int(torch.Size(x_shape).numel())


def _sdpa_macs(q_shape, k_shape) -> int:
    """q k^T and A v: 2 B H t S d_head."""
    *batch, t, d_head = q_shape
    return 2 * int(torch.Size(batch).numel()) * t * k_shape[-2] * d_head


def _fvcore():
    """fvcore's counter and shape reader. Imported here: fvcore is optional on a GPU node (a source distribution
    only, its dependencies not always there), and every command imports this module."""
    with warnings.catch_warnings():  # fvcore's import touches the deprecated torch.jit.script
        warnings.simplefilter("ignore", DeprecationWarning)
        from fvcore.nn import FlopCountAnalysis
        from fvcore.nn.jit_handles import get_shape
    return FlopCountAnalysis, get_shape


def fvcore_missing() -> str | None:
    """None when fvcore can count, else the note its cells show (e.g. "fvcore not installed")."""
    try:
        _fvcore()
    except ModuleNotFoundError as error:  # fvcore itself, or one of its dependencies (iopath, yacs ...)
        return f"{(error.name or 'fvcore').split('.')[0]} not installed"
    return None


def fvcore_macs(cfg: ModelConfig) -> int:
    FlopCountAnalysis, get_shape = _fvcore()
    layer, x, mem, window = layer_and_inputs(cfg)
    analysis = FlopCountAnalysis(_Traceable(layer, window), (x, mem))
    analysis.set_op_handle(
        "switchbench::expert_matmul",
        lambda ins, outs: _expert_matmul_macs(*(get_shape(ins[i]) for i in (0, 1, 3))),
        "aten::scaled_dot_product_attention",
        lambda ins, outs: _sdpa_macs(get_shape(ins[0]), get_shape(ins[1])),
        "aten::linalg_vector_norm",
        lambda ins, outs: _l2_norm_macs(get_shape(ins[0])),
        "prim::PythonOp._Projections",  # models/layers/projections.py, traced as one opaque node
        lambda ins, outs: _projections_macs(get_shape(ins[0]), [get_shape(w) for w in ins[1:]]),
    )
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total = analysis.total()
    unknown = sorted(set(analysis.unsupported_ops()) - NO_MACS)
    if unknown:
        raise RuntimeError(f"fvcore has no MAC count for {', '.join(unknown)}")
    return int(total)


def _flop_formulas() -> dict:
    def expert_matmul(x, weight, scores, indices, *args, out_shape=None, **kwargs):
        return 2 * _expert_matmul_macs(x, weight, indices)

    def sdpa(query, key, value, *args, out_shape=None, **kwargs):
        return 2 * _sdpa_macs(query, key)

    def vector_norm(x, *args, out_shape=None, **kwargs):
        return 2 * _l2_norm_macs(x)

    aten = torch.ops.aten
    # every fused attention: torch 2.11's own formula asserts as many key heads as query heads, and decoding keeps
    # GQA's and MoA's fewer key heads (enable_gqa); on an H200 the counter raised for those groups
    fused_attention = (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    )
    return {
        torch.ops.switchbench.expert_matmul: expert_matmul,  # keyed by packet, as FlopCounterMode looks up
        **dict.fromkeys(fused_attention, sdpa),
        torch.ops.aten.linalg_vector_norm: vector_norm,
    }


def counted_macs(fn: Callable) -> int:
    """MACs of one ``fn()`` as PyTorch's FlopCounterMode counts them, with the suite's formulas for the expert
    matmul, fused attention (fewer key heads than query heads too) and vector norms."""
    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        fn()
    return counter.get_total_flops() // 2


def flop_counter_macs(cfg: ModelConfig, batch: int = 1) -> int:
    layer, x, mem, window = layer_and_inputs(cfg, batch=batch)
    return counted_macs(lambda: layer(x, mem, window))


def saved_floats(cfg: ModelConfig) -> int:
    """Floats autograd keeps for the backward of one forward pass of the layer (in fp32: 4 bytes each)."""
    layer, x, mem, window = layer_and_inputs(cfg)
    return count_saved_bytes(lambda: layer(x, mem, window), layer) // 4


def count_saved_bytes(forward: Callable, module: nn.Module) -> int:
    """Bytes of the distinct floating-point storages saved by ``forward()``, parameters excluded (under autocast
    the saved tensors mix dtypes: each counts at its own width)."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = forward()  # kept alive until counted, so no storage is freed and its address reused
    del output
    return sum(storages.values())


def count_op_calls(fn: Callable) -> int:
    """Operator calls (aten and switchbench ops, nested and backward ones included) of one ``fn()``.

    The PyTorch profiler records each dispatcher call once, whatever the timing or the thread count, so the count
    is deterministic on the CPU; autograd's own events mirror these calls and are left out.
    """
    from torch.profiler import ProfilerActivity

    fn()  # a first call may take one-off paths (lazy initialisation)
    with profiled([ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.name.split("::")[0] in ("aten", "switchbench") for event in prof.events())


# Scaled-dot-product attention's backends, by the operator the dispatcher picks (the same names on every device).
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (other)",
    "aten::_scaled_dot_product_attention_math": "math",
}
# The kernels that are not SDPA's, by the backend the call resolved to
OTHER_KERNELS = {"explicit": "explicit softmax", "flex": "flex", "triton": "Triton flash"}


def attention_kernel(fn: Callable) -> str:
    """The attention kernel ``fn()`` runs: an SDPA backend ("math" when SDPA fell back to its unfused path),
    "flex", "Triton flash", or "explicit softmax" when the model computes the logits itself (Transformer-XL on the
    CPU, maps)."""
    from torch.profiler import ProfilerActivity

    with attention_choice.recording() as resolved, profiled([ProfilerActivity.CPU]) as prof:
        fn()
    found = {SDPA_BACKENDS[e.name] for e in prof.events() if e.name in SDPA_BACKENDS}
    # A compiled call resolved its kernel once, as it was traced: the command's own resolutions stand in
    if not found and not resolved:
        resolved = attention_choice.resolutions()
    found |= {OTHER_KERNELS[backend] for backend in resolved.values() if backend in OTHER_KERNELS}
    return " + ".join(sorted(found)) or "explicit softmax"


@cache
def cost_views(cfg: ModelConfig) -> dict:
    """Every count of one configuration: the paper's convention and printed equations (None for a family the paper
    does not have), the exact analytic count, and the three measurements (each "OOM" where the layer does not fit in memory; fvcore's a note where it is
    not installed)."""
    paper, printed, exact = (
        accounting.paper_cost(cfg),
        accounting.printed_cost(cfg),
        accounting.exact_cost(cfg),
    )
    fits = layer_bytes_lower_bound(cfg) <= free_memory("cpu")  # once for the three measurements
    return {
        "macs_paper": None if paper is None else paper.macs,
        "macs_printed_eq": None if printed is None else printed.macs,
        "macs_exact": exact.macs,
        "macs_fvcore": fvcore_missing() or _or_oom(fvcore_macs, cfg, fits),
        "macs_flop_counter": _or_oom(flop_counter_macs, cfg, fits),
        "mem_paper": None if paper is None else paper.mem,
        "mem_printed_eq": None if printed is None else printed.mem,
        "mem_exact": exact.mem,
        "mem_saved_floats": _or_oom(saved_floats, cfg, fits),
    }
