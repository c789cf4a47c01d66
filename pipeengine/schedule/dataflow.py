"""What a schedule's actions need from each other: cross-stage dependencies, transfers, and where it is stuck."""

from __future__ import annotations

from .actions import Action, Kind, Schedule, ScheduleError, format_grid

__all__ = ["DeadlockError"]


class DeadlockError(ScheduleError):
    """The schedule cannot finish; ``cycle`` lists the positions that wait on each other."""

    def __init__(self, message: str, cycle: list[int]) -> None:
        super().__init__(message)
        self.cycle = cycle


def fail(schedule: Schedule, position: int, index: int, reason: str) -> ScheduleError:
    """A ScheduleError about step ``index`` of ``position``'s program, with the grid and the step marked."""
    step = "+".join(str(a) for a in schedule.programs[position][index])
    return ScheduleError(f"position {position}, step {index} ({step}): {reason}\n"
                         + format_grid(schedule, [(position, index)]))


def dependency(schedule: Schedule, position: int, a: Action) -> tuple[int, Action] | None:
    """The cross-stage action ``a`` waits for, as (position, action), or None."""
    s = schedule.stage(position, a.chunk)
    if a.kind is Kind.F and s > 0:
        q, c = schedule.placement(s - 1)
        return q, Action(Kind.F, a.microbatch, c)
    if a.kind is Kind.B and s < schedule.num_stages - 1:
        q, c = schedule.placement(s + 1)
        return q, Action(Kind.B, a.microbatch, c)
    return None


def transfers(schedule: Schedule, position: int, a: Action) -> list[tuple[Action, int, Action]]:
    """Comm a compute action causes: [(send at ``position``, peer, the matching recv at the peer)]."""
    s = schedule.stage(position, a.chunk)
    if a.kind is Kind.F and s < schedule.num_stages - 1:
        q, c = schedule.placement(s + 1)
        if q != position:
            return [(Action(Kind.SEND_F, a.microbatch, a.chunk, q), q, Action(Kind.RECV_F, a.microbatch, c, position))]
    if a.kind is Kind.B and s > 0:
        q, c = schedule.placement(s - 1)
        if q != position:
            return [(Action(Kind.SEND_B, a.microbatch, a.chunk, q), q, Action(Kind.RECV_B, a.microbatch, c, position))]
    return []


def transfer_id(schedule: Schedule, position: int, a: Action) -> tuple[str, int, int]:
    """Identity of the transfer a comm action takes part in: (direction, microbatch, producer stage)."""
    s = schedule.stage(position, a.chunk)
    producer = {Kind.SEND_F: s, Kind.RECV_F: s - 1, Kind.SEND_B: s, Kind.RECV_B: s + 1,
                Kind.SEND_H: s, Kind.RECV_H: s - 1}[a.kind]
    direction = {Kind.SEND_F: "F", Kind.RECV_F: "F", Kind.SEND_H: "H", Kind.RECV_H: "H"}.get(a.kind, "B")
    return (direction, a.microbatch, producer)


_PARTNER_KIND = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F, Kind.SEND_B: Kind.RECV_B,
                 Kind.RECV_B: Kind.SEND_B, Kind.SEND_H: Kind.RECV_H, Kind.RECV_H: Kind.SEND_H}


def partner(schedule: Schedule, position: int, a: Action) -> Action:
    """The comm action on the peer that completes ``a``."""
    s = schedule.stage(position, a.chunk)
    other = s + 1 if a.kind in (Kind.SEND_F, Kind.SEND_H, Kind.RECV_B) else s - 1
    _, c = schedule.placement(other)
    return Action(_PARTNER_KIND[a.kind], a.microbatch, c, position)


def step_index(schedule: Schedule, position: int, action: Action) -> int:
    for i, step in enumerate(schedule.programs[position]):
        if action in step:
            return i
    raise AssertionError(f"{action} not at position {position}")


def raise_cycle(schedule: Schedule, waits: dict[int, tuple[int, str]], at: dict[int, int]) -> None:
    """Raise DeadlockError naming the cycle of positions in the wait-for graph ``waits`` (position ->
    (the position it waits on, why)); ``at`` marks each stuck position's step in the grid."""
    start = min(waits)
    seen: list[int] = []
    p = start
    while p in waits and p not in seen:
        seen.append(p)
        p = waits[p][0]
    if p in seen:
        cycle = seen[seen.index(p):]
        head = "deadlock: " + " -> ".join(str(x) for x in cycle + [cycle[0]])
    else:
        cycle = seen
        head = f"deadlock: position {p} has finished, so position {seen[-1]} can never go on"
    lines = [waits[x][1] for x in cycle]
    raise DeadlockError(head + "\n  " + "\n  ".join(lines) + "\n"
                        + format_grid(schedule, [(x, at[x]) for x in cycle if x in at]), cycle)


def check_compute(schedule: Schedule) -> None:
    """Completeness and same-position order of F/B/W (comm steps are ignored here)."""
    if len(schedule.programs) != schedule.pp:
        raise ScheduleError(f"schedule has {len(schedule.programs)} programs for pp={schedule.pp} (one per position)")
    kinds = [Kind.F] + ([] if schedule.forward_only else [Kind.B])   # a W is optional: without it B is the full one
    for p, prog in enumerate(schedule.programs):
        done: dict[tuple[Kind, int, int], int] = {}
        for i, step in enumerate(prog):
            if any(a.kind.is_compute for a in step) and len(step) != 1:
                raise fail(schedule, p, i, "a compute action must be a step of its own")
            if step[0].kind.is_compute:
                _check_action(schedule, p, i, step[0], done)
                done[(step[0].kind, step[0].microbatch, step[0].chunk)] = i
        for kind in kinds:
            for c in range(schedule.chunks):
                for mb in range(schedule.microbatches):
                    if (kind, mb, c) not in done:
                        raise ScheduleError(f"position {p} never runs {Action(kind, mb, c)} (every microbatch needs "
                                            f"{'/'.join(k.value for k in kinds)} once on every stage)\n"
                                            + format_grid(schedule, [(p, len(prog) - 1)] if prog else []))


def _check_action(schedule: Schedule, p: int, i: int, a: Action, done: dict[tuple[Kind, int, int], int]) -> None:
    if not 0 <= a.chunk < schedule.chunks:
        raise fail(schedule, p, i, f"chunk {a.chunk} is outside 0..{schedule.chunks - 1}")
    if not 0 <= a.microbatch < schedule.microbatches:
        raise fail(schedule, p, i, f"microbatch {a.microbatch} is outside 0..{schedule.microbatches - 1}")
    key = (a.kind, a.microbatch, a.chunk)
    if key in done:
        raise fail(schedule, p, i, f"{a} already ran at step {done[key]}")
    if schedule.forward_only and a.kind is not Kind.F:
        raise fail(schedule, p, i, "a forward-only schedule has no backward actions")
    need = {Kind.B: Kind.F, Kind.W: Kind.B}.get(a.kind)
    if need is not None and (need, a.microbatch, a.chunk) not in done:
        raise fail(schedule, p, i, f"{a} runs before {Action(need, a.microbatch, a.chunk)} "
                                   f"at this position ({a.kind.value} needs {need.value} first)")
    dep = dependency(schedule, p, a)
    if dep is not None and dep[0] == p and (dep[1].kind, dep[1].microbatch, dep[1].chunk) not in done:
        raise fail(schedule, p, i, f"{a} runs before {dep[1]}, whose result it takes on this position "
                                   f"(stages {schedule.stage(p, dep[1].chunk)} and {schedule.stage(p, a.chunk)} "
                                   f"are both here)")
