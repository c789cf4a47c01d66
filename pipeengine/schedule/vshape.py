"""Builders for the V placement from integers: zero-bubble V (zbv) and DualPipeV.

Position r runs stage r as chunk 0 (going down) and stage 2pp-1-r as chunk 1 (coming back up), so the first
and the last stage sit on position 0 (see :class:`~pipeengine.schedule.actions.Schedule`). Each builder
returns, per position, the order of its compute actions; a B whose W is in the order is the input-gradient
half of a split backward, any other B the full backward.
"""

from __future__ import annotations

from .actions import Action, Kind

__all__ = ["zbv", "dualpipev"]


class _Order:
    """One position's order as it is written: the next microbatch of each (kind, chunk), and the W's of split
    B's waiting for their turn (oldest first)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[Kind, int], int] = {}
        self.waiting: list[Action] = []

    def done(self, kind: Kind, chunk: int) -> int:
        return self.count.get((kind, chunk), 0)

    def run(self, kind: Kind, chunk: int) -> None:
        """The next microbatch's ``kind`` on ``chunk``."""
        mb = self.done(kind, chunk)
        self.count[(kind, chunk)] = mb + 1
        self.actions.append(Action(kind, mb, chunk))

    def backward(self, chunk: int, split: bool) -> None:
        """The next B on ``chunk``: split (its W waits its turn) or full."""
        self.run(Kind.B, chunk)
        if split:
            self.waiting.append(Action(Kind.W, self.done(Kind.B, chunk) - 1, chunk))

    def weight(self) -> None:
        """The oldest waiting W, if any."""
        if self.waiting:
            self.actions.append(self.waiting.pop(0))


def zbv(pp: int, microbatches: int) -> list[list[Action]]:
    """Zero-bubble V (ZB paper, section 6): two stages per position in V placement, backward split into B and W.

    Position r runs stage r (chunk 0, going down) and stage 2pp-1-r (chunk 1, coming back up), so the
    last stage and the loss are on position 0. Warm-up: 2(pp-r)-1 chunk-0 forwards, then r times a
    chunk-1 forward followed by a chunk-0 forward, then pp-r times F, B, W of chunk 1. Steady state:
    F, B, W on chunk 0, then on chunk 1, until every forward ran. Cool-down: r times B on chunk 0 and
    chunk 1, then pp-r times B and W on chunk 0, then the W's left (chunk 1 first). With f = b = w
    per stage the bubble is almost gone and each position holds at most 2pp chunk activations
    (pp microbatches' worth, as 1F1B's first position). Fewer than 2pp-1 microbatches run the same
    order with the missing ones left out.
    """
    n = max(2 * pp - 1, microbatches)   # the order is laid out for at least 2pp-1 microbatches
    progs = []
    for r in range(pp):
        o = _Order()
        for _ in range(2 * (pp - r) - 1):
            o.run(Kind.F, 0)
        for _ in range(r):
            o.run(Kind.F, 1)
            o.run(Kind.F, 0)
        for _ in range(pp - r):
            for kind in (Kind.F, Kind.B, Kind.W):
                o.run(kind, 1)
        while o.done(Kind.F, 0) < n or o.done(Kind.F, 1) < o.done(Kind.F, 0):
            if o.done(Kind.F, 0) < n:
                o.run(Kind.F, 0)
            o.run(Kind.B, 0)
            o.run(Kind.W, 0)
            for kind in (Kind.F, Kind.B, Kind.W):
                o.run(kind, 1)
        for _ in range(r):
            o.run(Kind.B, 0)
            o.run(Kind.B, 1)
        for _ in range(pp - r):
            o.run(Kind.B, 0)
            o.run(Kind.W, 0)
        for chunk in (1, 0):
            while o.done(Kind.W, chunk) < o.done(Kind.B, chunk):
                o.run(Kind.W, chunk)
        progs.append([a for a in o.actions if a.microbatch < microbatches])
    return progs


def dualpipev(pp: int, microbatches: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, as torch 2.14 runs it): V placement, mostly full backwards.

    Position r runs stage r (chunk 0) and stage 2pp-1-r (chunk 1). Warm-up: 2(pp-r-1) chunk-0 forwards, then
    r+1 pairs of a chunk-0 and a chunk-1 forward, then pp-r-1 times a split B and a W of chunk 1 followed by a
    chunk-1 forward. Steady state, m-2pp+r+1 times: F of chunk 0 with the full B of chunk 1, then F of chunk 1
    with the full B of chunk 0 (DualPipe overlaps each pair's computation with the other's communication;
    here they are two actions, one after the other). Drain: pp-r-1 times a full B of chunk 1, then F of
    chunk 1 with a full B of chunk 0; then r+1 pairs of B's (chunk 1, chunk 0) that switch to split backwards
    halfway; pp-r-1 times a W then a split B of chunk 0; the W's left. A B is split exactly when its W is in
    the schedule. Fewer than 2pp microbatches run the same order with the missing ones left out.
    """
    n = max(2 * pp, microbatches)
    progs = []
    for r in range(pp):
        o = _Order()
        for _ in range(2 * (pp - r - 1)):
            o.run(Kind.F, 0)
        for _ in range(r + 1):
            o.run(Kind.F, 0)
            o.run(Kind.F, 1)
        for _ in range(pp - r - 1):
            o.backward(1, split=True)
            o.weight()
            o.run(Kind.F, 1)
        for _ in range(n - 2 * pp + r + 1):
            o.run(Kind.F, 0)
            o.backward(1, split=False)
            o.run(Kind.F, 1)
            o.backward(0, split=False)
        for _ in range(pp - r - 1):
            o.backward(1, split=False)
            o.run(Kind.F, 1)
            o.backward(0, split=False)
        half = (r + 1) // 2   # from here on the B's are split (odd r: from this pair's chunk 1, even r: its chunk 0)
        for i in range(r + 1):
            o.backward(1, split=i > half or (i == half and r % 2 == 1))
            o.backward(0, split=i >= half)
        for _ in range(pp - r - 1):
            o.weight()
            o.backward(0, split=True)
        while o.waiting:
            o.weight()
        progs.append([a for a in o.actions if a.microbatch < microbatches])
    return progs
