"""The dry run's search: pp x dp, schedule, recompute and microbatches for a cluster, scored by the twin.

[Note: the projection]
Given each layer's work (meta_costs.py), a world of ``nodes x gpus_per_node`` GPUs (hardware.py) and a global
batch, every candidate is

* **pp** a divisor of the world with at most as many stages as layers, **dp** = world / pp; the microbatches per
  replica m = global batch / (dp x micro batch). A global batch given is kept: a pp whose dp x micro batch does
  not divide it is skipped (said in the notes); the default one (about 4M tokens) is a target each pp rounds to
  the nearest multiple of its dp x micro batch (``Settings.round_batch``; a note says when the chosen plan's
  batch is not the target);
* **a schedule** of :data:`SCHEDULES` that builds for pp and m, checked at m itself also where the step is
  extended from smaller counts (``refusal``; one position: no schedule, "1f1b");
* **the split**: the exact min-max split of the layers' F + B + W (``balance_min_max``; the blocks are alike, so
  this is the equal split with the embedding and the head accounted), with several stages per position then
  balanced by position (:func:`_bounds`); not the planner's simulated search (too slow at pp 64);
* **recompute**: none if it fits, else the least-memory of full and every:K (the twin charges them the same time:
  B runs the stage's forward again).

Each is scored by the twin (``runtime/twin.py``, ``predict``): one process per GPU, the host's costs of a CUDA
rank (``HOST_CUDA``), the GPU's memory bandwidth for the optimizer's pass, the links of the world (hardware.py)
for the transfers and the all-reduce. The schedule is lowered once with the stages' mean costs (the engine's
compile also tries other lowerings and keeps the fastest: its step can be slightly shorter). When pp x m x chunks
exceeds :data:`ACTIONS`, the step is simulated at k pp and (k + 1) pp microbatches and extended linearly in m:
past the warm-up each microbatch adds the same time (within 0.1 % for :data:`EXTEND_FROM`'s k, checked by the
tests; v-half and v-min, whose synthesised orders are not regular, are then not tried). A candidate fits when the
twin's peak of its fullest position, plus autocast's bf16 copy of its weights, stays within the GPU's memory less
``reserve`` (the CUDA context, the communication library's buffers, the allocator's fragmentation: the twin does
not count them). The fitting candidate with the most tokens/s wins. Memory counts both copies of a tied weight
(the engine keeps one per entry of a tie, runtime/ties.py).

The search stays quick at 1,024 ranks: a candidate whose parameters, gradients and optimizer state alone do not
fit builds no schedule; candidates are taken in order of their busiest position's work (a lower bound of the
twin's step), and one whose bound passes the best step found is not simulated; v-half and v-min, slow
syntheses, are built only where they may fit without the recompute zbv needs (they save memory at more bubble),
and v-min only where v-half did not fit without recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from ..schedule.builders import default_chunks
from .hardware import GIB, World
from .meta_costs import LayerWork
from .scoring import ACTIONS, SAVERS, SCHEDULES, Candidate, Search, Settings

__all__ = ["Settings", "Candidate", "Projection", "NoFit", "project", "SCHEDULES", "plural"]


@dataclass
class Projection:
    """The chosen candidate, the fitting ones best first, and how the search went."""

    best: Candidate
    ranked: list[Candidate]
    scored: int
    notes: list[str]
    seconds: float
    parameters: int
    usable_bytes: float


class NoFit(ValueError):
    """No candidate fits the GPU's memory: the least any needed, and where."""

    def __init__(self, message: str, least: float) -> None:
        super().__init__(message)
        self.least = least


def plural(n: int, word: str) -> str:
    """``1 candidate``, ``2 candidates``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _shapes(world: World, layers: int, settings: Settings, notes: list[str]) -> list[tuple[int, int, int]]:
    """(pp, dp, microbatches per replica) of every pp the world and the global batch allow."""
    out, skipped = [], []
    for pp in (d for d in range(1, min(world.size, layers) + 1) if world.size % d == 0):
        dp = world.size // pp
        batch = settings.batch_for(dp)
        if batch is None:
            skipped.append(f"pp {pp} (dp {dp})")
            continue
        out.append((pp, dp, batch // (dp * settings.micro_batch)))
    if skipped:
        notes.append(f"skipped: {', '.join(skipped)}: the global batch of {settings.global_batch} is not a multiple of "
                     f"dp x micro batch ({settings.micro_batch})")
    if not out:
        unit = world.size // max(d for d in range(1, layers + 1) if world.size % d == 0) * settings.micro_batch
        raise ValueError(f"the global batch of {settings.global_batch} sequences is not a multiple of dp x micro "
                         f"batch for any pp on {world.size} GPUs: use a multiple of {unit}, e.g. --global-batch "
                         f"{-(-settings.global_batch // unit) * unit}")
    return out


def project(work: Sequence[LayerWork], world: World, settings: Settings) -> Projection:
    """The fastest fitting candidate (see [Note: the projection]); :class:`NoFit` when none fits."""
    start = time.perf_counter()
    notes: list[str] = []
    search = Search(work, world, settings)
    found: dict[tuple[int, str], Candidate] = {}
    rank = {name: i for i, name in enumerate(SCHEDULES)}   # zbv, v-half, v-min in this order at equal bounds
    order = sorted((search.work_bound(pp, m, name), pp, rank.get(name, 0), dp, m, name)
                   for pp, dp, m in _shapes(world, len(work), settings, notes)
                   for name in (SCHEDULES if pp > 1 else ("1f1b",))
                   if pp * default_chunks(name) <= len(work))
    beyond = saved = 0
    for bound, pp, _, dp, m, name in order:
        if found and bound >= min(c.step_s for c in found.values()):
            beyond += 1   # its busiest position's work alone is longer than the best step found
            continue
        if name in SAVERS and (_plain_fit(found, pp, name) or not search.saver_may_fit(name, pp, dp)):
            saved += 1    # a memory saver where it saves nothing: the same recompute or none, more bubble
            continue
        got = search.candidate(pp, dp, m, name)
        if got is not None:
            found[(pp, name)] = got
    ranked = sorted(found.values(), key=lambda c: (-c.tokens_per_s, c.peak))
    if not ranked:
        raise _no_fit(search, world, settings)
    notes.extend(_notes(search, ranked, beyond, saved))
    return Projection(ranked[0], ranked, search.scored, notes, time.perf_counter() - start,
                      sum(w.param_bytes - w.tied_bytes for w in work) // 4, search.cap)


def _plain_fit(found: dict[tuple[int, str], Candidate], pp: int, saver: str) -> bool:
    """Whether a schedule the memory saver ``saver`` saves memory of (its base in :data:`SAVERS`, or a saver before
    it in :data:`SCHEDULES`) fits at this pp without recompute: the saver could only add bubble."""
    lesser = [SAVERS[saver], *SCHEDULES[SCHEDULES.index(SAVERS[saver]) + 1:SCHEDULES.index(saver)]]
    return any((c := found.get((pp, name))) is not None and c.recompute is None for name in lesser)


def _notes(search: Search, ranked: Sequence[Candidate], beyond: int, saved: int) -> list[str]:
    """What the search left out or extended, and a hint where the chosen plan idles much."""
    out, best, s = [], ranked[0], search.settings
    if best.global_batch != s.global_batch:
        out.append(f"the global batch is {best.global_batch:,} sequences ({best.global_batch * s.context:,} tokens), "
                   f"not the {s.global_batch:,} aimed at: the nearest multiple of dp {best.dp} x micro batch "
                   f"{s.micro_batch}; each pp rounds it for its own dp (a runner-up's batch: its m x dp x micro batch)")
    elif any(c.global_batch != best.global_batch for c in ranked):
        out.append(f"a runner-up's global batch can differ from {best.global_batch:,}: each pp rounds the one aimed "
                   f"at to its own dp x micro batch (its m x dp x micro batch)")
    for name, (where, reason) in sorted(search.unbuilt.items()):
        why = reason.removeprefix(name + " ") or "the builder refuses them"
        out.append(f"not built: {name} at {', '.join(where)}: {why}")
    if any(len(c.simulated) == 2 for c in ranked):
        out.append(f"where pp x m x chunks is above {ACTIONS}, the step is simulated at two smaller counts and "
                   f"extended linearly in m")
    if search.unsimulated:
        out.append(f"not tried where pp x m x chunks is above {ACTIONS} (too long to simulate, not regular enough to "
                   f"extend): {', '.join(sorted(search.unsimulated))}")
    if beyond:
        out.append(f"{plural(beyond, 'candidate')} not simulated: their busiest position's work alone takes longer "
                   f"than the best step (so the runner-ups are the fastest of those simulated)")
    if saved:
        bases = ", ".join(sorted(set(SAVERS.values())))
        out.append(f"{plural(saved, 'memory saver')} ({', '.join(SAVERS)}) not built: estimated to need the recompute "
                   f"{bases} needs, or {bases} (or a lesser saver) fits without it")
    if best.bubble > 0.2 and best.pp > 1:
        out.append(f"the chosen plan idles {100 * best.bubble:.0f}% of the time: {best.microbatches} microbatches per "
                   f"replica through {best.pp} positions, and stages of unequal work; more microbatches per replica "
                   f"(a larger --global-batch) shrink the first part")
    return out


def _no_fit(search: Search, world: World, settings: Settings) -> NoFit:
    least, what = search.least_need()
    change = ["more GPUs (--nodes)", "a GPU with more memory (--gpu)"]
    if search.zero_would_fit:   # some dp > 1 candidate's excess is its optimizer state
        change.append("--zero 1 (the optimizer state sharded over dp)")
    if settings.micro_batch > 1:
        change.append("a smaller --micro-batch")
    return NoFit(f"nothing fits: the least any candidate needs is {least / GIB:.1f} GiB per GPU ({what}) against "
                 f"{search.cap / GIB:.1f} GiB usable of the {world.gpu.name}'s {world.gpu.memory_gib:g} GiB "
                 f"({100 * settings.reserve:.0f}% reserved); try {', '.join(change)}", least)
