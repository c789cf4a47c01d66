"""CPU training keeps freed host memory for reuse (glibc's malloc tuned), as CUDA's caching allocator does."""

from __future__ import annotations


def test_keep_freed_memory_tunes_glibc_here() -> None:
    import platform

    from pipeengine.runtime.hostalloc import keep_freed_memory
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc")
