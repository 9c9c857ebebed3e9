"""Keeping freed memory in the process heap, so that CPU timings time the computation and not page faults.

PyTorch's CPU allocator caches nothing: every tensor is a ``malloc``. glibc serves a block above its mapping
threshold (which grows with what is freed, up to 32 MiB) from a fresh ``mmap``, and gives the free top of the heap
back to the kernel past its trim threshold. A layer whose temporaries are tens of MiB then touches fresh pages on
some calls and not on others, depending on the heap's history: the 47M dense XL layer at batch 4 (scores of
[4, 10, 256, 512] floats, 20 MiB, padded to 30 MiB for the relative shift) took 0 to 19k page faults per forward,
up to +45% of its CPU time, while the SwitchHead layer, whose blocks are under 14 MiB, took none. The thread's CPU
clock counts the kernel zeroing those pages, so the gate's forward ratio wandered from 0.38 to 0.54 between
processes. With both thresholds raised the heap is kept and reused: 0 faults in the median call of every process,
loaded or not (now and then a call still grows the heap, by a few thousand pages).
"""

import ctypes
import platform

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT = 1 << 30  # blocks below this come from the heap, and up to this much free heap is kept


def keep_freed_memory() -> str:
    """Keep freed memory in this process's heap for the rest of the process (Linux with glibc; elsewhere nothing
    changes); what a run records of its allocator. Both thresholds: raising the trim threshold alone turns off
    glibc's adaptive mapping threshold, and every large block is mapped and faulted afresh."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "as is"
    libc = ctypes.CDLL(None)
    if libc.mallopt(M_MMAP_THRESHOLD, KEPT) and libc.mallopt(M_TRIM_THRESHOLD, KEPT):
        return f"glibc heap kept (mmap and trim thresholds {KEPT >> 20} MiB)"
    return "as is (mallopt refused)"
