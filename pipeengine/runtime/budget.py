"""A memory budget the planner keeps: the schedule's memory shape, recompute per stage and the split chosen together.

[Note: memory budget]
With ``memory_budget`` (bytes per rank: parameters, gradients, optimizer state, activations and buffers, the
process's own among them, as the twin counts them, twin.py) the plan is the one with the shortest predicted step
whose every position's predicted peak fits. Candidates: each schedule of :data:`SHAPES` that compiles for
pp and m (or only the one named), each on the split whose simulated step is shortest and on the split that
balances parameters; on each, every stage takes the least recompute that lets its position fit (none, then
selective where the profile measured it, then every K layers for K from the stage's length down to 1, then the
whole stage), the positions one by one. Where the best plan needs recompute, or none fits, the same again with
each microbatch run as 2, then 4 equal pieces, on the layers' costs measured on a piece (plan.py, [Note:
microbatch pieces] in microbatches.py): a k-th of the activations held per microbatch in flight, no arithmetic
added, the bubble smaller; the fastest of all is kept.
A budget below the least any candidate needs is refused with one line naming that least.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..schedule import Schedule, compile_schedule
from .links import Links
from .measured import LayerCost
from .options import SELECTIVE
from .planner import PartitionError, balance_min_max, choose_bounds
from .twin import Twin, predict

__all__ = ["SHAPES", "HEADROOM", "BudgetChoice", "fit_budget", "recompute_text"]

HEADROOM = 0.10   # of the budget kept free for what the twin misses (its memory is within about 10% on CPU)
SHAPES = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv", "v-half", "v-min")


def recompute_text(k: int | None) -> str:
    """A stage's recompute as the engine takes it: none, selective, full or every:K."""
    return "none" if k is None else "selective" if k == SELECTIVE else "full" if k == 0 else f"every:{k}"


@dataclass
class BudgetChoice:
    """What the budget planner chose: the schedule, its split, each stage's recompute and the twin of it."""

    schedule: Schedule
    bounds: list[int]
    recompute: list[str]
    twin: Twin
    budget: float
    tried: list[tuple[str, float | None, float]] = field(default_factory=list)   # (label, step or None, least bytes)
    pieces: int = 1   # each microbatch run as this many ([Note: microbatch pieces], microbatches.py)
    costs: Sequence[LayerCost] = ()   # the layers' costs it was planned with (on a piece of the microbatch)
    piece_losses: str = ""   # how the loss adds up over the pieces: "mean" or "sum"

    def describe(self) -> str:
        peak = max(m.total for m in self.twin.memory)
        shown = ", ".join(f"stage {s}: {r}" for s, r in enumerate(self.recompute) if r != "none") or "none"
        cut = (f", each microbatch run as {self.pieces} pieces (its loss a {self.piece_losses} over them)"
               if self.pieces > 1 else "")
        lines = [f"memory budget {self.budget / 2**30:.2f} GiB per rank ({100 * (1 - HEADROOM):.0f}% planned): "
                 f"{self.schedule.name} on bounds "
                 f"{self.bounds}{cut}, recompute {shown}; predicted step {1e3 * self.twin.step_s:.1f} ms, peak "
                 f"{peak / 2**30:.2f} GiB"]
        for label, step, least in sorted(self.tried, key=lambda t: (t[1] is None, t[1] or 0.0)):
            fits = f"{1e3 * step:.1f} ms" if step is not None else f"does not fit (needs {least / 2**30:.2f} GiB)"
            lines.append(f"  {label}: {fits}")
        return "\n".join(lines)


def _recompute_options(layers: Sequence[LayerCost]) -> list[int | None]:
    """A stage's recompute from the least to the most: none, selective (where measured: it recomputes only the cheap
    ops), every K for K = layers - 1 .. 1, full."""
    selective = [SELECTIVE] if all(c.selective_bytes is not None for c in layers) else []
    return [None, *selective, *range(len(layers) - 1, 0, -1), 0]


def _fit(costs: Sequence[LayerCost], bounds: Sequence[int], schedule: Schedule, budget: float,
         facts: dict[str, Any]) -> tuple[list[int | None], Twin, float]:
    """Each stage's least recompute that lets its position fit; the twin of it, and the fullest position's bytes."""
    stages = schedule.num_stages
    chosen: list[int | None] = [None] * stages
    twin = predict(costs, bounds, schedule, recompute=chosen, **facts)
    for p in range(schedule.pp):
        mine = [schedule.stage(p, c) for c in range(schedule.chunks)]
        for s in sorted(mine, key=lambda s: -(bounds[s + 1] - bounds[s])):   # the longest stage first
            for k in _recompute_options(costs[bounds[s]:bounds[s + 1]]):
                if twin.memory[p].total <= budget:
                    break
                chosen[s] = k
                twin = predict(costs, bounds, schedule, recompute=chosen, **facts)
    return chosen, twin, max(m.total for m in twin.memory)


def fit_budget(costs: Sequence[LayerCost], pp: int, microbatches: int, budget: float, *,
               schedules: Sequence[str] = SHAPES, links: Links | None = None, pieces: int = 1,
               **facts: Any) -> BudgetChoice:
    """The fastest predicted plan whose every position fits ``budget`` bytes (see [Note: memory budget]); ``facts``:
    what :func:`twin.predict` takes of the run (dp, optimizer_states, zero, input_bytes, host...); ``pieces``: each
    of the user's microbatches runs as that many of the ``microbatches`` (``costs`` are a piece's), for the text."""
    facts = {**facts, "links": links}
    budget, asked = budget * (1 - HEADROOM), budget
    best: BudgetChoice | None = None
    tried: list[tuple[str, float | None, float]] = []
    least: tuple[float, str] | None = None
    for name in schedules:
        try:
            sched = compile_schedule(name, pp, microbatches)
            fastest = choose_bounds(costs, sched, links=links, sizes=facts.get("sizes")).bounds
        except (ValueError, PartitionError):
            continue
        balanced = balance_min_max([max(1.0, float(c.param_bytes)) for c in costs], sched.num_stages)
        for bounds in ([fastest] if balanced == fastest else [fastest, balanced]):
            chosen, twin, peak = _fit(costs, bounds, sched, budget, facts)
            label = f"{name} on {bounds}" + (f", microbatches in {pieces} pieces" if pieces > 1 else "")
            fits = peak <= budget
            tried.append((label, twin.step_s if fits else None, peak))
            if least is None or peak < least[0]:
                least = (peak, f"{label} with recompute full where it helps")
            if fits and (best is None or twin.step_s < best.twin.step_s):
                best = BudgetChoice(sched, list(bounds), [recompute_text(k) for k in chosen], twin, asked,
                                    pieces=pieces, costs=costs)
    if best is None:
        need = (f"{least[0] / (1 - HEADROOM) / 2**30:.3g} GiB ({least[1]}, {100 * HEADROOM:.0f}% kept free)" if least
                else "more than any schedule compiles for")
        raise PartitionError(f"no plan fits the memory budget of {asked / 2**30:.3g} GiB per rank: "
                             f"the least any schedule, recompute and split needs is {need}; raise --memory-budget "
                             f"or use more pipeline positions")
    best.tried = tried
    return best
