"""A synthetic pipeline stage whose forward and backward take a set wall time without using the CPU.

Forward sleeps ``t_f``; the backward is split into an input-gradient part (sleeps ``t_b``) and a
weight-gradient part (sleeps ``t_w``) on two separate autograd nodes, so a zero-bubble engine that
asks autograd for input gradients only (``inputs=[x]``) runs just the first and a later weight pass
just the second, while a full backward runs both. A real activation tensor flows between stages.
Sleeping releases the GIL and the core, so 8 ranks fit on 2 cores and a measured step shows only
scheduling and communication overhead.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepStage", "sleep_layers"]


class _SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        if t_f > 0:
            time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.t_b > 0:
            time.sleep(ctx.t_b)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, t_w: float) -> torch.Tensor:
        ctx.t_w = t_w
        return w.sum() * 0.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.t_w > 0:
            time.sleep(ctx.t_w)
        return torch.zeros(1, dtype=grad.dtype, device=grad.device), None


class SleepStage(nn.Module):
    """y = x (copied) after sleeping t_f; backward sleeps t_b (to x) and t_w (to the weight)."""

    def __init__(self, t_f: float, t_b: float, t_w: float) -> None:
        super().__init__()
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInput.apply(x, self.t_f, self.t_b) + _SleepWeight.apply(self.weight, self.t_w)


def sleep_layers(num_stages: int, t_f: float, t_b: float, t_w: float) -> list[nn.Module]:
    """One SleepStage per pipeline stage (times in seconds)."""
    return [SleepStage(t_f, t_b, t_w) for _ in range(num_stages)]
