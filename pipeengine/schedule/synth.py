"""Schedules synthesised from costs and a memory cap: a greedy list scheduler over a placement (the zero-bubble idea).

[Note: the greedy synthesiser]
Every position runs F, B and W of its stages (backward split: B is the input gradient, on the
critical path back through the pipeline; W the weight gradient, free to move). Time is simulated:
the position that is free earliest picks its next action among those whose input has arrived:

1. a B (it unblocks the previous stage and frees nothing yet, but the whole backward wave waits on
   it), of the stage that ``b_order`` prefers;
2. else an F, if the position holds fewer chunk activations than its cap (an activation is held
   from F until W) and one slot stays free for each deeper stage on the position, of the stage
   ``f_first`` prefers;
3. else a W (it fills a gap and frees an activation);
4. else it waits until something arrives.

Within a stage microbatches run in order. With the cap of 1F1B and the loop placement this gives
1F1B with W's filling the drain (ZB-H1); a larger cap lets the warm-up run ahead (ZB-H2); the V
placement with caps of pp, (pp + 2)//2 and (pp + 4)//3 microbatches gives ZB-V-like, V-Half-like and
V-Min-like orders. :func:`synthesise` tries the four preference orders and keeps the shortest
makespan; the result is an ordinary compute-only schedule that is lowered and proven like any other.
"""

from __future__ import annotations

from typing import Sequence

from .actions import Action, Kind, Schedule, ScheduleError, steps_of
from .costs import Costs, boundary_comm, per_stage

__all__ = ["greedy", "synthesise"]


class _Greedy:
    """The state of one greedy run (see the module note): what ran where and when, what each position holds."""

    def __init__(self, pp: int, microbatches: int, chunks: int, placement: str, costs: Costs | Sequence[Costs],
                 cap: Sequence[int], f_first: str, b_first: str) -> None:
        shape = Schedule("synth", pp, microbatches, chunks, [], placement_kind=placement)
        self.pp, self.m, self.cap = pp, microbatches, list(cap)
        self.table = per_stage(costs, shape)
        self.comm = boundary_comm(costs, shape)   # [s]: a transfer between stage s and s + 1
        stages = pp * chunks
        self.last = stages - 1
        self.where = [shape.placement(s) for s in range(stages)]
        self.mine = [[shape.stage(p, c) for c in range(chunks)] for p in range(pp)]
        self.f_end: dict[tuple[int, int], float] = {}   # (stage, mb) -> when its F ended
        self.b_end: dict[tuple[int, int], float] = {}
        self.next_f = [0] * stages
        self.next_b = [0] * stages
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]   # B ran, W not yet
        self.held = [0] * pp
        self.clock = [0.0] * pp
        self.order: list[list[Action]] = [[] for _ in range(pp)]
        self.left = [3 * microbatches * chunks] * pp
        self.f_sign = 1 if f_first == "low" else -1   # min() of sign * stage picks the preferred stage
        self.b_sign = -1 if b_first == "high" else 1

    def _arrival(self, end: float, producer: int, consumer: int) -> float:
        return end + self.comm[min(producer, consumer)]

    def f_ready(self, s: int) -> float | None:
        """When stage s's next F may start (None: not known yet, or none left)."""
        mb = self.next_f[s]
        if mb >= self.m:
            return None
        if s == 0:
            return 0.0
        end = self.f_end.get((s - 1, mb))
        return None if end is None else self._arrival(end, s - 1, s)

    def b_ready(self, s: int) -> float | None:
        mb = self.next_b[s]
        if mb >= self.m or (s, mb) not in self.f_end:
            return None
        if s == self.last:
            return self.f_end[(s, mb)]
        end = self.b_end.get((s + 1, mb))
        return None if end is None else max(self._arrival(end, s + 1, s), self.f_end[(s, mb)])

    def room(self, p: int, s: int) -> bool:
        """Whether an F of stage ``s`` fits under the cap, keeping a slot for each deeper stage here that has
        forwards left (else a position full of shallow activations waits for a deep one forever)."""
        keep = sum(1 for d in self.mine[p] if d > s and self.next_f[d] < self.m)
        return self.held[p] + 1 + keep <= self.cap[p]

    def run(self, p: int, kind: Kind, s: int, mb: int) -> None:
        cost = self.table[p][self.where[s][1]]
        end = self.clock[p] + (cost.f if kind is Kind.F else cost.b if kind is Kind.B else cost.w)
        self.clock[p] = end
        self.order[p].append(Action(kind, mb, self.where[s][1]))
        self.left[p] -= 1
        if kind is Kind.F:
            self.f_end[(s, mb)] = end
            self.next_f[s] += 1
            self.held[p] += 1
        elif kind is Kind.B:
            self.b_end[(s, mb)] = end
            self.next_b[s] += 1
            self.pending_w[p].append((s, mb))
        else:
            self.held[p] -= 1

    def act(self, p: int, now: float) -> bool:
        """Run position p's next action if one can start at ``now`` (B, else F under the cap, else W)."""
        ready_b = [(self.b_sign * s, s) for s in self.mine[p] if (t := self.b_ready(s)) is not None and t <= now]
        if ready_b:
            s = min(ready_b)[1]
            self.run(p, Kind.B, s, self.next_b[s])
            return True
        ready_f = [(self.f_sign * s, s) for s in self.mine[p]
                   if (t := self.f_ready(s)) is not None and t <= now and self.room(p, s)]
        if ready_f:
            s = min(ready_f)[1]
            self.run(p, Kind.F, s, self.next_f[s])
            return True
        if self.pending_w[p]:
            s, mb = self.pending_w[p].pop(0)
            self.run(p, Kind.W, s, mb)
            return True
        return False

    def go(self) -> None:
        pp, clock, left = self.pp, self.clock, self.left
        while any(left):
            now = min(clock[q] for q in range(pp) if left[q])
            due = [q for q in range(pp) if left[q] and clock[q] <= now]
            if any(self.act(q, now) for q in due):
                continue
            # nobody due can act: wait for the next arrival, or for a busy position to finish
            times = [t for q in due for s in self.mine[q]
                     for t in (self.b_ready(s), self.f_ready(s) if self.room(q, s) else None)
                     if t is not None and t > now]
            times += [clock[q] for q in range(pp) if left[q] and clock[q] > now]
            if not times:
                raise ScheduleError(f"the memory cap {self.cap} (chunk activations per position) is too small for "
                                    f"{self.m} microbatches over {pp} positions x {len(self.mine[0])} chunks: "
                                    f"positions {due} hold {[self.held[q] for q in due]} and nothing can free one; "
                                    f"raise the cap")
            for q in due:
                clock[q] = min(times)


def greedy(pp: int, microbatches: int, chunks: int, placement: str, costs: Costs | Sequence[Costs],
           cap: Sequence[int], f_first: str = "low", b_first: str = "high") -> tuple[list[list[Action]], float]:
    """Per position, the order of its F/B/W actions, and the makespan the greedy simulated (see the module note).

    ``cap``: per position, the most chunk activations it may hold at once (a chunk activation is one
    microbatch through one stage). ``f_first`` / ``b_first``: "low" or "high", which stage a position
    prefers when it could run an F (or a B) on several. Raises ScheduleError when a cap is too small
    for the microbatches to get through.
    """
    run = _Greedy(pp, microbatches, chunks, placement, costs, cap, f_first, b_first)
    run.go()
    return run.order, max(run.clock)


def synthesise(name: str, pp: int, microbatches: int, chunks: int, placement: str,
               costs: Costs | Sequence[Costs], cap: Sequence[int]) -> Schedule:
    """The shortest of the greedy's preference orders (four with several chunks), as a compute-only schedule."""
    best: tuple[float, int, list[list[Action]]] | None = None
    orders = (("low", "high"), ("high", "high"), ("low", "low"), ("high", "low")) if chunks > 1 else (("low", "high"),)
    for k, (f_first, b_first) in enumerate(orders):   # with one stage per position there is nothing to prefer
        order, makespan = greedy(pp, microbatches, chunks, placement, costs, cap, f_first, b_first)
        if best is None or makespan < best[0] - 1e-12:
            best = (makespan, k, order)
    assert best is not None
    return Schedule(name, pp, microbatches, chunks, [steps_of(prog) for prog in best[2]], placement_kind=placement)
