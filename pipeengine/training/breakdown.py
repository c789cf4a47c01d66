"""Where a step's time went: each rank's compute, bubble, comm, overhead and sync, and the measured bubble."""

from __future__ import annotations

from typing import Mapping, Sequence

from ..runtime.clock import COMPUTE_PHASES, ActionRecord, Phase
from ..schedule import Costs, Schedule, simulate

__all__ = ["PARTS", "decompose", "pipeline_bubble", "simulated_bubble", "duration"]


def duration(r: ActionRecord) -> float:
    if r.end < r.start:
        raise ValueError(f"record {r} ends before it starts (end {r.end} < start {r.start})")
    return r.end - r.start


PARTS = ("compute", "bubble", "comm", "overhead", "sync")


def decompose(records_by_rank: Mapping[int, Sequence[ActionRecord]], step_time: float) -> dict[int, dict[str, float]]:
    """Split each rank's step into parts (seconds) that add up to ``step_time``.

    Give it the ranks of one pipeline (one replica). The *program* of a rank ends with its last
    record before ``SYNC``; the pipeline's program span is the latest such end.

    - ``compute``: F, B and W;
    - ``comm``: posting comm steps (``COMM``);
    - ``bubble``: blocked inside the schedule on a neighbour (``WAIT``), and waiting for the
      pipeline's last rank to end its program: what the simulator calls bubble;
    - ``overhead``: the rest of the rank's program (the engine's own work between actions);
    - ``sync``: after the program span: DP all-reduce, tied sums, norm, optimizer step, and
      waiting for the step's slowest rank.
    """
    def program_end(rs: Sequence[ActionRecord]) -> float:
        return max([r.end for r in rs if r.kind != Phase.SYNC] + [0.0])

    span = max([program_end(rs) for rs in records_by_rank.values()] + [0.0])
    out = {}
    for rank, rs in records_by_rank.items():
        kinds: dict[str, float] = {}
        for r in rs:
            kinds[r.kind] = kinds.get(r.kind, 0.0) + duration(r)
        compute = sum(kinds.get(k, 0.0) for k in COMPUTE_PHASES)
        comm, wait = kinds.get(Phase.COMM, 0.0), kinds.get(Phase.WAIT, 0.0)
        end = program_end(rs)
        out[rank] = {"compute": compute, "bubble": wait + span - end, "comm": comm,
                     "overhead": max(0.0, end - compute - comm - wait), "sync": max(0.0, step_time - span)}
    return out


def pipeline_bubble(parts_by_rank: Mapping[int, Mapping[str, float]]) -> float:
    """The measured bubble: mean over a pipeline's ranks of bubble / program span (see :func:`decompose`)."""
    if not parts_by_rank:
        raise ValueError("pipeline_bubble needs the parts of at least one rank (got none)")
    fractions = []
    for p in parts_by_rank.values():
        span = p["compute"] + p["bubble"] + p["comm"] + p["overhead"]
        fractions.append(p["bubble"] / span if span > 0 else 0.0)
    return sum(fractions) / len(fractions)


def simulated_bubble(schedule: Schedule, records_by_position: Sequence[Sequence[ActionRecord]]) -> float:
    """The simulator's bubble for this schedule fed each position's measured mean F, B and W times (one
    pipeline's records, by position: every replica runs the same program)."""
    split = schedule.split_backwards()
    per_position = []
    for p, rs in enumerate(records_by_position):
        f = _mean([r for r in rs if r.kind == Phase.F])
        if any(q == p for q, _, _ in split):   # b from the split B's; a full B is simulated as b + w
            split_b = [r for r in rs if r.kind == Phase.B
                       and (p, r.microbatch, schedule.placement(r.stage)[1]) in split]
            per_position.append(Costs(f=f, b=_mean(split_b), w=_mean([r for r in rs if r.kind == Phase.W])))
        else:
            per_position.append(Costs(f=f, b=_mean([r for r in rs if r.kind == Phase.B]), w=0.0))
    if all(c.f + c.b <= 0 for c in per_position):
        return 0.0
    return simulate(schedule, per_position).mean_bubble


def _mean(records: Sequence[ActionRecord]) -> float:
    return sum(r.end - r.start for r in records) / len(records) if records else 0.0
