"""What speed and profile time: a training step and a forward pass of a whole model, and one attention layer's
forward and forward+backward, each a ``Bench`` with its useful FLOPs, its memory, its operator count and the
kernels it runs; and the memory bounds that refuse or fit a batch before any work."""

import contextlib
import ctypes
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from switchbench.bench.cost.accounting import exact_cost, model_macs
from switchbench.bench.cost.measure import (
    attention_kernel,
    count_op_calls,
    count_saved_bytes,
    free_memory,
    is_oom,
)
from switchbench.bench.cost.params import parameter_counts
from switchbench.core import distributed, optim
from switchbench.core.compiling import allow_recompilations
from switchbench.core.precision import autocast
from switchbench.core.sync import syncs_raise
from switchbench.models import family as registry
from switchbench.models.config import ModelConfig
from switchbench.models.layers.window import make_window
from switchbench.models.lm import LanguageModel
from switchbench.models.presets import from_name
from switchbench.ops.expert_matmul import choice as expert_matmul_choice
from switchbench.ops.expert_matmul import op as expert_matmul

T = TypeVar("T")


@dataclass
class Bench:
    """One timed thing: ``run()`` is a call; ``flops`` its useful floating-point operations."""

    preset: str
    scope: str  # "model" or "layer"
    what: str  # "train step", "forward", "forward+backward"
    run: Callable[[], object]
    flops: float
    memory: Callable[
        [], float | None
    ]  # bytes: peak allocated (GPU) or kept for backward (CPU); None: not measured
    op_calls: Callable[[], int | None] = lambda: None  # operator calls of one run(); None: not counted
    attention: Callable[[], str | None] = lambda: (
        None
    )  # the attention kernel run() takes; None: not looked at
    # the expert-matmul implementations run() takes; None: no expert matmul, or not looked at
    expert_matmul: Callable[[], str | None] = lambda: None
    module: torch.nn.Module | None = None  # what run() calls, for tools that look inside it (profile)
    tokens: int = 0  # tokens one run() computes (per process)
    # its floating-point operations as executed, where more than ``flops``: an expert matmul computing every expert
    executed_flops: float | None = None


@dataclass(frozen=True)
class StepMode:
    """How a training step runs, as one setting for every member of a group: under ``torch.compile`` with the
    ``compile`` backend (None: eager); captured whole in one CUDA graph and replayed (``cuda_graphs``); as
    ``accumulation`` micro-batches whose gradients add up before one optimizer step."""

    compile: str | None = None
    cuda_graphs: bool = False
    accumulation: int = 1


EAGER = StepMode()


def model_benches(
    preset: str,
    batch: int,
    device: str,
    dtype: torch.dtype,
    world: distributed.World = distributed.ONE,
    mode: StepMode = EAGER,
) -> list[Bench]:
    """A training step (forward, backward, AdamW step) and a forward pass of the whole model, XL memory carried, in
    ``mode``; ``batch`` sequences a pass (a micro-batch where the step accumulates). A step captured in a CUDA graph
    keeps the eager step's peak memory."""
    cfg = from_name(preset).replace(dropout=0.0)
    model = LanguageModel(cfg).to(device)
    trained = distributed.wrap(model, world)
    # capturable: AdamW keeps its step counts on the GPU, which a captured step needs (and no host reads them)
    optimizer = optim.adamw(model.parameters(), 2.5e-4, device, capturable=mode.cuda_graphs)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.T + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # a region captured in a CUDA graph may not use autocast's cache
    mixed = autocast(device, dtype, cache=not mode.cuda_graphs)
    with torch.no_grad(), mixed:
        state = model(inputs).state  # a full cache, as in training after the first chunk
    if mode.compile:  # after the cache is built: its blocks, with no memory yet, would be one more graph
        compile_blocks(model, mode.compile)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(mode.accumulation):  # the same micro-batch each time: its cost, not its data, is timed
            with mixed:
                loss = trained(inputs, state).loss(targets) / mode.accumulation
            loss.backward()
        optimizer.step()

    def forward():
        with torch.no_grad(), mixed:
            return trained(inputs, state).logits

    def memory():
        if device == "cuda":  # the step's own gradients counted: they are freed as it starts
            return _cuda_peak(train_step, lambda: optimizer.zero_grad(set_to_none=True))
        with mixed:
            return count_saved_bytes(lambda: trained(inputs, state).loss(targets), model)

    def differentiated():
        with mixed:
            return trained(inputs, state).loss(targets)

    macs, executed = model_macs(cfg, batch), executed_macs(cfg, batch, device, dtype)
    extra = executed != macs  # only then does the step execute more than its useful MACs
    planned = _planned(cfg, batch, device, dtype)
    trains, infers = _kernels(differentiated, planned), _kernels(forward, planned)
    return [
        Bench(
            preset,
            "model",
            "train step",
            captured(train_step) if mode.cuda_graphs else train_step,
            6 * macs * mode.accumulation,
            memory,
            attention=lambda: trains()[0],
            expert_matmul=lambda: trains()[1],
            module=model,
            tokens=batch * cfg.T * mode.accumulation,
            executed_flops=6 * executed * mode.accumulation if extra else None,
        ),
        Bench(
            preset,
            "model",
            "forward",
            forward,
            2 * macs,
            lambda: None,
            attention=lambda: infers()[0],
            expert_matmul=lambda: infers()[1],
            module=model,
            tokens=batch * cfg.T,
            executed_flops=2 * executed if extra else None,
        ),
    ]


def executed_macs(cfg: ModelConfig, batch: int, device: str, dtype: torch.dtype) -> int:
    """Forward MACs of the whole model on ``batch`` sequences as its expert matmuls execute them: the useful ones,
    and the products of the experts no slot chose for each expert matmul whose implementation here (what the
    choice in force resolves its shape to) computes every expert."""
    extra = sum(
        expert_matmul.executed_macs(case, impl) - case.macs
        for case, impl in _expert_matmuls(cfg, batch, device, dtype)
    )
    return model_macs(cfg, batch) + cfg.n_layers * extra


def _expert_matmuls(
    cfg: ModelConfig, batch: int, device: str, dtype: torch.dtype, attention_only: bool = False
) -> list[tuple]:
    """Each expert matmul of a layer of ``cfg`` on ``batch`` sequences (``attention_only``: its attention's), and
    the implementation the choice in force resolves its shape to on ``device`` in ``dtype``."""
    if attention_only:
        attention = registry.expert_owners(cfg)["attn"]
        cases = attention.expert_matmuls(cfg, batch) if attention.expert_matmuls else ()
    else:
        cases = registry.layer_expert_matmuls(cfg, batch)
    return [
        (
            case,
            expert_matmul_choice.lookup(
                torch.device(device), expert_matmul_choice.case_bucket(case, dtype)
            ).impl,
        )
        for case in cases
    ]


def _planned(cfg: ModelConfig, batch: int, device: str, dtype: torch.dtype) -> str | None:
    """The implementations of ``cfg``'s expert matmuls, as :func:`_kernels` labels them, from their shapes."""
    return " + ".join(sorted({impl for _, impl in _expert_matmuls(cfg, batch, device, dtype)})) or None


def compile_blocks(model: LanguageModel, backend: str) -> None:
    """Each block of ``model`` under ``torch.compile``, as torchtitan compiles a model for training. The blocks are
    one code run on inputs of one shape, so the compiler traces and compiles one graph (for each grad mode) that
    every layer runs; compiling the whole model traces every layer apart (47M SwitchHead's first training step on
    a 2-core CPU: 37 s against 152 s). The embedding, the final LayerNorm, the output layer and the loss stay
    eager.

    Every family's blocks share ``Block.forward``'s one code object, each family, grad mode and shape one
    compilation of it: past dynamo's default limit a group's later members ran eager without a word."""
    allow_recompilations()
    for block in model.stack.blocks:
        block.compile(backend=backend)


def layer_benches(
    preset: str, batch: int, device: str, dtype: torch.dtype, compile: str | None = None
) -> list[Bench]:
    """Forward and forward+backward of one attention layer, T tokens after a cached chunk (XL), under the same
    precision policy as a training step: fp32 parameters and inputs, autocast to ``dtype``."""
    cfg = from_name(preset)
    with torch.random.fork_rng(devices=[]):  # the same weights, so the same routing, in every run
        torch.manual_seed(0)
        module = cfg.family.attention(cfg).to(device)
    layer = torch.compile(module, backend=compile) if compile else module
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, cfg.T, cfg.d_model, generator=gen).to(device).requires_grad_()
    mem = torch.randn(batch, cfg.mem_len, cfg.d_model, generator=gen).to(device) if cfg.mem_len else None
    window = make_window(cfg.mem_len, cfg.mem_len, cfg.T, cfg.T, cfg.context_blocks, cfg.causal, device)
    grad = torch.randn(batch, cfg.T, cfg.d_model, generator=gen).to(device, dtype)  # the output's dtype
    mixed = autocast(device, dtype)

    def forward():
        with torch.no_grad(), mixed:
            return layer(x, mem, window)[0]

    def forward_backward():
        with mixed:
            out = layer(x, mem, window)[0]
        out.backward(grad)

    def clear_gradients():
        module.zero_grad(set_to_none=True)
        x.grad = None

    def memory():
        if device == "cuda":
            return _cuda_peak(forward_backward, clear_gradients)
        with mixed:
            return count_saved_bytes(lambda: layer(x, mem, window), module)

    def differentiated():
        with mixed:
            return layer(x, mem, window)[0]

    macs = exact_cost(cfg).batched_macs(batch)
    # as executed: the attention's own expert matmuls (a SwitchAll layer's MLP experts are not in it)
    executed = macs + sum(
        expert_matmul.executed_macs(case, impl) - case.macs
        for case, impl in _expert_matmuls(cfg, batch, device, dtype, attention_only=True)
    )
    planned = _planned(cfg, batch, device, dtype)
    trains, infers = _kernels(differentiated, planned), _kernels(forward, planned)
    return [
        Bench(
            preset,
            "layer",
            "forward",
            forward,
            2 * macs,
            lambda: None,
            lambda: count_op_calls(forward),
            lambda: infers()[0],
            lambda: infers()[1],
            module,
            batch * cfg.T,
            2 * executed if executed != macs else None,
        ),
        Bench(
            preset,
            "layer",
            "forward+backward",
            forward_backward,
            6 * macs,
            memory,
            lambda: count_op_calls(forward_backward),
            lambda: trains()[0],
            lambda: trains()[1],
            module,
            batch * cfg.T,
            6 * executed if executed != macs else None,
        ),
    ]


def _kernels(forward: Callable, planned: str | None) -> Callable[[], tuple[str, str | None]]:
    """The attention kernel one ``forward()`` runs, and the expert-matmul implementations it resolved to (None:
    no expert matmul): read off one call when first asked, outside the timed ones. A compiled forward resolved its
    implementations once, as it was traced, before any reading: ``planned``, what its shapes resolve to, stands in.

    Each bench asks a forward in its own grad mode. SDPA picks its backend by whether the call will be
    differentiated: under grad, cuDNN's kernel takes no float mask, so Transformer-XL's training steps run the
    memory-efficient kernel where its no-grad forwards run cuDNN's (an H200 profile at 262M, batch 64), and
    reading the training step's kernel off a no-grad forward had labelled it cuDNN."""

    @functools.cache
    def read():
        with expert_matmul_choice.recording() as resolved:
            attention = attention_kernel(forward)
        return attention, " + ".join(sorted({r.impl for r in resolved.values()})) or planned

    return read


def captured(step: Callable[[], None], warmup: int = 3) -> Callable[[], None]:
    """``step`` captured whole in one CUDA graph, replayed by the call returned: warmed up first on a side stream
    (lazy initialisation, autotuning and compilation happen outside the capture, as torch's documentation asks).
    The capture fails on any host synchronisation in the step: a captured step is a host-free one.

    Every graph of the process allocates from one shared pool: a group's members are all captured before they are
    timed, and each graph's own pool would hold a whole step's activations for the run. Sharing is safe because
    graphs are replayed one at a time and none reads another's temporaries (what outlives a step, its gradients,
    stays allocated). A pool lives only while a graph holds it: a capture into a pool whose graphs are all gone
    fails an assertion in torch's allocator (seen on an H100), so :func:`release_memory` forgets the pool and the
    next capture starts a new one."""
    stream, caller = torch.cuda.Stream(), torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        for i in range(warmup):
            # The last warm-up step, past autotuning, runs with host syncs made errors: a sync is named there,
            # where inside the capture CUDA says only that the capture was invalidated. Any other error is a bug.
            if warmup > 1 and i == warmup - 1:
                with _not_capturable(only=SYNC_ERROR), syncs_raise():
                    step()
            else:
                step()
    caller.wait_stream(stream)
    torch.cuda.empty_cache()  # the warm-up's cached blocks, for the capture's pool to take
    graph = torch.cuda.CUDAGraph()
    try:
        with _not_capturable(), torch.cuda.graph(graph, pool=_graph_pool()):
            step()
    finally:
        # a failed capture leaves its own stream current, and whatever ends it (an error the capture's end
        # raises, a warning made an error) must not leave the caller on it
        torch.cuda.set_stream(caller)
    return graph.replay


SYNC_ERROR = "synchronizing CUDA operation"  # what CUDA's sync debug mode raises with


@contextlib.contextmanager
def _not_capturable(only: str = ""):
    """A RuntimeError inside the block whose message holds ``only``, but running out of memory, as
    :class:`CaptureFailed` with its first line."""
    try:
        yield
    except RuntimeError as error:
        if is_oom(error) or isinstance(error, CaptureFailed) or only not in str(error):
            raise
        raise CaptureFailed(f"not capturable in a CUDA graph: {str(error).splitlines()[0]}") from error


class CaptureFailed(RuntimeError):
    """A step that cannot be captured in one CUDA graph, as a host synchronisation inside it makes it: a finding
    about the step (its row says why), not a failure of the run."""


@functools.cache
def _graph_pool():
    return torch.cuda.graph_pool_handle()


def estimated_bytes(preset: str | ModelConfig, batch: int, scope: str, dtype: torch.dtype) -> int:
    """A lower bound of what one step of ``preset`` (a name, or a configuration) holds: activations (from the exact
    count of floats kept for backward, at the compute dtype's width) and, for a training step, fp32 weights,
    gradients and AdamW's two moments, and the logits. Used to refuse a case before it starts, never to size one."""
    cfg = from_name(preset) if isinstance(preset, str) else preset
    width = torch.empty((), dtype=dtype).element_size()
    # Half the exact count, which is of the explicit kernel: a fused one keeps no attention map (at 262M about half
    # of what a dense layer keeps), and a batch keeps the sinusoids once.
    activations = batch * exact_cost(cfg).mem * width // 2
    if scope == "layer":
        return activations
    logits = batch * cfg.T * cfg.vocab * (width + 4)  # the logits and their fp32 loss
    return cfg.n_layers * activations + logits + 16 * parameter_counts(cfg)["total"]


def too_large(
    preset: str | ModelConfig, batch: int, scope: str, device: str, dtype: torch.dtype
) -> str | None:
    """Why ``preset`` (a name, or a configuration) cannot run at ``batch`` on ``device`` (its lower bound exceeds
    the free memory), or None. On the CPU a named preset whose bound comes within a factor of CPU_MARGIN of the
    free memory is measured instead, at two small batches (:func:`cpu_step_bytes`)."""
    need, free = estimated_bytes(preset, batch, scope, dtype), free_memory(device)
    if device == "cpu" and isinstance(preset, str) and need <= free < need * CPU_MARGIN:
        need = max(
            need, cpu_step_bytes(preset, batch, scope, dtype, probe=max(1, batch * free // (need * 64)))
        )
    if need <= free:
        return None
    return f"needs at least {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


# On the CPU an allocation past the memory does not fail: the OOM killer ends the process, with nothing saved. The
# lower bound missed a step's peak by 3.5 to 4 times at layer scope (tiny-transformer at batch 20,000: 1.45 GiB
# bound, 5.2 GiB above the built layers), so within this factor of the free memory a step is measured.
CPU_MARGIN = 8


def cpu_step_bytes(preset: str, batch: int, scope: str, dtype: torch.dtype, probe: int) -> int:
    """What the steps of ``preset`` at ``batch`` take at their peak on the CPU, above what was resident before
    they were built: measured at ``probe`` and PROBE_SPAN times it (the process's peak resident memory, reset
    between) and extended linearly, the weights counted once. The estimate alone where the peak cannot be reset
    (not Linux)."""
    probe = min(probe, max(1, batch // PROBE_SPAN))
    if not _peak_resettable():
        return estimated_bytes(preset, batch, scope, dtype)
    small, large = (_cpu_peak(preset, b, scope, dtype) for b in (probe, PROBE_SPAN * probe))
    return small + max(0, large - small) * (batch - probe) // ((PROBE_SPAN - 1) * probe)


# A peak varies from run to run by more than its share that grows with the batch would suggest (tiny-transformer's
# layer: 347 to 431 MB at batch 1,024, 623 to 655 MB at 2,048), so a slope over a span of 2 was off by up to a
# third (its test, which wants the extension above twice the bound, failed once on a CI machine): over a span of 4
# the same spread moves the slope a third as far. The larger probe takes at most a quarter of the free memory
# where the bound misses the peak by 4 times (too_large's probe is 1/64 of it).
PROBE_SPAN = 4


def _cpu_peak(preset: str, batch: int, scope: str, dtype: torch.dtype) -> int:
    release_memory()
    _trim_heap()  # else what glibc keeps of freed blocks is counted before, and reused unseen by the peak
    before = _resident("VmRSS")
    _reset_peak()
    benches = (model_benches if scope == "model" else layer_benches)(preset, batch, "cpu", dtype)
    for bench in benches:
        bench.run()
    del benches
    release_memory()
    return max(0, _resident("VmHWM") - before)


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _resident(field: str) -> int:
    """Bytes of this process's resident memory now (VmRSS) or at its peak since the last reset (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS (Linux 4.0 and later)


@functools.cache
def _peak_resettable() -> bool:
    try:
        _reset_peak()
        _resident("VmHWM")
    except (OSError, StopIteration):
        return False
    return True


def fitted_batch(presets: tuple[str, ...], batch: int, device: str, dtype: torch.dtype) -> int:
    """The largest batch, halving from ``batch``, at which one training step of every member of the group runs
    (the estimate first, then a real step: an OOM halves); 0 when not even one sequence fits."""
    while batch >= 1:
        if all(too_large(p, batch, "model", device, dtype) is None for p in presets) and _steps_run(
            presets, batch, device, dtype
        ):
            return batch
        batch //= 2
    return 0


def _steps_run(presets: tuple[str, ...], batch: int, device: str, dtype: torch.dtype) -> bool:
    """Whether one training step of each of ``presets`` runs at ``batch`` (False: out of memory)."""

    def steps():
        for preset in presets:
            model_benches(preset, batch, device, dtype)[0].run()
            release_memory()
        return True

    return unless_oom(steps) is not None


def unless_oom(call: Callable[[], T]) -> T | None:
    """``call()``, or None where it ran out of memory (a result, not a bug: anything else is raised). The memory
    is released after the handler ends: until then the error's traceback holds the failed call's frames, and so
    its tensors (seen on an H100: after one OOM, every smaller batch ran out of memory too)."""
    try:
        return call()
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
    release_memory()
    return None


def _cuda_peak(step: Callable, clear: Callable[[], None] = lambda: None) -> float:
    """The most one ``step()`` holds above what was allocated just before it: its own activations, gradients and
    workspace. The group's other members, their weights and optimizer state, and the timer's L2-flush buffer
    are all resident on the device then, and would pull every member's peak toward the same large number."""
    step()  # warm: allocator pools, autotuning, the optimizer's state
    clear()  # the gradients the warm step left: else resident, and the step's own gradients drop out
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - resident)


def release_memory() -> None:
    """Return what dead tensors hold to the device: objects in reference cycles collected first. The next CUDA
    graph gets a pool of its own (:func:`captured`)."""
    gc.collect()
    _graph_pool.cache_clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
