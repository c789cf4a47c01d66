"""Simulation: run a lowered schedule with per-action costs under the engine's or the strictest comm semantics."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

from .actions import Action, Kind, Schedule, Step
from .costs import Costs, boundary_comm, per_stage
from .dataflow import dependency, partner, raise_cycle, transfer_id
from .lower import lower, witness_times

__all__ = ["SimResult", "simulate", "in_flight_peaks", "stage_peaks", "Dataflow"]

Interval = tuple[float, float, Step]


@dataclass
class SimResult:
    """What the simulator measured, per position. Bubbles are idle fractions of the makespan."""

    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    intervals: list[list[Interval]] = field(default_factory=list)

    @property
    def bubble(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.busy)


def in_flight_peaks(schedule: Schedule) -> list[int]:
    """Per position, the peak count of (microbatch, chunk) activations held: from F until B (or W when split)."""
    if schedule.forward_only:
        return [0] * schedule.pp
    split = schedule.split_backwards()
    peaks = []
    for p in range(schedule.pp):
        held = peak = 0
        for a in schedule.compute_actions(p):
            held += 1 if a.kind is Kind.F else -1 if schedule.releases(p, a, split) else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def stage_peaks(schedule: Schedule, split: frozenset[tuple[int, int, int]] | None = None) -> dict[int, int]:
    """Per stage, the peak count of microbatch activations it holds (from F until B, or W when split): what the
    engine's stages count live (``StepResult.peak_stored``); ``split``: the backwards split (default: the
    schedule's; fewer where the runtime runs a backward whole in B)."""
    if schedule.forward_only:
        return {s: 0 for s in range(schedule.num_stages)}
    split = schedule.split_backwards() if split is None else split
    peaks = {}
    for p in range(schedule.pp):
        held = [0] * schedule.chunks
        peak = [0] * schedule.chunks
        for a in schedule.compute_actions(p):
            held[a.chunk] += 1 if a.kind is Kind.F else -1 if schedule.releases(p, a, split) else 0
            peak[a.chunk] = max(peak[a.chunk], held[a.chunk])
        peaks.update({schedule.stage(p, c): peak[c] for c in range(schedule.chunks)})
    return peaks


def simulate(schedule: Schedule, costs: Costs | Sequence[Costs], mode: str = "async",
             sizes: Sequence[float] | None = None) -> SimResult:
    """Execute a schedule with per-action ``costs`` (one for all stages, one per position or one per stage); raise
    DeadlockError naming the cycle if stuck. An unlowered schedule is lowered with ``costs`` first.
    ``sizes``: each microbatch's size relative to the one ``costs`` describe (microbatches of their own lengths:
    its computes and transfers take that many times as long); None: all one size.

    ``mode="async"`` is how the engine runs: posting a comm batch never blocks compute; each
    position's batches go through one in-order comm queue (like an NCCL stream), a batch starts
    when it is at the head of its queue and completes when every partner batch has started too
    (plus ``costs.comm`` of the boundary it crosses; a shape header costs nothing); a compute waits only for the
    batch that carries its input.
    ``mode="rendezvous"`` is the strictest semantics (every batch blocks its position until
    matched): ``validate`` proves freedom from deadlock under it.
    """
    if not schedule.lowered:
        schedule = lower(schedule, costs)
    if sizes is not None and (len(sizes) != schedule.microbatches or min(sizes) < 0):
        raise ValueError(f"sizes must be one number >= 0 per microbatch ({schedule.microbatches}), got {list(sizes)}")
    if mode == "rendezvous":
        return _Rendezvous(schedule, costs, sizes).run()
    if mode != "async":
        raise ValueError(f"mode must be 'async' or 'rendezvous' (got {mode!r})")
    return _Async(schedule, costs, sizes).run()


class _Run:
    """State both simulations share: programs, costs, clocks, matched comm pairs, timed intervals."""

    def __init__(self, schedule: Schedule, costs: Costs | Sequence[Costs], sizes: Sequence[float] | None) -> None:
        self.schedule = schedule
        self.sizes = list(sizes) if sizes is not None else [1.0] * schedule.microbatches
        self.n = schedule.pp
        self.costs = per_stage(costs, schedule)   # [position][chunk]
        self.split = schedule.split_backwards()
        self.progs = schedule.programs
        self.where: list[dict[Action, int]] = [{a: i for i, step in enumerate(p) for a in step} for p in self.progs]
        self.partners: list[dict[Action, Action]] = [
            {a: partner(schedule, p, a) for step in prog for a in step if not a.kind.is_compute}
            for p, prog in enumerate(self.progs)]
        comm = boundary_comm(costs, schedule)
        # each comm action's transfer time: that of the boundary it crosses (below a forward producer, above a
        # backward one); a stream's shape header (a few integers, once per step) is taken to cost nothing
        self.comm: list[dict[Action, float]] = [
            {a: 0.0 if d == "H" else comm[stage if d == "F" else stage - 1] for a in partners
             for d, _, stage in (transfer_id(schedule, p, a),)} for p, partners in enumerate(self.partners)
        ] if any(comm) else [collections.defaultdict(float) for _ in self.partners]   # free: no lookup to build
        self.pc = [0] * self.n
        self.clock = [0.0] * self.n
        self.busy = [0.0] * self.n
        self.matched: dict[tuple[int, Action], float] = {}
        self.intervals: list[list[Interval]] = [[] for _ in self.progs]

    def compute(self, p: int, step: Step, ready: float) -> None:
        a = step[0]
        d = self.costs[p][a.chunk].of(a.kind, (p, a.microbatch, a.chunk) in self.split) * self.sizes[a.microbatch]
        self.intervals[p].append((ready, ready + d, step))
        self.clock[p] = ready + d
        self.busy[p] += d

    def transfer(self, p: int, a: Action) -> float:
        """How long comm action ``a`` of position ``p`` takes on the wire."""
        return self.comm[p][a] * self.sizes[a.microbatch]

    def unmatched(self, p: int, index: int) -> Action:
        return next(a for a in self.progs[p][index] if (p, a) not in self.matched)


class _Rendezvous(_Run):
    """Blocking semantics: a position stops at each comm batch until its peers posted every partner op."""

    def __init__(self, schedule: Schedule, costs: Costs | Sequence[Costs], sizes: Sequence[float] | None) -> None:
        super().__init__(schedule, costs, sizes)
        self.posted: list[float | None] = [None] * self.n

    def run(self) -> SimResult:
        progress = True
        while progress:
            progress = False
            for p in range(self.n):
                while self.pc[p] < len(self.progs[p]):
                    step = self.progs[p][self.pc[p]]
                    if step[0].kind.is_compute:
                        self.compute(p, step, self.clock[p])
                    else:
                        if self.posted[p] is None:   # posting is progress: a peer may now match it
                            self.posted[p] = self.clock[p]
                            progress = True
                        if not self._comm(p, step):
                            break
                    self.pc[p] += 1
                    progress = True
        stuck = [p for p in range(self.n) if self.pc[p] < len(self.progs[p])]
        if stuck:
            waits: dict[int, tuple[int, str]] = {}
            for p in stuck:
                step = self.progs[p][self.pc[p]]
                a = self.unmatched(p, self.pc[p])
                waits[p] = (a.peer, f"position {p} blocked at step {self.pc[p]} ({'+'.join(map(str, step))}) "
                                    f"waiting for position {a.peer} to post {self.partners[p][a]}")
            raise_cycle(self.schedule, waits, {p: self.pc[p] for p in waits})
        return SimResult(max(self.clock, default=0.0), self.busy, in_flight_peaks(self.schedule), self.intervals)

    def _comm(self, p: int, step: Step) -> bool:
        """Match the posted batch at ``p``'s program counter with its peers; True when it completed."""
        post_p = self.posted[p]
        assert post_p is not None
        for a in step:
            if (p, a) in self.matched:
                continue
            q, other = a.peer, self.partners[p][a]
            post_q = self.posted[q]
            if post_q is not None and self.where[q].get(other) == self.pc[q]:
                self.matched[(p, a)] = self.matched[(q, other)] = max(post_p, post_q) + self.transfer(p, a)
        if not all((p, a) in self.matched for a in step):
            return False
        end = max([self.clock[p]] + [self.matched[(p, a)] for a in step])
        self.intervals[p].append((post_p, end, step))
        self.clock[p] = end
        self.posted[p] = None
        return True


class _Async(_Run):
    """The engine's semantics: computes post comm batches without blocking; one in-order comm queue per position."""

    def __init__(self, schedule: Schedule, costs: Costs | Sequence[Costs], sizes: Sequence[float] | None) -> None:
        super().__init__(schedule, costs, sizes)
        self.needs: list[dict[int, int]] = [{} for _ in self.progs]   # compute step -> the step of its recv
        for p, prog in enumerate(self.progs):
            for i, step in enumerate(prog):
                for a in step:
                    if a.kind in (Kind.RECV_F, Kind.RECV_B):
                        consumer = Action(Kind.F if a.kind is Kind.RECV_F else Kind.B, a.microbatch, a.chunk)
                        self.needs[p][self.where[p][consumer]] = i
        self.comm_steps = [[i for i, st in enumerate(prog) if not st[0].kind.is_compute] for prog in self.progs]
        self.posted: list[dict[int, float]] = [{} for _ in self.progs]   # comm step -> post time
        self.head = [0] * self.n                                          # index into comm_steps[p]
        self.head_free = [0.0] * self.n                                   # when the previous batch completed
        self.done: list[dict[int, float]] = [{} for _ in self.progs]     # comm step -> completion time

    def run(self) -> SimResult:
        progress = True
        while progress:
            progress = False
            for p in range(self.n):
                progress = self._compute_side(p) | progress
                progress = self._comm_side(p) | progress
        if any(self.pc[p] < len(self.progs[p]) or self.head[p] < len(self.comm_steps[p]) for p in range(self.n)):
            self._deadlock()
        makespan = max([0.0] + [e for row in self.intervals for _, e, _ in row])
        return SimResult(makespan, self.busy, in_flight_peaks(self.schedule), self.intervals)

    def _compute_side(self, p: int) -> bool:
        """Post batches and run computes until one waits for a receive; whether anything moved."""
        moved = False
        while self.pc[p] < len(self.progs[p]):
            step = self.progs[p][self.pc[p]]
            if not step[0].kind.is_compute:
                self.posted[p][self.pc[p]] = self.clock[p]
            else:
                ready = self.clock[p]
                if self.pc[p] in self.needs[p]:
                    recv = self.needs[p][self.pc[p]]
                    if recv not in self.done[p]:
                        break
                    ready = max(ready, self.done[p][recv])
                self.compute(p, step, ready)
            self.pc[p] += 1
            moved = True
        return moved

    def head_start(self, p: int) -> float | None:
        """When the batch at the head of ``p``'s comm queue starts (None: not posted yet, or the queue is empty)."""
        if self.head[p] >= len(self.comm_steps[p]) or self.comm_steps[p][self.head[p]] not in self.posted[p]:
            return None
        return max(self.posted[p][self.comm_steps[p][self.head[p]]], self.head_free[p])

    def _comm_side(self, p: int) -> bool:
        """Complete head batches whose partners are at the head of their queues too; whether any completed."""
        moved = False
        while (start := self.head_start(p)) is not None:
            idx = self.comm_steps[p][self.head[p]]
            for a in self.progs[p][idx]:
                if (p, a) in self.matched:
                    continue
                q, other = a.peer, self.partners[p][a]
                start_q = self.head_start(q)
                if start_q is not None and self.comm_steps[q][self.head[q]] == self.where[q].get(other):
                    self.matched[(p, a)] = self.matched[(q, other)] = max(start, start_q) + self.transfer(p, a)
            if not all((p, a) in self.matched for a in self.progs[p][idx]):
                break
            end = max([start] + [self.matched[(p, a)] for a in self.progs[p][idx]])
            self.intervals[p].append((start, end, self.progs[p][idx]))
            self.done[p][idx] = self.head_free[p] = end
            self.head[p] += 1
            moved = True
        return moved

    def _deadlock(self) -> None:
        waits: dict[int, tuple[int, str]] = {}
        at: dict[int, int] = {}
        for p in range(self.n):
            if self.head[p] < len(self.comm_steps[p]) and self.head_start(p) is not None:
                idx = self.comm_steps[p][self.head[p]]
                a = self.unmatched(p, idx)
                waits[p] = (a.peer, f"position {p}'s comm queue is stuck at step {idx} "
                                    f"({'+'.join(map(str, self.progs[p][idx]))}) waiting for position {a.peer} "
                                    f"to post {self.partners[p][a]}")
                at[p] = idx
            elif self.pc[p] < len(self.progs[p]):
                waits[p] = (p, f"position {p} waits at step {self.pc[p]} for its own receive")
                at[p] = self.pc[p]
        raise_cycle(self.schedule, waits, at)


class Dataflow:
    """A schedule's makespan under its data dependencies alone, cheap enough to score thousands of splits.

    Each position runs its compute actions in program order; an action starts when its position is
    free and the action it needs on another position has ended (plus ``comm``). Communication
    queues are not modelled, so this is a lower bound of :func:`simulate` (equal when the lowered
    comm order never delays a transfer). Which actions wait for which does not depend on the costs,
    so the order is worked out once and each :meth:`makespan` is one pass over the actions.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        split = schedule.split_backwards()
        acts = [schedule.compute_actions(p) for p in range(schedule.pp)]
        ids: dict[tuple[int, Action], int] = {}
        # per action in dependency order: (position, cost slot (p * chunks + c) * 4 + kind, needed id | -1, the
        # boundary its input crosses to another position | -1); kind 0 F, 1 B of a split backward, 2 W, 3 B of a
        # full backward (b + w)
        self._slots: list[tuple[int, int, int, int]] = []
        self._microbatch: list[int] = []   # each action's microbatch (for :meth:`shared_makespan`'s sizes)
        self.count = [[[0, 0, 0, 0] for _ in range(schedule.chunks)] for _ in range(schedule.pp)]
        pc = [0] * schedule.pp
        progress = True
        while progress:
            progress = False
            for p, prog in enumerate(acts):
                while pc[p] < len(prog):
                    a = prog[pc[p]]
                    dep = dependency(schedule, p, a)
                    if dep is not None and dep not in ids:
                        break
                    k = (0 if a.kind is Kind.F else 2 if a.kind is Kind.W
                         else 1 if (p, a.microbatch, a.chunk) in split else 3)
                    stage = schedule.stage(p, a.chunk)
                    crossing = (-1 if dep is None or dep[0] == p else stage - 1 if a.kind is Kind.F else stage)
                    self._slots.append((p, (p * schedule.chunks + a.chunk) * 4 + k, ids[dep] if dep is not None else -1,
                                        crossing))
                    self._microbatch.append(a.microbatch)
                    self.count[p][a.chunk][k] += 1
                    ids[(p, a)] = len(ids)
                    pc[p] += 1
                    progress = True
        if any(pc[p] < len(prog) for p, prog in enumerate(acts)):
            witness_times(schedule)   # raises DeadlockError naming the cycle
            raise AssertionError("dependency order stuck without a cycle")

    def durations(self, costs: Costs | Sequence[Costs]) -> list[list[tuple[float, float, float]]]:
        """``[position][chunk]``: (f, b, w) of each stage as :meth:`makespan` takes them (a full B costs b + w)."""
        return [[(c.f, c.b, c.w) for c in row] for row in per_stage(costs, self.schedule)]

    def work(self, table: list[list[tuple[float, float, float]]]) -> list[float]:
        """Per position, the sum of its compute durations: no makespan is below the largest."""
        return [sum(n * d for cnt, (f, b, w) in zip(self.count[p], table[p]) for n, d in zip(cnt, (f, b, w, b + w)))
                for p in range(self.schedule.pp)]

    def _durations_and_hops(self, table: list[list[tuple[float, float, float]]],
                            comm: float | Sequence[float]) -> tuple[list[float], list[float]]:
        """Each slot's duration (slot ``(p * chunks + c) * 4 + kind``) and each boundary's transfer time."""
        flat = [d for row in table for f, b, w in row for d in (f, b, w, b + w)]
        return flat, [comm] * max(0, self.schedule.num_stages - 1) if isinstance(comm, (int, float)) else list(comm)

    def makespan(self, table: list[list[tuple[float, float, float]]], comm: float | Sequence[float] = 0.0) -> float:
        """``comm``: one transfer time for every boundary, or one per boundary (``comm[s]``: between stage s and
        s + 1, as :func:`~pipeengine.schedule.costs.boundary_comm` gives them)."""
        flat, hop = self._durations_and_hops(table, comm)
        end, clock = [0.0] * len(self._slots), [0.0] * self.schedule.pp
        for i, (p, slot, dep, crossing) in enumerate(self._slots):
            t = clock[p]
            if dep >= 0:
                ready = end[dep] + hop[crossing] if crossing >= 0 else end[dep]
                if ready > t:
                    t = ready
            t += flat[slot]
            end[i] = t
            clock[p] = t
        return max(clock, default=0.0)

    def shared_makespan(self, table: list[list[tuple[float, float, float]]], capacity: float,
                        comm: float | Sequence[float] = 0.0, sizes: Sequence[float] | None = None) -> float:
        """:meth:`makespan` when the positions share ``capacity`` processors (CPU ranks on fewer cores than they
        want): at any moment the ``n`` positions computing each progress at ``min(1, capacity / n)`` of their
        speed, so a fill with one stage busy runs at full speed and a steady state with every stage busy at the
        cores' share. ``sizes``: each microbatch's size relative to the one ``table`` describes."""
        flat, hop = self._durations_and_hops(table, comm)
        queues = [collections.deque(i for i, s in enumerate(self._slots) if s[0] == p) for p in range(self.schedule.pp)]
        end: list[float | None] = [None] * len(self._slots)
        running: dict[int, list[float]] = {}   # position -> [action, work left]
        now = 0.0
        while any(queues) or running:
            waits = []   # when an idle position's next action may start
            for p, queue in enumerate(queues):
                if p in running or not queue:
                    continue
                i = queue[0]
                _, slot, dep, crossing = self._slots[i]
                if dep >= 0 and end[dep] is None:
                    continue
                ready = 0.0 if dep < 0 else end[dep] + (hop[crossing] if crossing >= 0 else 0.0)   # type: ignore
                if ready <= now:
                    queue.popleft()
                    size = sizes[self._microbatch[i]] if sizes is not None else 1.0
                    running[p] = [i, flat[slot] * size]
                else:
                    waits.append(ready)
            rate = min(1.0, capacity / len(running)) if running else 0.0
            step = min([left / rate for _, left in running.values()] + [t - now for t in waits], default=None)
            if step is None:
                raise AssertionError("shared makespan stuck: an action waits for one that never runs")
            now += step
            for p, job in list(running.items()):
                job[1] -= step * rate
                if job[1] <= 1e-12 * max(1.0, now):
                    end[int(job[0])] = now
                    del running[p]
        return now
