"""What a step produced (:class:`StepResult`), and a step in progress on a rank (:class:`StepState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..schedule import Kind
from .clock import ActionRecord

__all__ = ["StepResult", "StepState"]


@dataclass
class StepResult:
    """What one train/eval step produced on this rank (loss and grad norm are global)."""

    loss: float
    grad_norm: float | None = None
    step_time: float = 0.0
    _records: list[ActionRecord] | Callable[[], list[ActionRecord]] = field(default_factory=list, repr=False)
    started_at: float = 0.0                                     # the records' zero on the host's wall clock
    peak_stored: dict[int, int] = field(default_factory=dict)   # stage -> peak microbatches held
    outputs: list[Any] | None = None                            # eval on the last stage, if asked
    skipped: bool = False                                       # no optimizer step (non-finite, see below)
    nonfinite: bool = False                                     # the loss or gradients were non-finite
    grad_sync_wait: float = 0.0                                 # seconds waiting for the DP all-reduce
    stop: int | None = None                                     # a signal some rank got: every rank stops here

    @property
    def records(self) -> list[ActionRecord]:
        """This rank's timed actions (clock.py), made on the first read (a step files hundreds: about 0.1 ms of Python
        each step, for a caller who may never read them)."""
        if callable(self._records):
            self._records = self._records()
        return self._records

    @records.setter
    def records(self, value: list[ActionRecord] | Callable[[], list[ActionRecord]]) -> None:
        self._records = value

    def __getstate__(self) -> dict[str, Any]:   # pickled or copied with its records made
        return {**self.__dict__, "_records": self.records}


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
