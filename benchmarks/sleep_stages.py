"""A synthetic pipeline stage whose forward and backward take a set wall time without using the CPU.

Forward sleeps ``t_f``; the backward is split into an input-gradient part (sleeps ``t_b``) and a
weight-gradient part (sleeps ``t_w``) on two separate autograd nodes, so a zero-bubble engine that
asks autograd for input gradients only (``inputs=[x]``) runs just the first and a later weight pass
just the second, while a full backward runs both. A real activation tensor flows between stages.
Sleeping releases the GIL and the core, so 8 ranks fit on 2 cores and a measured step shows only
scheduling and communication overhead.

[Note: hitting the set time]
A plain ``time.sleep(t)`` after the stage's tensor work overshoots here: the sleep itself ends
about 0.1 ms late, and the first tensor ops after a sleep run on a cold core (on this VM a 32 KB
copy takes about 100 us right after a 10 ms sleep against 3 us warm), so a "10 ms" forward measured
10.5 ms and a "20 ms" backward 20.7 ms before any engine was involved. Each part therefore does its
tensor work first and then sleeps until ``start + t``, shortened by the sleep overshoot measured
once per process (:func:`overshoot`). Whatever runs after the stage (the engine's sends, autograd's
bookkeeping) is the engine's cost and stays in the measured step. Both engines run these stages.

While ``RECORD`` is a list, each part appends ``(kind, start, end)`` to it: "F", "B" (input gradient) or "W"
(weight gradient), ``time.perf_counter`` seconds (benchmarks/critical_path.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepStage", "sleep_layers", "sleep_until", "overshoot", "RECORD"]

_overshoot: float | None = None
RECORD: list[tuple[str, float, float]] | None = None   # each part's stamps, while a list (see the module docstring)


def _stamp(kind: str, start: float) -> None:
    if RECORD is not None:
        RECORD.append((kind, start, time.perf_counter()))


def overshoot() -> float:
    """Median seconds by which ``time.sleep`` overshoots a 2 ms request in this process (measured once)."""
    global _overshoot
    if _overshoot is None:
        late = []
        for _ in range(15):
            t0 = time.perf_counter()
            time.sleep(0.002)
            late.append(time.perf_counter() - t0 - 0.002)
        _overshoot = max(0.0, statistics.median(late))
    return _overshoot


def sleep_until(deadline: float) -> None:
    """Sleep so that ``time.perf_counter()`` is about ``deadline`` on return (never busy-waits)."""
    left = deadline - time.perf_counter() - overshoot()
    if left > 0:
        time.sleep(left)


class _SleepInput(torch.autograd.Function):
    split_backward_safe = True   # its backward only passes the gradient on (see pipeengine/runtime/backward.py)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = time.perf_counter()
        sleep_until(start + ctx.t_b)
        _stamp("B", start)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    split_backward_safe = True

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, t_w: float) -> torch.Tensor:
        ctx.t_w = t_w
        return w.sum() * 0.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = time.perf_counter()
        out = torch.zeros(1, dtype=grad.dtype, device=grad.device)
        sleep_until(start + ctx.t_w)
        _stamp("W", start)
        return out, None


class SleepStage(nn.Module):
    """y = x (copied) in t_f seconds; backward takes t_b (to x) and t_w (to the weight)."""

    def __init__(self, t_f: float, t_b: float, t_w: float) -> None:
        super().__init__()
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.weight = nn.Parameter(torch.zeros(1))
        overshoot()   # calibrate now, not inside the first timed step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = _SleepInput.apply(x, self.t_b) + _SleepWeight.apply(self.weight, self.t_w)
        sleep_until(start + self.t_f)
        _stamp("F", start)
        return y


def sleep_layers(num_stages: int, t_f: float, t_b: float, t_w: float) -> list[nn.Module]:
    """One SleepStage per pipeline stage (times in seconds)."""
    return [SleepStage(t_f, t_b, t_w) for _ in range(num_stages)]
