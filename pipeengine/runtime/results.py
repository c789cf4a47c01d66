"""What a step produced (:class:`StepResult`), and a step in progress on a rank (:class:`StepState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schedule import Kind
from .clock import ActionRecord

__all__ = ["StepResult", "StepState"]


@dataclass
class StepResult:
    """What one train/eval step produced on this rank (loss and grad norm are global)."""

    loss: float
    grad_norm: float | None = None
    step_time: float = 0.0
    records: list[ActionRecord] = field(default_factory=list)
    started_at: float = 0.0                                     # the records' zero on the host's wall clock
    peak_stored: dict[int, int] = field(default_factory=dict)   # stage -> peak microbatches held
    outputs: list[Any] | None = None                            # eval on the last stage, if asked
    skipped: bool = False                                       # no optimizer step (non-finite, see below)
    nonfinite: bool = False                                     # the loss or gradients were non-finite
    grad_sync_wait: float = 0.0                                 # seconds waiting for the DP all-reduce
    stop: int | None = None                                     # a signal some rank got: every rank stops here


@dataclass
class StepState:
    """One train or eval step in progress on this rank."""

    train: bool
    keep_outputs: bool
    inputs: list[Any]
    targets: list[Any]
    local: dict[tuple[Kind, int, int], Any] = field(default_factory=dict)  # pp = 1: stage output -> next stage
    computed: bool = True   # the last step run was a compute action (or none ran yet): see Wire.settle
    key: int = 0            # the step's random streams (rng.step_key)
