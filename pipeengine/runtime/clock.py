"""The engine's clock: every action of a step timed (host clock on CPU, CUDA events on a GPU), gathered to rank 0."""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Phase", "COMPUTE_PHASES", "ActionRecord", "ActionClock", "gather_records"]


class Phase(str, enum.Enum):
    """What a timed record covers (a ``str`` enum, so ``Phase.F == "F"``)."""

    F = "F"          # forward of one microbatch through one stage
    B = "B"          # backward (input gradients only when the schedule has W)
    W = "W"          # weight gradients of a split backward
    COMM = "COMM"    # posting one comm step (a header step also waits for its header)
    WAIT = "WAIT"    # blocked on a transfer the next compute needs, or on the step's last sends
    SYNC = "SYNC"    # end of step: DP gradient all-reduce, tied sums, norm, optimizer step

    def __str__(self) -> str:
        return self.value


COMPUTE_PHASES = (Phase.F, Phase.B, Phase.W)


class ActionRecord(NamedTuple):
    """One timed action of one rank; times in seconds since the step started on that rank."""

    rank: int
    stage: int         # the stage the action ran (-1 when not one stage's)
    kind: Phase        # F, B, W (compute); COMM (posting a send/recv batch); WAIT (blocked on a transfer);
    #                    SYNC (end of step: DP all-reduce, norm, optimizer step)
    microbatch: int    # -1 when not applicable
    start: float
    end: float


class ActionClock:
    """Times a rank's actions: ``perf_counter`` on CPU, CUDA events on a GPU (so waits on the stream count).

    ``mark()`` returns a time stamp (a float, or a recorded event); ``add()`` files a record with two
    stamps; ``records()`` turns them into :class:`ActionRecord` in seconds since ``start()``
    (on CUDA it waits, through ``poll``, for the last event marked, unless ``end()`` did: the ones before it
    happened before it).
    """

    def __init__(self, rank: int, device: torch.device,
                 poll: Callable[[Any], None] | None = None) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        # how to wait for an event (a watched poll: a device that never gets there is a hang, reported)
        self._poll = poll or (lambda event: None)
        self._t0: Any = None
        self.started_at = 0.0    # time.time() at start()
        self._last: Any = None   # the last stamp marked
        self._settled = False    # the device got past every stamp marked so far (_settle() waited for the last)
        self._pending: list[tuple[int, Phase, int, Any, Any]] = []

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            self._last, self._settled = ev, False
            return ev
        self._last = time.perf_counter()
        return self._last

    def start(self) -> None:
        self._t0 = self.mark()
        # the same moment on the host's wall clock, to draw the ranks' steps side by side (on CUDA the moment the
        # start event was queued: it runs once the device got there, later by the work queued before it)
        self.started_at = time.time()
        self._pending = []

    def add(self, stage: int, kind: Phase, microbatch: int, start: Any, end: Any) -> None:
        self._pending.append((stage, kind, microbatch, start, end))

    def _settle(self, stamp: Any) -> None:
        """On CUDA, wait (through ``poll``) for ``stamp`` unless the device is known past it; the last stamp marked
        settles every one before it (they were recorded before it, on the same stream)."""
        if self.cuda and not self._settled:
            self._poll(stamp)
            self._settled = stamp is self._last

    def elapsed(self, stamp: Any) -> float:
        """Seconds from ``start()`` to ``stamp``."""
        if self.cuda:
            self._settle(stamp)
            return float(self._t0.elapsed_time(stamp)) / 1000.0
        return float(stamp - self._t0)

    def end(self) -> float:
        """Seconds from ``start()`` to the last stamp marked (on CUDA it waits for it, so the stamps read after need no
        wait)."""
        return self.elapsed(self._last)

    def records(self) -> list[ActionRecord]:
        if not self.cuda:
            return [ActionRecord(self.rank, stage, kind, mb, s - self._t0, e - self._t0)
                    for stage, kind, mb, s, e in self._pending]
        self._settle(self._last)   # one wait at most
        ms = self._t0.elapsed_time
        return [ActionRecord(self.rank, stage, kind, mb, ms(s) / 1000.0, ms(e) / 1000.0)
                for stage, kind, mb, s, e in self._pending]


def gather_records(records: list[ActionRecord], group: dist.ProcessGroup | None = None,
                   dst: int = 0) -> dict[int, list[ActionRecord]] | None:
    """Every rank's records on global rank ``dst``, keyed by sender (None elsewhere); collective on ``group``.

    Without an initialised process group this is the single-process case: ``{0: records}``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return {0: list(records)}
    size = dist.get_world_size(group)
    gathered: list[Any] | None = [None] * size if dist.get_rank() == dst else None
    # plain tuples pickle smaller and do not need this module on the receiving side
    dist.gather_object([tuple(r) for r in records], gathered, dst=dst, group=group)
    if gathered is None:
        return None
    senders = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    return {src: [ActionRecord(*t) for t in rs or []] for src, rs in zip(senders, gathered)}
