"""Host memory for the training step: freed tensors are kept for reuse instead of handed back to the kernel.

glibc's malloc serves every block over its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it when
freed. A step on host memory (the cpu device, or the optimizer step under cpu_offload) frees and reallocates its
largest tensors every step (gradients, the optimizer's temporaries, logits), so each step faults them in again,
page by page, zeroed by the kernel: on a 246M-parameter Llama that is half the step's time, spent in the kernel,
and the step times scatter with it. Serving every block from the heap and never trimming it makes a step reuse the
memory of the step before; a rank's resident memory then stays at its peak, which the steps reach again anyway. A
process whose allocator the user chose (GLIBC_TUNABLES, MALLOC_* variables, or another malloc preloaded) is left as
it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_MAX = -4
NEVER_TRIM = -1  # mallopt(3): a trim threshold of -1 disables trimming


@functools.cache
def keep_freed_blocks() -> bool:
    """Serve this process's allocations from the heap and keep freed blocks there (glibc only). Returns whether
    the setting was applied; False where the C library is not glibc or the user set the allocator up."""
    if platform.libc_ver()[0] != "glibc" or _allocator_chosen_by_user(os.environ):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def _allocator_chosen_by_user(environ) -> bool:
    return ("glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(name.startswith("MALLOC_") and name.endswith("_") for name in environ)
            or "malloc" in environ.get("LD_PRELOAD", ""))
