"""Lowering: insert paired, batched send/recv steps into a compute-only schedule.

[Note: paired order by a witness execution]
A compute-only schedule fixes each position's order of F/B/W. To add communication we run the
schedule once under its data dependencies (F on stage s after F on s-1, B on s after B on
s+1) with the costs it will run with (``lower(schedule, costs)``; unit costs when none are
given), so the transfers are posted in the order they happen at those costs. That witness
execution gives every transfer a time: the end of the action that produced it. Each
transfer becomes a send on the producer and a recv on the consumer, both keyed
``(time, tier, transfer)``; a compute action is keyed ``(start, tier, compute)``, and at
equal time and tier transfers sort first. The tier only matters for zero costs: an action
of duration 0 ends one tier after it starts, so its sends still sort after it and its
consumers after them (with positive costs every tier is 0).
Every position's program is its events sorted by key, and comm events with no compute between
them are posted as one batch. Because both ends of a link sort the same keys, both post the
link's ops in the same sequence (paired order), and a recv always precedes its consumer,
a send always follows its producer. The result is then *checked*, not trusted: the validator
(verify.py) re-derives the pairing and runs the rendezvous simulator, in which a batch completes
only when the peer has posted every partner op (NCCL-like blocking, the strictest semantics; any
runtime that posts earlier or waits later cannot deadlock where this one does not).

Worked example, 1F1B with pp=2, m=2 (position 1 is the last stage)::

    position 0 | F0 sendF0>1 F1 sendF1>1 recvB0<1 B0 recvB1<1 B1
    position 1 | recvF0<0 F0 B0 sendB0>0+recvF1<0 F1 B1 sendB1>0

On link (0, 1) both positions post F0, F1, B0, B1 in that order.

[Note: batches by time]
A batch completes as a whole on NCCL (grouped ops), so a batch that joins a transfer due early with one
due late holds the early one back, and on a position's one in-order stream everything queued behind it.
In dualpipev a full B's gradient would share a batch with a forward input the same peer sends much
later. ``lower(..., by_time=True)`` cuts batches where the witness time changes: a batch holds only
transfers made at one time. Of the transfers of one time, a position posts first those whose peer is free
then (in the witness) and last those whose peer is still computing (its receive is posted only when that
compute ends), each group a batch of its own: a gradient position 3 sends at once is not queued behind an
output position 1 takes only later. The tie-break depends on the time and the peer alone, so both ends
still post each link's ops in the same order (the pairing holds); the validator proves it again.
``shortest_lowering`` (builders.py, for ``compile_schedule`` and auto) lowers both ways and keeps the
shorter in simulation (ties: the usual batches, fewer steps): dualpipev pp 4 m 8 takes 25.5 instead of 27.5
with unit costs (26.5 with one batch per time and no tie-break), its data-dependency bound, as at pp 4
m 16 / 32 and pp 8 m 16 / 32; 1F1B, ZB and ZBV are unchanged. On Gloo the extra steps cost nothing
because a comm step right after another does not first wait for the earlier sends (``Wire.settle``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace
from fractions import Fraction
from math import lcm
from typing import Sequence

from .actions import Action, Kind, Schedule, Step
from .costs import Costs, per_stage
from .dataflow import check_compute, dependency, raise_cycle, step_index, transfer_id, transfers

__all__ = ["lower", "witness_times"]

Stamp = tuple[int, int]   # (tick, tier), compared lexicographically


def _ticks(schedule: Schedule, costs: Costs | Sequence[Costs] | None) -> list[list[dict[Kind | None, int]]]:
    """Each stage's durations in exact integer ticks, as ``[position][chunk]``: F, B and W of a split backward,
    under the key None a full backward's B (b + w), under SEND_F its transfer to the next stage (see
    :func:`witness_times`)."""
    kinds: tuple[Kind | None, ...] = (Kind.F, Kind.B, Kind.W, None, Kind.SEND_F)
    table = per_stage(Costs() if costs is None else costs, schedule)
    durations = [[[c.f, c.b, c.w, c.of(Kind.B, split=False), c.comm] for c in row] for row in table]
    unit = max([d for row in durations for st in row for d in st if d > 0], default=1.0)
    exact = [[[Fraction(d / unit).limit_denominator(10**6) for d in st] for st in row] for row in durations]
    per_tick = lcm(*(x.denominator for row in exact for st in row for x in st))
    return [[{k: int(x * per_tick) for k, x in zip(kinds, st)} for st in row] for row in exact]


def witness_times(schedule: Schedule, costs: Costs | Sequence[Costs] | None = None,
                  with_comm: bool = False) -> list[list[tuple[Stamp, Stamp]]]:
    """(start, end) stamps of every compute action under data dependencies with ``costs``.

    ``costs`` is one Costs for all stages, one per position or one per stage, as for ``simulate``; None means
    unit costs (F = B = W = 1; the B of a full backward, one without its W, takes 2). ``comm`` is modelled only
    ``with_comm`` (a consumer on another position starts a transfer after its producer ends); else a consumer
    may start when its producer ends (without a model of each position's in-order comm queue, the delays alone
    give worse orders in simulation as often as better: ``shortest_lowering`` tries both).

    Time is counted exactly, in integer ticks: each duration, relative to the largest one, is
    taken as the nearest fraction with denominator <= 10**6 (1/3 for 0.333..., 1/10 for 0.1),
    so costs that tie on paper tie here (0.1 + 0.2 == 0.3, three F's of 1/3 == one of 1) and
    float rounding never decides the order. A stamp is ``(tick, tier)``: the tier orders
    zero-duration actions at the same tick (an action of duration 0 ends at ``(start tick,
    start tier + 1)``, one of positive duration at tier 0), so with zero costs an action's end
    still sorts after its start and after everything it waited for. A dependency cycle raises
    DeadlockError naming it.
    """
    acts = [schedule.compute_actions(p) for p in range(schedule.pp)]
    ticks = _ticks(schedule, costs)
    split = schedule.split_backwards()
    end_of: dict[tuple[int, Action], Stamp] = {}
    times: list[list[tuple[Stamp, Stamp]]] = [[] for _ in acts]
    clock: list[Stamp] = [(0, 0)] * schedule.pp
    pc = [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for p in range(schedule.pp):
            while pc[p] < len(acts[p]):
                a = acts[p][pc[p]]
                dep = dependency(schedule, p, a)
                if dep is not None and dep not in end_of:
                    break
                start = clock[p]
                if dep is not None:
                    ready = end_of[dep]
                    if with_comm and dep[0] != p:   # the boundary crossed: below the later stage of the two
                        q, c = schedule.placement(min(schedule.stage(p, a.chunk), schedule.stage(dep[0], dep[1].chunk)))
                        ready = (ready[0] + ticks[q][c][Kind.SEND_F], ready[1])
                    start = max(start, ready)
                full = a.kind is Kind.B and (p, a.microbatch, a.chunk) not in split
                d = ticks[p][a.chunk][None if full else a.kind]
                end = (start[0] + d, 0) if d > 0 else (start[0], start[1] + 1)
                end_of[(p, a)] = end
                times[p].append((start, end))
                clock[p] = end
                pc[p] += 1
                progress = True
    stuck = [p for p in range(schedule.pp) if pc[p] < len(acts[p])]
    if stuck:
        waits: dict[int, tuple[int, str]] = {}
        for p in stuck:
            a = acts[p][pc[p]]
            dep = dependency(schedule, p, a)
            assert dep is not None
            waits[p] = (dep[0], f"position {p} waits at {a} for {dep[1]} on position {dep[0]}")
        raise_cycle(schedule, waits, {p: step_index(schedule, p, acts[p][pc[p]]) for p in stuck})
    return times


def _free_at(spans: list[tuple[Stamp, Stamp]], starts: list[Stamp], t: Stamp) -> Stamp:
    """The first stamp from ``t`` on at which a position whose computes run over ``spans`` (sorted, with their
    ``starts``) is not inside one: ``t``, or the end of the compute running across it."""
    i = bisect_left(starts, t) - 1
    if i >= 0 and spans[i][0][0] < t[0] < spans[i][1][0]:
        return spans[i][1]
    return t


def lower(schedule: Schedule, costs: Costs | Sequence[Costs] | None = None, by_time: bool = False,
          with_comm: bool = False) -> Schedule:
    """Insert paired, batched send/recv steps into a compute-only schedule (see the module note).

    The order comes from a witness execution with ``costs`` (one Costs for all stages, one per
    position or one per stage, as for ``simulate``); None means unit costs. Lower with the costs you will run
    with: the order of transfers, and so the makespan, depends on them. ``by_time``: a batch holds only
    transfers of one witness time (see [Note: batches by time]); ``with_comm``: the witness counts the transfers'
    time (see :func:`witness_times`).
    """
    if schedule.lowered:
        return schedule
    check_compute(schedule)
    times = witness_times(schedule, costs, with_comm)
    starts = [[start for start, _ in row] for row in times]
    events: list[list[tuple[tuple[int, ...], Action]]] = [[] for _ in range(schedule.pp)]
    for p in range(schedule.pp):
        for a, (start, end) in zip(schedule.compute_actions(p), times[p]):
            events[p].append(((*start, 1, 0, 0, 0, 0, 0), a))
            for send, q, recv in transfers(schedule, p, a):
                rest = (int(a.kind is Kind.B), schedule.stage(p, a.chunk), a.microbatch)
                if by_time:
                    events[p].append(((*end, 0, *_free_at(times[q], starts[q], end), *rest), send))
                    events[q].append(((*end, 0, *_free_at(times[p], starts[p], end), *rest), recv))
                else:
                    events[p].append(((*end, 0, 0, 0, *rest), send))
                    events[q].append(((*end, 0, 0, 0, *rest), recv))
    programs = [_batched(sorted(evs, key=lambda e: e[0]), by_time) for evs in events]
    return replace(schedule, programs=_add_headers(schedule, programs), lowered=True)


def _batched(events: list[tuple[tuple[int, ...], Action]], by_time: bool) -> list[Step]:
    """Each compute action a step of its own; comm actions with no compute between them one batch (``by_time``:
    and of one witness time)."""
    prog: list[Step] = []
    batch: list[Action] = []
    when: tuple[int, ...] = ()
    for key, a in events:
        if a.kind.is_compute or (by_time and batch and key[:5] != when):
            if batch:
                prog.append(tuple(batch))
                batch = []
        if a.kind.is_compute:
            prog.append((a,))
        else:
            batch.append(a)
            when = key[:5]
    if batch:
        prog.append(tuple(batch))
    return prog


def _add_headers(schedule: Schedule, programs: list[list[Step]]) -> list[list[Step]]:
    """Put each forward stream's header right before its first payload, on both ends of the link.

    A batch holding that payload is split there: ``[ops before it] [header] [it, the rest]``, so
    on every link the header directly precedes the payload in both positions' sequences and the
    paired order is kept. The validator then proves the result like any other program.
    """
    out: list[list[Step]] = []
    for p, prog in enumerate(programs):
        started: set[tuple[Kind, int]] = set()
        new: list[Step] = []
        for step in prog:
            rest = list(step)
            for a in step:
                if a.kind not in (Kind.SEND_F, Kind.RECV_F):
                    continue
                stream = (a.kind, transfer_id(schedule, p, a)[2])
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
