"""``--schedule auto``: the schedule and the partition together, from measured layer costs and a memory cap.

Every library schedule that applies is planned (its best split, planner.py) and simulated with each
stage's own costs; then, for each placement (one stage per position, the V, two looping chunks), the
greedy synthesiser (schedule/synth.py) builds an order for the best split of that placement with
the measured per-stage costs, under the placement's own cap and under the most a position may hold (the
memory cap turned into chunk activations per position; without one, zb-h2's 2pp - 1 microbatches), each
lowered with the usual batches and with batches of one witness time (``shortest_lowering``). The
shortest simulated makespan wins, so auto is never slower in simulation than the best library
schedule under the same cap. It also reports a lower bound no schedule can beat: the larger of the
busiest position's work and the critical path of one microbatch (every F, then every B, with the
transfers between positions), and the gap to it; and a tighter one that adds the fill (:func:`fill_bound`).
Microbatches of their own sizes (``sizes``: shapes of their own) are simulated at their sizes: the splits, every
candidate and the bounds (the largest microbatch's critical path); the synthesised orders and their lowerings are
built for equal ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..schedule import Schedule, compile_schedule, simulate
from ..schedule.builders import shortest_lowering, synthesis_caps
from ..schedule.costs import boundary_comm
from ..schedule.simulate import in_flight_peaks
from ..schedule.synth import synthesise
from .links import Links
from .measured import Choice, LayerCost, position_sizes, sized, with_transfers
from .planner import PartitionError, choose_bounds

__all__ = ["AutoChoice", "auto_schedule", "lower_bound", "fill_bound", "LIBRARY"]

SEARCH_BUDGET = 600   # splits scored per library schedule (the planner's own default is 2,000)
# (name, chunks): the library auto compares against
LIBRARY = (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2),
           ("dualpipev", 2), ("v-half", 2), ("v-min", 2))
_PLACEMENTS = (("loop", 1, ("zb-h2", "zb-h1", "1f1b")), ("v", 2, ("zbv", "v-half", "v-min")),
               ("loop", 2, ("interleaved-zb", "interleaved-1f1b")))


@dataclass
class AutoChoice:
    """What auto chose: the lowered, validated schedule, its split and simulated makespan, the lower bound,
    and every candidate's makespan (None: it did not fit the cap or does not apply)."""

    schedule: Schedule
    bounds: list[int]
    stage_costs: list[tuple[float, float, float]]
    makespan: float
    bound: float
    memory: list[float]   # estimated peak bytes per position (as the planner estimates them)
    candidates: dict[str, float | None] = field(default_factory=dict)
    fill: float = 0.0     # fill_bound: >= bound, still below every schedule of this split and placement
    library: str = ""     # the library schedule of this placement and split (what other microbatch counts run)
    winner: str = ""      # the candidate chosen: a library schedule's name or "synthesised (placement, chunks)"
    comm: list[float] = field(default_factory=list)   # [s]: a transfer between stage s and s + 1 (links.py)

    @property
    def gap(self) -> float:
        return self.makespan / self.bound if self.bound > 0 else 1.0

    @property
    def fill_gap(self) -> float:
        return self.makespan / self.fill if self.fill > 0 else 1.0

    def best_library(self) -> tuple[str, float] | None:
        lib = [(t, name) for name, t in self.candidates.items() if t is not None and not name.startswith("synth")]
        return (min(lib)[1], min(lib)[0]) if lib else None

    def chosen(self) -> str:
        """What auto built, in words: the library schedule, or a synthesised order and what it beats."""
        where = f"placement {self.schedule.placement_kind}, {self.schedule.chunks} stage(s) per position"
        if not self.winner.startswith("synth"):
            return f"{self.winner} (from the library; {where})"
        best = self.best_library()
        beats = f"; {best[1] / self.makespan - 1:.1%} shorter than the best library schedule, {best[0]}" if best else ""
        return f"a synthesised order ({where}{beats})"

    def describe(self, unit: str = "ms") -> str:
        """What auto chose and every candidate's simulated step (``unit``: "ms" for costs in seconds, else the
        costs' own units)."""
        def t(x: float) -> str:
            return f"{1e3 * x:.2f} ms" if unit == "ms" else f"{x:g} {unit}"
        with_links = " (compute and transfers)" if any(self.comm) else ""
        lines = [f"schedule auto: {self.chosen()}, bounds {self.bounds}",
                 f"  simulated step{with_links} {t(self.makespan)}, lower bound {t(self.bound)} (gap {self.gap:.3f}x); "
                 f"with the fill {t(self.fill)} (gap {self.fill_gap:.3f}x)"]
        for name, x in self.candidates.items():
            lines.append(f"  {name:<28} " + ("does not fit / apply" if x is None else t(x)))
        return "\n".join(lines)


def _hops(stage_costs: Sequence[tuple[float, float, float]], schedule: Schedule,
          comm: float | Sequence[float]) -> list[float]:
    """[s]: the transfer time between stage s and s + 1 (0 on one position); ``comm`` one for all or one each."""
    each = [comm] * (len(stage_costs) - 1) if isinstance(comm, (int, float)) else list(comm)
    return boundary_comm(with_transfers(stage_costs, each), schedule)


def lower_bound(stage_costs: Sequence[tuple[float, float, float]], schedule: Schedule, microbatches: int,
                comm: float | Sequence[float] = 0.0, sizes: Sequence[float] | None = None) -> float:
    """max(busiest position's work, the largest microbatch's critical path) for a split and placement (``comm``: the
    transfer time, one for all boundaries or one per boundary; ``sizes``: each microbatch's size relative to the
    one the costs are for, see simulate)."""
    sizes = sized(sizes, microbatches)
    total, largest = (sum(sizes), max(sizes)) if sizes else (microbatches, 1.0)
    work = [0.0] * schedule.pp
    for s, (f, b, w) in enumerate(stage_costs):
        work[schedule.placement(s)[0]] += total * (f + b + w)
    hops = _hops(stage_costs, schedule, comm)
    path = sum(f + b for f, b, _ in stage_costs) + 2 * sum(hops) + stage_costs[0][2]   # then W of stage 0
    return max(max(work), largest * path)


def fill_bound(stage_costs: Sequence[tuple[float, float, float]], schedule: Schedule, microbatches: int,
               comm: float | Sequence[float] = 0.0, sizes: Sequence[float] | None = None) -> float:
    """:func:`lower_bound`, raised by what every position must wait for, whatever the order (a step bound).

    Nothing runs on position p before microbatch 0's forward reaches its lowest stage s (head: F of the
    stages below, plus a transfer per hop), so the step lasts at least head + p's work. And p's last B (of
    one of its stages, s) comes after all its F's and B's (a W may come later, nothing else), and is followed
    by the B's of the stages below s for that microbatch, one after another: head + p's F and B work + the
    least such chain over p's stages. With ``sizes`` the head and the chain are the smallest microbatch's and the
    work the sum of all.
    """
    sizes = sized(sizes, microbatches)
    total, least = (sum(sizes), min(sizes)) if sizes else (microbatches, 1.0)
    n = len(stage_costs)
    where = [schedule.placement(s)[0] for s in range(n)]
    hops = _hops(stage_costs, schedule, comm)
    reach = [0.0] * n   # when stage s's first F may start, at the earliest
    for s in range(1, n):
        reach[s] = reach[s - 1] + stage_costs[s - 1][0] + hops[s - 1]
    below = [sum(b for _, b, _ in stage_costs[:s]) for s in range(n)]   # B chain under stage s
    best = lower_bound(stage_costs, schedule, microbatches, comm, sizes)
    for p in range(schedule.pp):
        mine = [s for s in range(n) if where[s] == p]
        head = least * min(reach[s] for s in mine)
        fb = total * sum(stage_costs[s][0] + stage_costs[s][1] for s in mine)
        w = total * sum(stage_costs[s][2] for s in mine)
        best = max(best, head + fb + w, head + fb + least * min(below[s] for s in mine))
    return best


def _memory(bounds: Sequence[int], schedule: Schedule, costs: Sequence[LayerCost], state_factor: float) -> list[float]:
    """Per position: state_factor x its parameter bytes + its peak chunk activations x its largest stage's."""
    return [state_factor * params + peak * act
            for peak, (params, act) in zip(in_flight_peaks(schedule), position_sizes(costs, bounds, schedule))]


def _cap_options(choice: Choice, schedule: Schedule, costs: Sequence[LayerCost], memory_cap: float | None,
                 state_factor: float, default: list[int]) -> list[list[int]]:
    """The caps (chunk activations per position) the greedy runs under: the placement's own (``default``) and
    the most a position may hold. With a memory cap that is what the cap leaves after the position's
    parameters' state, over its largest stage activation (the default is lowered to it); without one,
    zb-h2's peak, 2pp - 1 microbatches, the most any library schedule auto compares holds. A larger cap
    is not always shorter (the greedy runs an F whenever it may), so both are tried."""
    if memory_cap is None:
        most = [schedule.chunks * (2 * schedule.pp - 1)] * schedule.pp
    else:
        most = [max(0, int((memory_cap - state_factor * params) // act)) if act > 0 else 10**9
                for params, act in position_sizes(costs, choice.bounds, schedule)]
        default = [min(d, c) for d, c in zip(default, most)]
    return [default] if most == default else [default, most]


def auto_schedule(costs: Sequence[LayerCost], pp: int, microbatches: int, memory_cap: float | None = None,
                  links: Links | None = None, state_factor: float = 4.0,
                  sizes: Sequence[float] | None = None) -> AutoChoice:
    """The schedule and split with the shortest simulated step (see the module docstring); ``links``: what a
    transfer between neighbours costs (links.py; None: free); ``sizes``: each microbatch's cost relative to the
    measured one (microbatches of their own lengths), every candidate simulated with them."""
    sizes = sized(sizes, microbatches)
    chosen: dict[str, tuple[Choice, Schedule]] = {}
    candidates: dict[str, float | None] = {}
    for name, chunks in LIBRARY:
        try:
            sched = compile_schedule(name, pp, microbatches, chunks)
            choice = choose_bounds(costs, sched, memory_cap, state_factor, budget=SEARCH_BUDGET, links=links,
                                   sizes=sizes)
        except (ValueError, PartitionError):   # does not apply (m, layers) or no split fits the cap
            candidates[name] = None
            continue
        candidates[name] = choice.makespan
        chosen[name] = (choice, sched)
    results: list[tuple[float, str, Schedule, Choice]] = [
        (choice.makespan, name, sched, choice) for name, (choice, sched) in chosen.items()]
    for placement, chunks, family in _PLACEMENTS:
        planned = [chosen[n] for n in family if n in chosen]
        label = f"synthesised ({placement}, chunks {chunks})"
        if not planned:
            candidates[label] = None
            continue
        choice, base = min(planned, key=lambda cs: cs[0].makespan)
        stage = choice.costs()
        default = synthesis_caps("zb-h2" if chunks == 1 else "zbv" if placement == "v" else "interleaved-zb", pp,
                                 microbatches, chunks)
        made = []
        for caps in _cap_options(choice, base, costs, memory_cap, state_factor, default):
            try:
                order = synthesise(f"synthesised-{placement}{chunks}", pp, microbatches, chunks, placement, stage,
                                   caps)
            except ValueError:   # the cap leaves too little room for this placement
                continue
            sched = shortest_lowering([order], stage)
            made.append((simulate(sched, stage, sizes=sizes).makespan, sched))
        best = min(made, key=lambda ms: ms[0], default=None)
        candidates[label] = None if best is None else best[0]
        if best is not None:
            results.append((best[0], label, best[1], choice))
    if not results:
        raise PartitionError(f"no schedule fits: every library schedule and every synthesised one needs more "
                             f"memory than the cap of {(memory_cap or 0) / 2**30:.2f} GiB per position; raise "
                             f"--memory-cap, use more pipeline positions or recompute (--recompute full)")
    # the shortest; on a tie a library schedule (known, proven in the tests) before a synthesised order
    makespan, name, sched, choice = min(results, key=lambda r: (r[0], r[1].startswith("synth"), r[1]))
    bound = lower_bound(choice.stage_costs, sched, microbatches, choice.comm, sizes)
    library = name if name in chosen else next(n for n, (c, _) in chosen.items() if c is choice)
    return AutoChoice(sched, list(choice.bounds), list(choice.stage_costs), makespan, bound,
                      _memory(choice.bounds, sched, costs, state_factor), candidates,
                      fill_bound(choice.stage_costs, sched, microbatches, choice.comm, sizes), library, name,
                      choice.comm)
