"""The validator: a schedule is complete, ordered, paired on every link and finishes under rendezvous semantics."""

from __future__ import annotations

from .actions import Action, Kind, Schedule, ScheduleError, Step, format_grid
from .costs import Costs
from .dataflow import check_compute, fail, transfer_id, transfers
from .lower import witness_times
from .simulate import simulate

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (or DeadlockError) unless the schedule is complete, ordered, paired and finishes.

    A compute-only schedule is checked for completeness, same-position order and that its data
    dependencies can be met; a lowered one is also checked for comm placement, headers, paired
    order and, by rendezvous simulation, freedom from deadlock.
    """
    check_compute(schedule)
    if not schedule.lowered:
        witness_times(schedule)
        return
    needed = _needed(schedule)
    for p, prog in enumerate(schedule.programs):
        _check_headers(schedule, p, prog)
        _check_comm(schedule, p, prog, needed[p])
    _check_pairing(schedule)
    simulate(schedule, Costs(1.0, 1.0, 1.0, 0.0), mode="rendezvous")


def _needed(schedule: Schedule) -> list[dict[Action, tuple[str, Action]]]:
    """Per position, every comm action the schedule needs there: ("after" its producer | "before" its
    consumer, that compute action)."""
    needed: list[dict[Action, tuple[str, Action]]] = [{} for _ in range(schedule.pp)]
    for p in range(schedule.pp):
        for a in schedule.compute_actions(p):
            for send, q, recv in transfers(schedule, p, a):
                needed[p][send] = ("after", a)
                needed[q][recv] = ("before", Action(Kind.F if recv.kind is Kind.RECV_F else Kind.B,
                                                    recv.microbatch, recv.chunk))
    return needed


def _check_comm(schedule: Schedule, p: int, prog: list[Step], needed: dict[Action, tuple[str, Action]]) -> None:
    """Each needed transfer is sent after its producer and received before its consumer, once."""
    inputs = {consumer: recv for recv, (when, consumer) in needed.items() if when == "before"}
    seen: set[Action] = set()
    ran: set[Action] = set()
    for i, step in enumerate(prog):
        for a in step:
            if a.kind in (Kind.SEND_H, Kind.RECV_H):
                continue
            if a.kind.is_compute:
                rv = inputs.get(a)
                if rv is not None and rv not in seen:
                    raise fail(schedule, p, i, f"{a} runs before its input arrives ({rv} is missing or comes later)")
                ran.add(a)
                continue
            if not 0 <= a.peer < schedule.pp or a.peer == p:
                raise fail(schedule, p, i, f"{a} names peer {a.peer}; peers are other positions 0..{schedule.pp - 1}")
            if a not in needed:
                raise fail(schedule, p, i, f"{a} is not a transfer this schedule needs (wrong peer, chunk or "
                                           f"direction?)")
            if a in seen:
                raise fail(schedule, p, i, f"{a} is posted twice")
            if a.kind.is_send and needed[a][1] not in ran:
                raise fail(schedule, p, i, f"{a} is posted before {needed[a][1]} produced it")
            seen.add(a)
    for a, (when, compute) in needed.items():
        if a not in seen:
            raise ScheduleError(f"position {p} never posts {a} (needed {when} {compute})\n" + format_grid(schedule))


def _check_headers(schedule: Schedule, p: int, prog: list[Step]) -> None:
    """One header per forward stream, in a step of its own before the stream's first payload.

    The receiver must know a stream's shapes before it posts a payload receive, so its header
    step completes first (see [Note: the wire is the program] in runtime/wire.py).
    """
    header_at: dict[tuple[Kind, int], tuple[int, Action]] = {}   # (sendF|recvF, producer stage) -> header
    computed: set[Action] = set()
    started: set[tuple[Kind, int]] = set()
    for i, step in enumerate(prog):
        for a in step:
            if a.kind.is_compute:
                computed.add(a)
            if a.kind not in (Kind.SEND_H, Kind.RECV_H, Kind.SEND_F, Kind.RECV_F):
                continue
            payload = Kind.SEND_F if a.kind in (Kind.SEND_F, Kind.SEND_H) else Kind.RECV_F
            stream = (payload, transfer_id(schedule, p, a)[2])
            if a.kind in (Kind.SEND_H, Kind.RECV_H):
                if len(step) != 1:
                    raise fail(schedule, p, i, f"header {a} must be a step of its own (the receiver completes it "
                                               f"before it posts the payload)")
                if stream in header_at:
                    raise fail(schedule, p, i, f"{a} is the second header of its stream (the first is "
                                               f"{header_at[stream][1]} at step {header_at[stream][0]})")
                if a.kind is Kind.SEND_H and Action(Kind.F, a.microbatch, a.chunk) not in computed:
                    raise fail(schedule, p, i, f"{a} is posted before F{a.microbatch} made the shapes it announces")
                header_at[stream] = (i, a)
                continue
            if stream not in header_at:
                h = Action(Kind.SEND_H if a.kind is Kind.SEND_F else Kind.RECV_H, a.microbatch, a.chunk, a.peer)
                raise fail(schedule, p, i, f"{a} has no header before it: the first transfer of a stream needs {h} "
                                           f"in a step of its own before it")
            h = header_at[stream][1]
            if stream not in started and (h.microbatch, h.chunk) != (a.microbatch, a.chunk):
                raise fail(schedule, p, i, f"header {h} is for microbatch {h.microbatch} but the stream's first "
                                           f"payload is {a}")
            started.add(stream)


LinkOp = tuple[tuple[str, int, int], int, Action]   # (transfer id, step index, action)


def _check_pairing(schedule: Schedule) -> None:
    """On every link both positions post the same transfers in the same order."""
    links: dict[tuple[int, int], dict[int, list[LinkOp]]] = {}
    for p, prog in enumerate(schedule.programs):
        for i, step in enumerate(prog):
            for a in step:
                if not a.kind.is_compute:
                    link = (min(p, a.peer), max(p, a.peer))
                    links.setdefault(link, {}).setdefault(p, []).append((transfer_id(schedule, p, a), i, a))
    for (lo, hi), sides in sorted(links.items()):
        a_side, b_side = sides.get(lo, []), sides.get(hi, [])
        for k in range(max(len(a_side), len(b_side))):
            x = a_side[k] if k < len(a_side) else None
            y = b_side[k] if k < len(b_side) else None
            if x is None or y is None or x[0] != y[0]:
                def show(side: list[LinkOp]) -> str:
                    return " ".join(f"[{e[2]}]" if j == k else str(e[2]) for j, e in enumerate(side))
                marks = [(q, e[1]) for q, e in ((lo, x), (hi, y)) if e is not None]
                raise ScheduleError(
                    f"link ({lo}, {hi}) is not in paired order: op {k} is {x[2] if x else 'nothing'} at position "
                    f"{lo} but {y[2] if y else 'nothing'} at position {hi} (both positions must post a link's "
                    f"transfers in the same sequence)\n"
                    f"  position {lo} on this link: {show(a_side)}\n  position {hi} on this link: {show(b_side)}\n"
                    + format_grid(schedule, marks))
