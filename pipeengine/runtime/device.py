"""Where the engine runs: the device to use, the CUDA calls that are no-ops on CPU, and host values sent to it.

[Note: no hidden syncs]
On CUDA, ``torch.tensor(values, device=cuda)`` copies from pageable memory: the host blocks until the
stream got there, a sync nobody watches (a hung peer there gets no wait-for report). The runtime's
per-step code never builds a device tensor from host values that way: values fixed for a run (index
tensors, shape headers) are :func:`constant` (made once per value through pinned memory, then reused), and
values new each step are computed on the device (a replica's origin: numerics.py). What the host reads back from
the device goes only through the watch (``faults.Watch.host_values``); ``tests/runtime/test_syncs.py``
reads the source to keep it so.

[Note: a send hands its core over]
A message through the host (Gloo) wakes its receiver, blocked in its wait, on the core that sent it, as Linux
places a task woken by a local socket, not on an idle one. A sender that stays busy (its next op, its stage's
epilogue, an optimizer step) then keeps the receiver from running until the scheduler preempts it: measured at
the end of a pp 2 step (2 cores), the receiver of the pipeline's sum woke 0.51-0.60 ms after it was sent, and
0.11-0.19 ms when the sender slept or yielded right after it. So after a comm step that sends on Gloo, and after
the sum's root sent it, the sender yields (:func:`hand_over`: one system call, and nothing else when no other
task waits for its core). ``benchmarks.efficiency`` shows the gain; NCCL's transfers do not wake the host.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["default_device", "nccl", "synchronize", "constant", "hand_over"]


def nccl(group: Any = None) -> bool:
    """Whether ``group`` (default: the world) runs NCCL (alone, or among several backends as ``cpu:gloo,cuda:nccl``)."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend(group))


def default_device() -> torch.device:
    """cuda:<current device> when the process group runs NCCL, else CPU."""
    if nccl() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def hand_over() -> None:
    """Let a task waiting for this core run now (see [Note: a send hands its core over])."""
    _yield()


_yield = getattr(os, "sched_yield", lambda: None)   # (POSIX; elsewhere nothing)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CONSTANTS: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def constant(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a device tensor made once and then reused (an index, a shape header): never write into it."""
    key = (tuple(values), dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 4096:   # shapes that keep changing: start again rather than grow for good
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = _from_host(key[0], dtype, device)
    return t


def _from_host(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor of host ``values`` without blocking the host: on CUDA through pinned memory (torch's caching
    host allocator keeps the block until the copy is done), a plain tensor on CPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
