"""CPU training: keep freed host memory for reuse, as CUDA's caching allocator does on a GPU.

glibc serves every allocation above its mmap threshold (128 KiB at first) with a fresh ``mmap``
and gives it back with ``munmap``; memory freed at the top of the heap above the trim threshold
goes back to the system too. A training step allocates and frees the same large tensors every
microbatch, so each one comes back as fresh pages that fault in on first touch: measured on four
GPT blocks (one thread), the split backward's B + W took 1.15-1.17x the fused backward with glibc's
defaults and 1.06x with memory kept (benchmarks/split_backward.py), and ops like ``fill_`` ran 6x
slower. :func:`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB) and stops
trimming, so freed blocks are reused; the process's resident memory then stays at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process (see the module docstring); False where it is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    ok &= mallopt(_M_TOP_PAD, 64 * 2**20)
    return bool(ok)
