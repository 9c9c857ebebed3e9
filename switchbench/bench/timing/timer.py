"""The one timer of the suite's measurements: milliseconds of a call, with CUDA events after an L2 flush on a GPU and
the wall or the calling thread's CPU clock on the CPU; the intra-op threads a CPU run uses; and the device's
measured matmul peak, the yardstick of every "fraction of peak". speed, the gate, profile and kernel-bench time
with it."""

import contextlib
import functools
import statistics
import time
from collections.abc import Callable

import torch

from switchbench.core.profiler import profiled


class Timer:
    """Milliseconds of one call: CUDA events after an L2 flush on a GPU; on the CPU, wall-clock, or with
    ``clock="thread"`` the calling thread's CPU time, which leaves out the slices other processes hold the cores
    (with one intra-op thread, and autograd running CPU work on the caller, that thread does all the work)."""

    def __init__(self, device: str, clock: str = "wall"):
        self.device = device
        self.clock = time.thread_time if clock == "thread" else time.perf_counter
        if device == "cuda":
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn: Callable) -> float:
        if self.device != "cuda":
            start = self.clock()
            fn()
            return 1e3 * (self.clock() - start)
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def cpu_threads(device: str, asked: int | None = None) -> int | None:
    """The intra-op threads a training or a timing runs with: ``asked``, else one on the CPU, else as they are
    (None). On a shared machine busy neighbours stall a pool of one thread per core: a tiny quality run took
    several times longer with two threads on two busy cores, and a quick ListOps training about 280 s (idle, the
    whole quick main job took 66 s; 77 s on one thread)."""
    return 1 if asked is None and device == "cpu" else asked


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Run the block with ``threads`` intra-op threads (None: as they are); the setting is restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kernel_ms(fn: Callable) -> float:
    """Milliseconds the GPU spends in kernels (and copies) during one call of ``fn``, from one profiled call: each
    device event counted once, since an operator's own device time would count its kernels again. Over a call's
    timed milliseconds it is the GPU-busy fraction: well below 1, the host sets the pace."""
    from torch.profiler import ProfilerActivity

    with profiled([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # a record_function range (torch.optim's Optimizer.step, the expert matmul's labels) comes back as a device
    # event too, spanning its kernels: counted, it counts them twice
    device_events = (
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    return sum(e.time_range.elapsed_us() for e in device_events) / 1e3


def iqr(values: list[float]) -> float:
    """The interquartile range of timed calls (0 for fewer than two): the spread printed beside each median."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


# The CPU's yardstick product grows from 128 rows, doubling while one takes under this, to 1024. On a 2-core EPYC VM
# float32 reaches 1024 (15 ms a product), and bfloat16, which that CPU does not support natively, stops at 256
# (24 ms a product; at 1024, 2.6 s, and the peak took half a minute of every bf16 command). Its rate is not monotone
# in size (bf16: 2.7 GFLOP/s at 128 rows, 1.4 at 256; float32: 84 at 256, 70 at 1024), so every size tried counts.
_CPU_PRODUCT_MS, _CPU_ROWS = 20.0, (128, 1024)


def matmul_peak_tflops(device: str, dtype: torch.dtype) -> float:
    """This device's achievable dense-matmul throughput, measured: the yardstick for 'fraction of peak'. A square
    product of 8192 rows on a GPU, at its median time. On the CPU, whose rate swings with size and with what else
    runs, the best rate of square products from 128 rows, doubling until one takes _CPU_PRODUCT_MS (at most 1024)."""
    timer = Timer(device)
    if device == "cuda":
        return _rate(timer, _square_product(8192, device, dtype), 8192, statistics.median)
    best, n = 0.0, _CPU_ROWS[0]
    while True:
        product = _square_product(n, device, dtype)
        ms = timer(product)
        best = max(best, _rate(timer, product, n, min))
        if n >= _CPU_ROWS[1] or ms >= _CPU_PRODUCT_MS:
            return best
        n *= 2


def _rate(timer, product: Callable[[], torch.Tensor], n: int, summary) -> float:
    """TFLOP/s of ``product``, square of ``n`` rows: three calls to warm up, then ``summary`` of ten timed ones."""
    for _ in range(3):
        timer(product)
    return 2 * n**3 / summary(timer(product) for _ in range(10)) / 1e9


def _square_product(n: int, device: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return functools.partial(torch.matmul, a, b)


def memory_bandwidth_gbs(device: str) -> float:
    """This device's achievable memory bandwidth, measured by copying a buffer far larger than its caches (1 GiB on
    a GPU, 256 MiB on the CPU): bytes read and written over the median time. The yardstick of decode floors."""
    size = 2**30 if device == "cuda" else 2**28
    src, dst = (
        torch.empty(size, dtype=torch.int8, device=device),
        torch.empty(size, dtype=torch.int8, device=device),
    )
    src.fill_(1)
    timer = Timer(device)
    for _ in range(3):
        timer(lambda: dst.copy_(src))
    ms = statistics.median(timer(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * size / ms / 1e6
