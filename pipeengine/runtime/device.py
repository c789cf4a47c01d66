"""Where the engine runs: the device to use, and the CUDA calls that are no-ops on CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["default_device", "synchronize"]


def default_device() -> torch.device:
    """cuda:<current device> when the process group runs NCCL (alone, or among several backends as
    ``cpu:gloo,cuda:nccl``), else CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
