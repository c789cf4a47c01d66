"""Lowering (insert paired comm), validation and rendezvous simulation of schedules (stdlib only).

[Note: paired order by a witness execution]
A compute-only schedule fixes each rank's order of F/B/W. To add communication we run the
schedule once under its data dependencies (F on stage s after F on s-1, B on s after B on
s+1) with the costs it will run with (``lower(schedule, costs)``; unit costs when none are
given), so the transfers are posted in the order they happen at those costs. That witness
execution gives every transfer a time: the end of the action that produced it. Each
transfer becomes a send on the producer and a recv on the consumer, both keyed
``(time, tier, transfer)``; a compute action is keyed ``(start, tier, compute)``, and at
equal time and tier transfers sort first. The tier only matters for zero costs: an action
of duration 0 ends one tier after it starts, so its sends still sort after it and its
consumers after them (with positive costs every tier is 0).
Every rank's program is its events sorted by key, and comm events with no compute between
them are posted as one batch. Because both ends of a link sort the same keys, both post the
link's ops in the same sequence (paired order), and a recv always precedes its consumer,
a send always follows its producer. The result is then *checked*, not trusted: the validator
re-derives the pairing and runs the rendezvous simulator, in which a batch completes only
when the peer has posted every partner op (NCCL-like blocking, the strictest semantics; any
runtime that posts earlier or waits later cannot deadlock where this one does not).

Worked example, 1F1B with pp=2, m=2 (rank 1 is the last stage)::

    rank 0 | F0 sendF0>1 F1 sendF1>1 recvB0<1 B0 recvB1<1 B1
    rank 1 | recvF0<0 F0 B0 sendB0>0+recvF1<0 F1 B1 sendB1>0

On link (0, 1) both ranks post F0, F1, B0, B1 in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from math import lcm
from typing import Sequence
from .actions import Action, Kind, Schedule, ScheduleError, Step, format_grid

__all__ = [
    "Costs", "SimResult", "DeadlockError", "lower", "validate", "simulate", "render_timeline",
]


class DeadlockError(ScheduleError):
    """The schedule cannot finish; ``cycle`` lists the ranks that wait on each other."""

    def __init__(self, message: str, cycle: list[int]) -> None:
        super().__init__(message)
        self.cycle = cycle


@dataclass(frozen=True)
class Costs:
    """Per-action durations for one microbatch through one chunk (same time unit throughout).

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
        """Costs of one of ``chunks`` equal chunks when these are costs of a rank's whole share."""
        return Costs(self.f / chunks, self.b / chunks, self.w / chunks, self.comm)


@dataclass
class SimResult:
    """What the rendezvous simulator measured. Bubbles are idle fractions of the makespan."""

    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    intervals: list[list[tuple[float, float, Step]]] = field(default_factory=list)

    @property
    def bubble(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.busy)


# --------------------------------------------------------------------------- dependencies


def _fail(schedule: Schedule, rank: int, index: int, reason: str) -> ScheduleError:
    step = "+".join(str(a) for a in schedule.programs[rank][index])
    return ScheduleError(f"rank {rank}, step {index} ({step}): {reason}\n"
                         + format_grid(schedule, [(rank, index)]))


def _check_compute(schedule: Schedule) -> None:
    """Completeness and same-rank order of F/B/W; comm steps are ignored here."""
    if len(schedule.programs) != schedule.pp:
        raise ScheduleError(f"schedule has {len(schedule.programs)} rank programs for pp={schedule.pp}")
    split = schedule.split_backward
    for r, prog in enumerate(schedule.programs):
        done: dict[tuple[Kind, int, int], int] = {}
        for i, step in enumerate(prog):
            if any(a.kind.is_compute for a in step) and len(step) != 1:
                raise _fail(schedule, r, i, "a compute action must be a step of its own")
            a = step[0]
            if not a.kind.is_compute:
                continue
            if not 0 <= a.chunk < schedule.chunks:
                raise _fail(schedule, r, i, f"chunk {a.chunk} is outside 0..{schedule.chunks - 1}")
            if not 0 <= a.microbatch < schedule.microbatches:
                raise _fail(schedule, r, i,
                            f"microbatch {a.microbatch} is outside 0..{schedule.microbatches - 1}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in done:
                raise _fail(schedule, r, i, f"{a} already ran at step {done[key]}")
            if schedule.forward_only and a.kind is not Kind.F:
                raise _fail(schedule, r, i, "a forward-only schedule has no backward actions")
            need = {Kind.B: Kind.F, Kind.W: Kind.B}.get(a.kind)
            if need is not None and (need, a.microbatch, a.chunk) not in done:
                raise _fail(schedule, r, i, f"{a} runs before {Action(need, a.microbatch, a.chunk)} "
                                            f"on this rank ({a.kind.value} needs {need.value} first)")
            done[key] = i
        kinds = [Kind.F] + ([] if schedule.forward_only else [Kind.B]) + ([Kind.W] if split else [])
        for kind in kinds:
            for c in range(schedule.chunks):
                for mb in range(schedule.microbatches):
                    if (kind, mb, c) not in done:
                        missing = Action(kind, mb, c)
                        raise ScheduleError(f"rank {r} never runs {missing} (every microbatch needs "
                                            f"{'/'.join(k.value for k in kinds)} once on every stage)\n"
                                            + format_grid(schedule, [(r, len(prog) - 1)] if prog else []))


def _dependency(schedule: Schedule, rank: int, a: Action) -> tuple[int, Action] | None:
    """The cross-stage action ``a`` waits for, as (rank, action), or None."""
    s = schedule.stage(rank, a.chunk)
    if a.kind is Kind.F and s > 0:
        q, c = schedule.placement(s - 1)
        return q, Action(Kind.F, a.microbatch, c)
    if a.kind is Kind.B and s < schedule.num_stages - 1:
        q, c = schedule.placement(s + 1)
        return q, Action(Kind.B, a.microbatch, c)
    return None


def _witness_times(schedule: Schedule, costs: Costs | Sequence[Costs] | None = None
                   ) -> list[list[tuple[tuple[int, int], tuple[int, int]]]]:
    """(start, end) stamps of every compute action under data dependencies with ``costs``.

    ``costs`` is one Costs for all ranks or one per rank, as for :func:`simulate`; None means
    unit costs (F=1, B=2, W=1, or B=1 when backward is split). ``comm`` is not modelled: a
    consumer may start when its producer ends (adding comm delays here, with no model of each
    rank's in-order comm queue, gave worse orders in simulation than leaving them out).

    Time is counted exactly, in integer ticks: each duration, relative to the largest one, is
    taken as the nearest fraction with denominator <= 10**6 (1/3 for 0.333..., 1/10 for 0.1),
    so costs that tie on paper tie here (0.1 + 0.2 == 0.3, three F's of 1/3 == one of 1) and
    float rounding never decides the order. A stamp is ``(tick, tier)``, compared
    lexicographically: the tier orders zero-duration actions at the same tick (an action of
    duration 0 ends at ``(start tick, start tier + 1)``, one of positive duration at tier 0),
    so with zero costs an action's end still sorts after its start and after everything it
    waited for. With positive costs every tier is 0.
    """
    split = schedule.split_backward
    acts = [schedule.compute_actions(r) for r in range(schedule.pp)]
    kinds = (Kind.F, Kind.B, Kind.W)
    rank_costs = _per_rank(Costs() if costs is None else costs, schedule.pp)
    durations = [[c.of(k, split) for k in kinds] for c in rank_costs]
    unit = max([d for row in durations for d in row if d > 0], default=1.0)
    exact = [[Fraction(d / unit).limit_denominator(10**6) for d in row] for row in durations]
    per_tick = lcm(*(x.denominator for row in exact for x in row))
    ticks = [{k: int(x * per_tick) for k, x in zip(kinds, row)} for row in exact]
    end_of: dict[tuple[int, Action], tuple[int, int]] = {}
    times: list[list[tuple[tuple[int, int], tuple[int, int]]]] = [[] for _ in acts]
    clock: list[tuple[int, int]] = [(0, 0)] * schedule.pp
    pc = [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for r in range(schedule.pp):
            while pc[r] < len(acts[r]):
                a = acts[r][pc[r]]
                dep = _dependency(schedule, r, a)
                if dep is not None and dep not in end_of:
                    break
                start = max(clock[r], end_of[dep]) if dep is not None else clock[r]
                d = ticks[r][a.kind]
                end = (start[0] + d, 0) if d > 0 else (start[0], start[1] + 1)
                end_of[(r, a)] = end
                times[r].append((start, end))
                clock[r] = end
                pc[r] += 1
                progress = True
    if any(pc[r] < len(acts[r]) for r in range(schedule.pp)):
        waits: dict[int, tuple[int, str]] = {}
        for r in range(schedule.pp):
            if pc[r] < len(acts[r]):
                a = acts[r][pc[r]]
                dep = _dependency(schedule, r, a)
                assert dep is not None
                waits[r] = (dep[0], f"rank {r} waits at {a} for {dep[1]} on rank {dep[0]}")
        _raise_cycle(schedule, waits, {r: _step_index(schedule, r, acts[r][pc[r]]) for r in waits})
    return times


def _step_index(schedule: Schedule, rank: int, action: Action) -> int:
    for i, step in enumerate(schedule.programs[rank]):
        if action in step:
            return i
    raise AssertionError(f"{action} not on rank {rank}")


def _raise_cycle(schedule: Schedule, waits: dict[int, tuple[int, str]], at: dict[int, int]) -> None:
    """Raise DeadlockError naming the cycle of ranks in the wait-for graph ``waits``."""
    start = min(waits)
    seen: list[int] = []
    r = start
    while r in waits and r not in seen:
        seen.append(r)
        r = waits[r][0]
    if r in seen:
        cycle = seen[seen.index(r):]
        head = "deadlock: " + " -> ".join(str(x) for x in cycle + [cycle[0]])
    else:
        cycle = seen
        head = f"deadlock: rank {r} has finished, so rank {seen[-1]} can never go on"
    lines = [waits[x][1] for x in cycle]
    raise DeadlockError(head + "\n  " + "\n  ".join(lines) + "\n"
                        + format_grid(schedule, [(x, at[x]) for x in cycle if x in at]), cycle)


# --------------------------------------------------------------------------- lowering


def _transfers(schedule: Schedule, rank: int, a: Action) -> list[tuple[Action, int, Action]]:
    """Comm a compute action causes: [(send on rank, peer, matching recv on peer)]."""
    s = schedule.stage(rank, a.chunk)
    if a.kind is Kind.F and s < schedule.num_stages - 1:
        q, c = schedule.placement(s + 1)
        if q != rank:
            return [(Action(Kind.SEND_F, a.microbatch, a.chunk, q), q, Action(Kind.RECV_F, a.microbatch, c, rank))]
    if a.kind is Kind.B and s > 0:
        q, c = schedule.placement(s - 1)
        if q != rank:
            return [(Action(Kind.SEND_B, a.microbatch, a.chunk, q), q, Action(Kind.RECV_B, a.microbatch, c, rank))]
    return []


def lower(schedule: Schedule, costs: Costs | Sequence[Costs] | None = None) -> Schedule:
    """Insert paired, batched send/recv steps into a compute-only schedule (see the module note).

    The order comes from a witness execution with ``costs`` (one Costs for all ranks or one per
    rank, as for :func:`simulate`); None means unit costs. Lower with the costs you will run
    with: the order of transfers, and so the makespan, depends on them.
    """
    if schedule.lowered:
        return schedule
    _check_compute(schedule)
    times = _witness_times(schedule, costs)
    events: list[list[tuple[tuple[int, int, int, int, int, int], Action]]] = [[] for _ in range(schedule.pp)]
    for r in range(schedule.pp):
        for a, (start, end) in zip(schedule.compute_actions(r), times[r]):
            events[r].append(((*start, 1, 0, 0, 0), a))
            for send, q, recv in _transfers(schedule, r, a):
                key = (*end, 0, int(a.kind is Kind.B), schedule.stage(r, a.chunk), a.microbatch)
                events[r].append((key, send))
                events[q].append((key, recv))
    programs: list[list[Step]] = []
    for evs in events:
        evs.sort(key=lambda e: e[0])
        prog: list[Step] = []
        batch: list[Action] = []
        for _, a in evs:
            if a.kind.is_compute:
                if batch:
                    prog.append(tuple(batch))
                    batch = []
                prog.append((a,))
            else:
                batch.append(a)
        if batch:
            prog.append(tuple(batch))
        programs.append(prog)
    return Schedule(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks,
                    _add_headers(schedule, programs), lowered=True, forward_only=schedule.forward_only)


def _add_headers(schedule: Schedule, programs: list[list[Step]]) -> list[list[Step]]:
    """Put each forward stream's header right before its first payload, on both ends of the link.

    A batch holding that payload is split there: ``[ops before it] [header] [it, the rest]``, so
    on every link the header directly precedes the payload in both ranks' sequences and the
    paired order is kept. The validator then proves the result like any other program.
    """
    out: list[list[Step]] = []
    for r, prog in enumerate(programs):
        started: set[tuple[Kind, int]] = set()
        new: list[Step] = []
        for step in prog:
            rest = list(step)
            for j, a in enumerate(step):
                if a.kind not in (Kind.SEND_F, Kind.RECV_F):
                    continue
                stream = (a.kind, _transfer_id(schedule, r, a)[2])
                if stream in started:
                    continue
                started.add(stream)
                k = rest.index(a)
                if k:
                    new.append(tuple(rest[:k]))
                new.append((Action(Kind.SEND_H if a.kind is Kind.SEND_F else Kind.RECV_H, a.microbatch, a.chunk,
                                   a.peer),))
                rest = rest[k:]
            new.append(tuple(rest))
        out.append(new)
    return out


# --------------------------------------------------------------------------- validation


def _transfer_id(schedule: Schedule, rank: int, a: Action) -> tuple[str, int, int]:
    """Identity of the transfer a comm action takes part in: (direction, microbatch, producer stage)."""
    s = schedule.stage(rank, a.chunk)
    producer = {Kind.SEND_F: s, Kind.RECV_F: s - 1, Kind.SEND_B: s, Kind.RECV_B: s + 1,
                Kind.SEND_H: s, Kind.RECV_H: s - 1}[a.kind]
    direction = {Kind.SEND_F: "F", Kind.RECV_F: "F", Kind.SEND_H: "H", Kind.RECV_H: "H"}.get(a.kind, "B")
    return (direction, a.microbatch, producer)


def _partner(schedule: Schedule, rank: int, a: Action) -> Action:
    s = schedule.stage(rank, a.chunk)
    other = {Kind.SEND_F: s + 1, Kind.RECV_F: s - 1, Kind.SEND_B: s - 1, Kind.RECV_B: s + 1,
             Kind.SEND_H: s + 1, Kind.RECV_H: s - 1}[a.kind]
    _, c = schedule.placement(other)
    kind = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F, Kind.SEND_B: Kind.RECV_B,
            Kind.RECV_B: Kind.SEND_B, Kind.SEND_H: Kind.RECV_H, Kind.RECV_H: Kind.SEND_H}[a.kind]
    return Action(kind, a.microbatch, c, rank)


def _check_comm(schedule: Schedule) -> None:
    """Each needed transfer is sent after its producer and received before its consumer, once."""
    for r, prog in enumerate(schedule.programs):
        needed: dict[Action, str] = {}
        inputs: dict[Action, Action] = {}  # consumer compute -> the recv it needs
        for a in schedule.compute_actions(r):
            for send, q, _ in _transfers(schedule, r, a):
                needed[send] = f"after {a}"
        for q in range(schedule.pp):
            for a in schedule.compute_actions(q):
                for _, peer, recv in _transfers(schedule, q, a):
                    if peer == r:
                        consumer = Action(Kind.F if recv.kind is Kind.RECV_F else Kind.B, recv.microbatch, recv.chunk)
                        needed[recv] = f"before {consumer}"
                        inputs[consumer] = recv
        seen: set[Action] = set()
        ran: set[Action] = set()
        _check_headers(schedule, r, prog)
        for i, step in enumerate(prog):
            for a in step:
                if a.kind in (Kind.SEND_H, Kind.RECV_H):
                    continue
                if a.kind.is_compute:
                    rv = inputs.get(a)
                    if rv is not None and rv not in seen:
                        raise _fail(schedule, r, i, f"{a} runs before its input arrives ({rv} is "
                                                    f"missing or comes later)")
                    ran.add(a)
                    continue
                if not 0 <= a.peer < schedule.pp or a.peer == r:
                    raise _fail(schedule, r, i, f"{a} names peer {a.peer}; peers are other ranks 0..{schedule.pp - 1}")
                if a not in needed:
                    raise _fail(schedule, r, i, f"{a} is not a transfer this schedule needs (wrong peer, "
                                                f"chunk or direction?)")
                if a in seen:
                    raise _fail(schedule, r, i, f"{a} is posted twice")
                if a.kind.is_send:
                    producer = Action(Kind.F if a.kind is Kind.SEND_F else Kind.B, a.microbatch, a.chunk)
                    if producer not in ran:
                        raise _fail(schedule, r, i, f"{a} is posted before {producer} produced it")
                seen.add(a)
        for a, why in needed.items():
            if a not in seen:
                raise ScheduleError(f"rank {r} never posts {a} (needed {why})\n" + format_grid(schedule))


def _check_headers(schedule: Schedule, rank: int, prog: list[Step]) -> None:
    """One header per forward stream, in a step of its own before the stream's first payload.

    The receiver must know a stream's shapes before it posts a payload receive, so its header
    step completes first (see [Note: the wire is the program] in p2p.py).
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
            stream = (payload, _transfer_id(schedule, rank, a)[2])
            if a.kind in (Kind.SEND_H, Kind.RECV_H):
                if len(step) != 1:
                    raise _fail(schedule, rank, i, f"header {a} must be a step of its own (the receiver "
                                                   f"completes it before it posts the payload)")
                if stream in header_at:
                    raise _fail(schedule, rank, i, f"{a} is the second header of its stream (the first is "
                                                   f"{header_at[stream][1]} at step {header_at[stream][0]})")
                if a.kind is Kind.SEND_H and Action(Kind.F, a.microbatch, a.chunk) not in computed:
                    raise _fail(schedule, rank, i, f"{a} is posted before F{a.microbatch} made the shapes it announces")
                header_at[stream] = (i, a)
                continue
            if stream not in header_at:
                h = Action(Kind.SEND_H if a.kind is Kind.SEND_F else Kind.RECV_H, a.microbatch, a.chunk, a.peer)
                raise _fail(schedule, rank, i, f"{a} has no header before it: the first transfer of a stream "
                                               f"needs {h} in a step of its own before it")
            h = header_at[stream][1]
            if stream not in started and (h.microbatch, h.chunk) != (a.microbatch, a.chunk):
                raise _fail(schedule, rank, i, f"header {h} is for microbatch {h.microbatch} but the stream's "
                                               f"first payload is {a}")
            started.add(stream)


def _check_pairing(schedule: Schedule) -> None:
    """On every link both ranks post the same transfers in the same order."""
    links: dict[tuple[int, int], dict[int, list[tuple[tuple[str, int, int], int, Action]]]] = {}
    for r, prog in enumerate(schedule.programs):
        for i, step in enumerate(prog):
            for a in step:
                if not a.kind.is_compute:
                    link = (min(r, a.peer), max(r, a.peer))
                    links.setdefault(link, {}).setdefault(r, []).append((_transfer_id(schedule, r, a), i, a))
    for (lo, hi), sides in sorted(links.items()):
        a_side, b_side = sides.get(lo, []), sides.get(hi, [])
        for k in range(max(len(a_side), len(b_side))):
            x = a_side[k] if k < len(a_side) else None
            y = b_side[k] if k < len(b_side) else None
            if x is None or y is None or x[0] != y[0]:
                def show(side: list[tuple[tuple[str, int, int], int, Action]]) -> str:
                    return " ".join(f"[{e[2]}]" if j == k else str(e[2]) for j, e in enumerate(side))
                marks = [(rk, e[1]) for rk, e in ((lo, x), (hi, y)) if e is not None]
                raise ScheduleError(
                    f"link ({lo}, {hi}) is not in paired order: op {k} is "
                    f"{x[2] if x else 'nothing'} on rank {lo} but {y[2] if y else 'nothing'} on rank {hi} "
                    f"(both ranks must post a link's transfers in the same sequence)\n"
                    f"  rank {lo} on this link: {show(a_side)}\n  rank {hi} on this link: {show(b_side)}\n"
                    + format_grid(schedule, marks))


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (or DeadlockError) unless the schedule is complete, ordered, paired and finishes.

    A compute-only schedule is checked for completeness, same-rank order and that its data
    dependencies can be met; a lowered one is also checked for comm placement, paired order
    and, by rendezvous simulation, freedom from deadlock.
    """
    _check_compute(schedule)
    if not schedule.lowered:
        _witness_times(schedule)
        return
    _check_comm(schedule)
    _check_pairing(schedule)
    _simulate_rendezvous(schedule, Costs(1.0, 1.0, 1.0, 0.0))


# --------------------------------------------------------------------------- simulation


def _in_flight_peaks(schedule: Schedule) -> list[int]:
    """Peak count of (microbatch, chunk) activations held: from F until B (or W when split)."""
    if schedule.forward_only:
        return [0] * schedule.pp
    release = Kind.W if schedule.split_backward else Kind.B
    peaks = []
    for r in range(schedule.pp):
        held = peak = 0
        for a in schedule.compute_actions(r):
            held += 1 if a.kind is Kind.F else -1 if a.kind is release else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _per_rank(costs: Costs | Sequence[Costs], pp: int) -> list[Costs]:
    if isinstance(costs, Costs):
        return [costs] * pp
    if len(costs) != pp:
        raise ValueError(f"got {len(costs)} per-rank costs for pp={pp}; give one Costs or one per rank")
    return list(costs)


def _simulate_rendezvous(schedule: Schedule, costs: Costs | Sequence[Costs]) -> SimResult:
    """Blocking semantics: a rank stops at each comm batch until its peers posted every partner op."""
    rank_costs = _per_rank(costs, schedule.pp)
    split = schedule.split_backward
    progs = schedule.programs
    where: list[dict[Action, int]] = [{a: i for i, step in enumerate(p) for a in step} for p in progs]
    pc = [0] * schedule.pp
    clock = [0.0] * schedule.pp
    posted: list[float | None] = [None] * schedule.pp
    matched: dict[tuple[int, Action], float] = {}
    busy = [0.0] * schedule.pp
    intervals: list[list[tuple[float, float, Step]]] = [[] for _ in progs]
    progress = True
    while progress:
        progress = False
        for r in range(schedule.pp):
            while pc[r] < len(progs[r]):
                step = progs[r][pc[r]]
                if step[0].kind.is_compute:
                    d = rank_costs[r].of(step[0].kind, split)
                    intervals[r].append((clock[r], clock[r] + d, step))
                    clock[r] += d
                    busy[r] += d
                    pc[r] += 1
                    progress = True
                    continue
                if posted[r] is None:
                    posted[r] = clock[r]
                    progress = True
                for a in step:
                    if (r, a) in matched:
                        continue
                    q = a.peer
                    partner = _partner(schedule, r, a)
                    post_q = posted[q]
                    if post_q is not None and where[q].get(partner) == pc[q]:
                        post_r = posted[r]
                        assert post_r is not None
                        t = max(post_r, post_q) + rank_costs[r].comm
                        matched[(r, a)] = matched[(q, partner)] = t
                if all((r, a) in matched for a in step):
                    start = posted[r]
                    assert start is not None
                    end = max([clock[r]] + [matched[(r, a)] for a in step])
                    intervals[r].append((start, end, step))
                    clock[r] = end
                    posted[r] = None
                    pc[r] += 1
                    progress = True
                else:
                    break
    if any(pc[r] < len(progs[r]) for r in range(schedule.pp)):
        waits: dict[int, tuple[int, str]] = {}
        for r in range(schedule.pp):
            if pc[r] < len(progs[r]):
                step = progs[r][pc[r]]
                a = next(a for a in step if (r, a) not in matched)
                waits[r] = (a.peer, f"rank {r} blocked at step {pc[r]} ({'+'.join(map(str, step))}) "
                                    f"waiting for rank {a.peer} to post {_partner(schedule, r, a)}")
        _raise_cycle(schedule, waits, {r: pc[r] for r in waits})
    return SimResult(max(clock, default=0.0), busy, _in_flight_peaks(schedule), intervals)


def simulate(schedule: Schedule, costs: Costs | Sequence[Costs], mode: str = "async") -> SimResult:
    """Execute a schedule with per-action ``costs`` (one for all ranks, or one per rank); raise
    DeadlockError naming the cycle if stuck.

    ``mode="async"`` is how the engine runs: posting a comm batch never blocks compute; each
    rank's batches go through one in-order comm queue (like an NCCL stream), a batch starts when
    it is at the head of its queue and completes when every partner batch has started too
    (plus ``costs.comm``); a compute waits only for the batch that carries its input.
    ``mode="rendezvous"`` is the strictest semantics (every batch blocks its rank until matched):
    :func:`validate` proves freedom from deadlock under it.
    """
    if not schedule.lowered:
        schedule = lower(schedule, costs)
    if mode == "rendezvous":
        return _simulate_rendezvous(schedule, costs)
    if mode != "async":
        raise ValueError(f"mode must be 'async' or 'rendezvous' (got {mode!r})")
    split = schedule.split_backward
    progs = schedule.programs
    n = schedule.pp
    rank_costs = _per_rank(costs, n)
    where: list[dict[Action, int]] = [{a: i for i, step in enumerate(p) for a in step} for p in progs]
    needs: list[dict[int, int]] = [{} for _ in progs]  # compute step index -> step index of its recv
    for r, prog in enumerate(progs):
        for i, step in enumerate(prog):
            for a in step:
                if a.kind in (Kind.RECV_F, Kind.RECV_B):
                    consumer = Action(Kind.F if a.kind is Kind.RECV_F else Kind.B, a.microbatch, a.chunk)
                    needs[r][where[r][consumer]] = i
    comm_steps = [[i for i, st in enumerate(p) if not st[0].kind.is_compute] for p in progs]
    pc = [0] * n
    clock = [0.0] * n
    posted: list[dict[int, float]] = [{} for _ in progs]   # comm step -> post time
    head = [0] * n                                          # index into comm_steps[r]
    head_free = [0.0] * n                                   # when the previous batch completed
    done: list[dict[int, float]] = [{} for _ in progs]     # comm step -> completion time
    matched: dict[tuple[int, Action], float] = {}
    busy = [0.0] * n
    intervals: list[list[tuple[float, float, Step]]] = [[] for _ in progs]

    def head_start(r: int) -> float | None:
        if head[r] >= len(comm_steps[r]) or comm_steps[r][head[r]] not in posted[r]:
            return None
        return max(posted[r][comm_steps[r][head[r]]], head_free[r])

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(progs[r]):           # compute side: post batches, run computes
                step = progs[r][pc[r]]
                if not step[0].kind.is_compute:
                    posted[r][pc[r]] = clock[r]
                    pc[r] += 1
                    progress = True
                    continue
                ready = clock[r]
                if pc[r] in needs[r]:
                    if needs[r][pc[r]] not in done[r]:
                        break
                    ready = max(ready, done[r][needs[r][pc[r]]])
                d = rank_costs[r].of(step[0].kind, split)
                intervals[r].append((ready, ready + d, step))
                clock[r] = ready + d
                busy[r] += d
                pc[r] += 1
                progress = True
            while (start := head_start(r)) is not None:  # comm side: the head batch of the queue
                idx = comm_steps[r][head[r]]
                for a in progs[r][idx]:
                    if (r, a) in matched:
                        continue
                    q, partner = a.peer, _partner(schedule, r, a)
                    start_q = head_start(q)
                    if start_q is not None and comm_steps[q][head[q]] == where[q].get(partner):
                        matched[(r, a)] = matched[(q, partner)] = max(start, start_q) + rank_costs[r].comm
                if not all((r, a) in matched for a in progs[r][idx]):
                    break
                end = max([start] + [matched[(r, a)] for a in progs[r][idx]])
                intervals[r].append((start, end, progs[r][idx]))
                done[r][idx] = head_free[r] = end
                head[r] += 1
                progress = True
    if any(pc[r] < len(progs[r]) or head[r] < len(comm_steps[r]) for r in range(n)):
        waits: dict[int, tuple[int, str]] = {}
        at: dict[int, int] = {}
        for r in range(n):
            if head[r] < len(comm_steps[r]) and head_start(r) is not None:
                idx = comm_steps[r][head[r]]
                a = next(a for a in progs[r][idx] if (r, a) not in matched)
                waits[r] = (a.peer, f"rank {r}'s comm queue is stuck at step {idx} "
                                    f"({'+'.join(map(str, progs[r][idx]))}) waiting for rank {a.peer} "
                                    f"to post {_partner(schedule, r, a)}")
                at[r] = idx
            elif pc[r] < len(progs[r]):
                waits[r] = (r, f"rank {r} waits at step {pc[r]} for its own receive")
                at[r] = pc[r]
        _raise_cycle(schedule, waits, at)
    makespan = max([0.0] + [e for row in intervals for _, e, _ in row])
    return SimResult(makespan, busy, _in_flight_peaks(schedule), intervals)


# --------------------------------------------------------------------------- timeline


def render_timeline(result: SimResult, max_width: int = 200) -> str:
    """ASCII timeline: one row per rank, each compute action a box as wide as its duration."""
    spans = [e - s for row in result.intervals for s, e, st in row if st[0].kind.is_compute and e > s]
    if not spans or result.makespan <= 0:
        return "(empty schedule)"
    labels = [str(st[0]) for row in result.intervals for _, _, st in row if st[0].kind.is_compute]
    cell = max(len(x) for x in labels) + 1
    scale = cell / min(spans)
    if result.makespan * scale > max_width:
        scale = max_width / result.makespan
    width = int(round(result.makespan * scale))
    lines = []
    for r, row in enumerate(result.intervals):
        line = ["."] * width
        for s, e, st in row:
            a = st[0]
            if not a.kind.is_compute or e <= s:
                continue
            lo, hi = int(round(s * scale)), max(int(round(e * scale)), int(round(s * scale)) + 1)
            text = str(a) if hi - lo > len(str(a)) else a.kind.value
            box = (text + " " * (hi - lo))[: hi - lo]
            line[lo:hi] = list(box)
        lines.append(f"rank {r:<2}|" + "".join(line) + "|")
    return "\n".join(lines)
