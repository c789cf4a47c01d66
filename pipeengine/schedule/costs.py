"""Per-action durations a schedule is lowered and simulated with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .actions import Kind, Schedule

__all__ = ["Costs", "per_stage", "boundary_comm"]


@dataclass(frozen=True)
class Costs:
    """Per-action durations for one microbatch through one stage (same time unit throughout).

    ``b`` is the input-gradient part of backward and ``w`` the weight-gradient part: a schedule
    without W actions runs both in its B (cost b + w), a zero-bubble schedule runs them apart.
    ``comm`` is the time a matched transfer takes across this stage's boundary with the next stage: its output
    going on and the gradient of that output coming back (per-stage costs may differ: a slow link, a large
    activation). A transfer within one position (the turn of the V) takes no time.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost {name}={getattr(self, name)} is negative; costs are durations >= 0")

    def of(self, kind: Kind, split: bool) -> float:
        if kind is Kind.F:
            return self.f
        if kind is Kind.B:
            return self.b if split else self.b + self.w
        return self.w

    def per_chunk(self, chunks: int) -> "Costs":
        """Costs of one of ``chunks`` equal stages when these are costs of a position's whole share."""
        return Costs(self.f / chunks, self.b / chunks, self.w / chunks, self.comm)


def per_stage(costs: Costs | Sequence[Costs], schedule: Schedule) -> list[list[Costs]]:
    """``table[p][c]``: the costs of the stage position p runs as chunk c.

    ``costs`` is one Costs for every stage, one per position (each of its chunks costs the same), or
    one per stage (``num_stages`` entries, stage order: the position's chunks may cost different
    amounts, as a split of measured layers does).
    """
    pp, chunks = schedule.pp, schedule.chunks
    if isinstance(costs, Costs):
        return [[costs] * chunks for _ in range(pp)]
    costs = list(costs)
    if len(costs) == pp:
        return [[c] * chunks for c in costs]
    if len(costs) == pp * chunks:
        return [[costs[schedule.stage(p, c)] for c in range(chunks)] for p in range(pp)]
    raise ValueError(f"got {len(costs)} per-position costs for pp={pp}; give one Costs, one per position ({pp})"
                     + (f" or one per stage ({pp * chunks})" if chunks > 1 else ""))


def boundary_comm(costs: Costs | Sequence[Costs], schedule: Schedule) -> list[float]:
    """``comm[s]``: the time of a transfer between stage s and stage s + 1 (0 where both are on one position)."""
    table = per_stage(costs, schedule)
    out = []
    for s in range(schedule.num_stages - 1):
        (p, c), (q, _) = schedule.placement(s), schedule.placement(s + 1)
        out.append(table[p][c].comm if p != q else 0.0)
    return out
