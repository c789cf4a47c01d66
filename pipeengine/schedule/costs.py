"""Per-action durations a schedule is lowered and simulated with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .actions import Kind

__all__ = ["Costs", "per_position"]


@dataclass(frozen=True)
class Costs:
    """Per-action durations for one microbatch through one stage (same time unit throughout).

    ``b`` is the input-gradient part of backward and ``w`` the weight-gradient part: a schedule
    without W actions runs both in its B (cost b + w), a zero-bubble schedule runs them apart.
    ``comm`` is the time a matched transfer takes.
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


def per_position(costs: Costs | Sequence[Costs], pp: int) -> list[Costs]:
    """One Costs per position: ``costs`` repeated, or checked to have one entry per position."""
    if isinstance(costs, Costs):
        return [costs] * pp
    if len(costs) != pp:
        raise ValueError(f"got {len(costs)} per-position costs for pp={pp}; give one Costs or one per position")
    return list(costs)
