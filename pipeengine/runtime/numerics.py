"""Numerics at the end of a step: what every rank learns in one sum, non-finite reports, fp16 loss scaling."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .device import constant

__all__ = ["NonFiniteError", "StepSignals", "SignalVector", "LossScale", "nonfinite_message", "STOP_SIGNALS",
           "stop_signal"]


class NonFiniteError(FloatingPointError):
    """The loss or the gradients went non-finite (``on_nonfinite="stop"``); raised on every rank alike."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)   # in the precedence a stop reports them


@dataclass
class StepSignals:
    """What every rank of a pipeline knows after the step's one sum over it (see :class:`SignalVector`)."""

    grad_sq: float                  # squared gradient norm, each logical parameter counted once
    loss: float                     # this replica's step loss (the last stage's microbatch losses, summed)
    nonfinite_outputs: list[float]  # per stage: outputs (or the loss) that went non-finite
    nonfinite_grads: list[float]    # per stage: input gradients (what B passes back) that went non-finite
    stops: list[float]              # per STOP_SIGNALS: how many ranks asked to stop after this step
    nonfinite_weights: list[float] = field(default_factory=list)   # per stage: weight gradients, after the DP sync

    def origin(self) -> int:
        """Where this replica's own computation first went non-finite, as one number the replicas can sum:
        1 + the first stage with a non-finite output, else -(1 + the last stage with a non-finite input
        gradient), else 0 (the weight gradients after the sync may carry another replica's)."""
        out = [s for s, v in enumerate(self.nonfinite_outputs) if v > 0]
        grad = [s for s, v in enumerate(self.nonfinite_grads) if v > 0]
        return 1 + out[0] if out else -(1 + grad[-1]) if grad else 0


class SignalVector:
    """The float64 vector a step sums over its pipeline (consensus.py): the layout of :class:`StepSignals` in one place.

    ``[loss, stop requests per STOP_SIGNALS, (outputs, input grads, weight grads) per stage, squared norm per
    parameter]``;
    each rank adds its share in place on the device (no host sync until the sum has been waited
    for). A stop request (Ctrl-C, SIGTERM, SIGHUP on any rank) rides here, so every rank of the
    pipeline learns it at the same step without asking the store.

    [Note: the norm in the model's order]
    Each parameter's squared gradient norm has a slot of its own, in the model's parameter order
    (layer by layer, ``plan.param_slot``), written by the one rank that counts it; after the
    pipeline's sum (of one value and zeros: exact) every rank adds the slots in that order. The
    norm, and so the clipping, is the same to the last bit whatever the split, where per-rank
    partial sums would add the same numbers in another order.
    """

    def __init__(self, num_stages: int, num_params: int, device: torch.device) -> None:
        self.num_stages, self.num_params = num_stages, num_params
        self._flags = 1 + len(STOP_SIGNALS)
        self._norms = self._flags + 3 * num_stages
        self.tensor = torch.zeros(self.length(num_stages, num_params), dtype=torch.float64, device=device)

    @staticmethod
    def length(num_stages: int, num_params: int) -> int:
        """The vector's length for a pipeline of ``num_stages`` stages and ``num_params`` parameter tensors."""
        return 1 + len(STOP_SIGNALS) + 3 * num_stages + num_params

    def set_grad_sq(self, first: int, squares: torch.Tensor) -> None:
        """The squared norms of parameters ``first``, ``first + 1``, ... (in the model's order)."""
        start = self._norms + first
        self.tensor[start:start + len(squares)] = squares

    def set_loss(self, value: torch.Tensor) -> None:
        self.tensor[0] = value

    def request_stop(self, signum: int) -> None:
        self.tensor[1 + STOP_SIGNALS.index(signum)] = 1

    def add_stage(self, stage: int, sums: torch.Tensor) -> None:
        """A stage's float64 sums of (outputs or losses, input gradients, squared weight-gradient norms): each
        counts as non-finite where it is."""
        start = self._flags + 3 * stage
        self.tensor[start:start + 3].add_(torch.isfinite(sums).logical_not_())

    def replica_part(self, dp: int, replica: int, origin: bool = True) -> torch.Tensor:
        """What the replicas sum, on the device (after the pipeline's sum): ``[loss, stop requests, origin
        per replica]``, this replica's :meth:`StepSignals.origin` in its own slot (no host read: the replicas'
        all-reduce follows on the device, and the host reads both results at once); ``origin`` False: 0 there
        (a step that sums nothing per tensor has no origin to tell: [Note: non-finite] in update.py)."""
        out = torch.zeros(self._flags + dp, dtype=torch.float64, device=self.tensor.device)
        out[:self._flags] = self.tensor[:self._flags]
        if not origin:
            return out
        flags = self.tensor[self._flags:self._norms]
        stage = constant(range(self.num_stages), torch.float64, self.tensor.device)
        first_out = torch.where(flags[0::3] > 0, stage, float(self.num_stages)).min()
        last_grad = torch.where(flags[1::3] > 0, stage, -1.0).max()
        out[self._flags + replica] = torch.where(first_out < self.num_stages, 1 + first_out,
                                                 torch.where(last_grad >= 0, -(1 + last_grad), 0.0))
        return out

    def decode(self, values: Sequence[float]) -> StepSignals:
        """The signals, from the summed tensor's values (read by the host through the watch)."""
        flags = list(values[self._flags:self._norms])
        grad_sq = 0.0
        for square in values[self._norms:]:   # in the model's order: see the note
            grad_sq += square
        return StepSignals(grad_sq, values[0], flags[0::3], flags[1::3], list(values[1:self._flags]), flags[2::3])


def stop_signal(stops: Sequence[float]) -> int | None:
    """The signal a stop reports (the first of STOP_SIGNALS some rank got), or None."""
    return next((sig for sig, n in zip(STOP_SIGNALS, stops) if n > 0), None)


def nonfinite_message(step: int, signals: StepSignals, loss: float, grad_norm: float, origins: Sequence[float],
                      place: Callable[[int, int], str]) -> str:
    """Where a step went non-finite, the same on every rank (``loss``: the step's, over the replicas): ``origins``
    are the replicas'
    :meth:`StepSignals.origin` (the first replica that went non-finite on its own is the source: its first stage
    with a non-finite output, else its last with a non-finite input gradient); ``place(stage, replica)`` names
    its layers and rank. With every replica's forward and backward finite, the weight gradients are named."""
    source = next(((r, int(code)) for r, code in enumerate(origins) if code), None)
    weights = [s for s, v in enumerate(signals.nonfinite_weights) if v > 0]
    if source is not None and source[1] > 0:
        r, s = source[0], source[1] - 1
        where = f"the first non-finite forward output came from stage {s} of replica {r} ({place(s, r)})"
    elif source is not None:
        r, s = source[0], -source[1] - 1
        where = (f"the forward was finite; the backward went non-finite first in stage {s} of replica {r} "
                 f"({place(s, r)})")
    elif weights:
        where = (f"the forward and the input gradients were finite; the weight gradients of stage {weights[-1]} went "
                 f"non-finite")
    else:
        where = "the stage outputs and gradients were finite: the loss function returned it"
    return (f"step {step}: loss {loss:g}, gradient norm {grad_norm:g}: {where}. "
            f"Skip such steps with on_nonfinite='skip' (--on-nonfinite skip), or lower the learning rate")


class LossScale:
    """fp16's dynamic loss scale (as torch's GradScaler): the loss's gradient is ``value`` (divided by the
    microbatches, stage.py), as if the loss were multiplied by it; a step whose gradients overflow is skipped and
    halves it, 2000 good steps double it. Disabled (value 1.0, never overflowing) for fp32 and bf16. At the floor, a
    non-finite gradient is no overflow but non-finite (``on_nonfinite`` decides), or a diverged run would skip steps
    forever."""

    FLOOR = 2.0**-24

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.value = 2.0**16 if enabled else 1.0
        self.good_steps = 0

    def overflow(self, grad_norm: float) -> bool:
        """Whether a step with this gradient norm overflowed (to be skipped, the scale halved)."""
        return self.enabled and not math.isfinite(grad_norm) and self.value > self.FLOOR

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        self.good_steps = 0 if overflow else self.good_steps + 1
        if overflow:
            self.value = max(self.FLOOR, self.value / 2)
        elif self.good_steps % 2000 == 0:
            self.value *= 2

    def unscale(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.enabled:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(self.value)
