"""One candidate of the dry run scored by the twin: its split, its schedule, its recompute and its memory.

See [Note: the projection] in projection.py, which searches the candidates this module scores.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Sequence

from ..runtime.measured import LayerCost
from ..runtime.planner import balance_min_max
from ..runtime.twin import HOST_CUDA, MemoryParts, predict, stage_memory
from ..schedule import Costs, Schedule, build_schedule, lower
from ..schedule.builders import PLACEMENT, default_chunks, synthesis_caps
from ..schedule.simulate import in_flight_peaks
from .hardware import World
from .meta_costs import LayerWork, layer_costs

__all__ = ["Settings", "Candidate", "Search", "SCHEDULES", "ACTIONS", "EXTEND_FROM", "SAVERS", "simulated_counts",
           "split"]

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv", "v-half")
ACTIONS = 1024       # pp x m x chunks simulated in full; beyond, two smaller counts and a linear extension
SAVERS = {"v-half": "zbv"}   # tried only where it may fit without the recompute the other one needs
EXTEND_FROM = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 4, "zbv": 2}


@dataclass(frozen=True)
class Settings:
    """What the run will be: sequences per step and per microbatch, tokens per sequence, and the assumptions."""

    global_batch: int
    micro_batch: int
    context: int
    mfu: float = 0.5           # the fraction of the GPU's peak the layers' kernels reach
    reserve: float = 0.10      # of the GPU's memory, left for what the twin does not count
    zero: bool = False         # ZeRO-1: the optimizer state sharded over dp
    schedules: tuple[str, ...] = SCHEDULES


@dataclass
class Candidate:
    """One scored configuration: its shape, the twin's step and its parts, and memory per position."""

    pp: int
    dp: int
    schedule: str
    chunks: int
    recompute: int | None      # None: none, 0: full, K: every K layers
    microbatches: int
    step_s: float
    parts: dict[str, float]
    memory: list[MemoryParts]
    bubble: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    simulated: tuple[int, ...] = ()   # the microbatch counts simulated (two: extended linearly)
    bounds: list[int] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def fullest(self) -> MemoryParts:
        return max(self.memory, key=lambda m: m.total)

    @property
    def recompute_text(self) -> str:
        return "none" if self.recompute is None else "full" if self.recompute == 0 else f"every:{self.recompute}"


def _bare(name: str, pp: int) -> Schedule:
    """A schedule with no actions: the placement of ``name``'s stages, for what depends on nothing else."""
    return Schedule(name, pp, 1, default_chunks(name), [[] for _ in range(pp)],
                    placement_kind=PLACEMENT.get(name, "loop"))


@functools.lru_cache(maxsize=256)
def _bounds(totals: tuple[float, ...], pp: int, chunks: int, placement: str) -> tuple[int, ...]:
    """The split: the exact min-max split of the layers' F + B + W into the stages, then, with several stages per
    position, boundaries moved one layer at a time while that lowers the busiest position's work (then the sum of
    squares of the positions' work): a position's stages together are what must balance (cached)."""
    stages = pp * chunks
    bounds = balance_min_max(list(totals), stages)
    if chunks == 1:
        return tuple(bounds)
    placed = Schedule("", pp, 1, chunks, [[] for _ in range(pp)], placement_kind=placement)
    owner = [placed.placement(s)[0] for s in range(stages)]
    prefix = [0.0]
    for t in totals:
        prefix.append(prefix[-1] + t)

    def score(b: Sequence[int]) -> tuple[float, float]:
        loads = [0.0] * pp
        for s in range(stages):
            loads[owner[s]] += prefix[b[s + 1]] - prefix[b[s]]
        return max(loads), sum(x * x for x in loads)

    best, improved = score(bounds), True
    while improved:
        improved = False
        for i in range(1, stages):
            for step in (-1, 1):
                if bounds[i - 1] < bounds[i] + step < bounds[i + 1]:
                    bounds[i] += step
                    trial = score(bounds)
                    if trial < best:
                        best, improved = trial, True
                    else:
                        bounds[i] -= step
    return tuple(bounds)


def split(totals: tuple[float, ...], name: str, pp: int) -> tuple[int, ...]:
    """Stage bounds of schedule ``name`` at pp for layers of these F + B + W (see :func:`_bounds`)."""
    return _bounds(totals, pp, default_chunks(name), PLACEMENT.get(name, "loop"))


def simulated_counts(name: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...] | None:
    """The microbatch counts the step is simulated at: all of them while pp x m x chunks is at most
    :data:`ACTIONS`, else k pp and (k + 1) pp to extend linearly from (k of :data:`EXTEND_FROM`: where the step is
    linear in m within 0.1 %, tests/training/test_projection.py), or None: too long to simulate and not regular
    enough to extend (the synthesised v-half)."""
    if pp * microbatches * chunks <= ACTIONS:
        return (microbatches,)
    k = EXTEND_FROM.get(name)
    if k is None:
        return None
    return (microbatches,) if microbatches <= (k + 1) * pp else (k * pp, (k + 1) * pp)


class Search:
    """The candidates of one world and model, scored lazily (schedules built once per pp, m and name)."""

    def __init__(self, work: Sequence[LayerWork], world: World, settings: Settings) -> None:
        self.work, self.world, self.settings = list(work), world, settings
        self.costs: list[LayerCost] = layer_costs(work, world.gpu.tflops, settings.mfu)
        self.totals = tuple(c.total for c in self.costs)
        self.cap = world.gpu.memory_bytes * (1 - settings.reserve)
        self.input_bytes = 8.0 * settings.micro_batch * settings.context   # int64 token ids
        self.least: tuple[float, str] | None = None   # the least peak any candidate needed, and which
        self.pruned: list[tuple[float, int, int, int, str, tuple[int, ...]]] = []   # state alone too large
        self.scored = 0
        self.unsimulated: set[str] = set()   # schedules left out where their step was too long to simulate
        self.built: dict[tuple[str, int], Schedule] = {}   # (name, pp): the last schedule built

    def need(self, peak: float, what: str) -> None:
        if self.least is None or peak < self.least[0]:
            self.least = (peak, what)

    def memory(self, bounds: Sequence[int], schedule: Schedule, dp: int, recompute: int | None) -> list[MemoryParts]:
        """The twin's peak per position, autocast's bf16 weight copies added to the buffers."""
        twin = stage_memory(self.costs, bounds, schedule, shards=dp if self.settings.zero else 1, recompute=recompute,
                            input_bytes=self.input_bytes)
        return [dataclasses.replace(m, buffers=m.buffers + self._casts(bounds, schedule, p))
                for p, m in enumerate(twin)]

    def _casts(self, bounds: Sequence[int], schedule: Schedule, p: int) -> float:
        stages = [schedule.stage(p, c) for c in range(schedule.chunks)]
        return float(sum(self.work[i].cast_bytes for s in stages for i in range(bounds[s], bounds[s + 1])))

    def recompute_options(self, bounds: Sequence[int]) -> list[int]:
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        return [0] + [k for k in (1, 2, 4, 8) if k < longest]

    def fitting(self, bounds: Sequence[int], schedule: Schedule, dp: int, what: str) -> int | None | str:
        """The recompute policy to run (None: none) or "" when nothing fits."""
        plain = self.memory(bounds, schedule, dp, None)
        if max(m.total for m in plain) <= self.cap:
            return None
        options = [(max(m.total for m in self.memory(bounds, schedule, dp, r)), r)
                   for r in self.recompute_options(bounds)]
        peak, best = min(options, key=lambda o: (o[0], o[1]))
        self.need(peak, f"{what}, recompute {'full' if best == 0 else f'every:{best}'}")
        return best if peak <= self.cap else ""

    def state(self, bounds: Sequence[int], name: str, pp: int, dp: int) -> float:
        """The fullest position's parameters, gradients, optimizer state and weight copies (no schedule built)."""
        return max(m.total for m in self.memory(bounds, _bare(name, pp), dp, None))

    def candidate(self, pp: int, dp: int, m: int, name: str) -> Candidate | None:
        """The scored candidate, or None when it does not build, has too few layers or does not fit."""
        chunks = default_chunks(name)
        if pp * chunks > len(self.costs):
            return None
        bounds = split(self.totals, name, pp)
        state = self.state(bounds, name, pp, dp)
        if state > self.cap:   # no schedule and no recompute can help: scored only if nothing fits (least_need)
            self.pruned.append((state, pp, dp, m, name, bounds))
            return None
        counts = simulated_counts(name, pp, m, chunks)
        if counts is None:
            self.unsimulated.add(name)
            return None
        mean = self.mean_costs(name, pp, bounds, dp)
        try:   # memory needs only the order; lowering it (the slow part) waits until it fits
            orders = [build_schedule(name, pp, c, costs=mean) for c in counts]
        except ValueError:   # does not apply to this pp and m (interleaved-1f1b: m a multiple of pp)
            return None
        self.built[(name, pp)] = orders[-1]
        recompute = self.fitting(bounds, orders[-1], dp, f"pp {pp} x dp {dp}, {name}")
        if recompute == "":
            return None
        assert not isinstance(recompute, str)
        return self.score(pp, dp, m, [lower(order, mean) for order in orders], bounds, recompute)

    def saver_may_fit(self, name: str, pp: int, dp: int) -> bool:
        """Whether the memory saver ``name`` (of :data:`SAVERS`) might fit without recompute where the schedule it
        saves memory of did not: that schedule's activations scaled to the saver's cap of microbatches in flight
        (``synthesis_caps``), an estimate made before the saver's slow synthesis. With recompute it could not win:
        the same recompute, more bubble."""
        base = self.built.get((SAVERS[name], pp))
        if base is None:
            return True
        bounds = split(self.totals, base.name, pp)
        caps = synthesis_caps(name, pp, base.microbatches, base.chunks)
        held = in_flight_peaks(base)
        estimate = [m.total - m.activations * (1 - min(1.0, cap / max(1, h)))
                    for m, cap, h in zip(self.memory(bounds, base, dp, None), caps, held)]
        return max(estimate) <= self.cap

    def work_bound(self, pp: int, m: int, name: str) -> float:
        """The busiest position's compute in a step, m x its stages' F + B + W: the twin's step is no shorter."""
        placed = _bare(name, pp)
        return max(self.busy(split(self.totals, name, pp), placed, None, m))

    def least_need(self) -> tuple[float, str]:
        """The least peak of any candidate (those whose state alone was too large measured now, least first)."""
        for state, pp, dp, m, name, bounds in sorted(self.pruned):
            if self.least is not None and state >= self.least[0]:
                break
            counts = simulated_counts(name, pp, m, default_chunks(name))
            try:
                order = build_schedule(name, pp, counts[-1], costs=self.mean_costs(name, pp, bounds, dp)) if counts \
                    else None
            except ValueError:
                order = None
            if order is not None:
                self.fitting(bounds, order, dp, f"pp {pp} x dp {dp}, {name}")
        if self.least is None:
            raise ValueError("no schedule applies to any pp of this world and global batch")
        return self.least

    def mean_costs(self, name: str, pp: int, bounds: Sequence[int], dp: int) -> Costs:
        """A stage's mean F, B, W and transfer between positions: what the schedule is lowered with (as the engine's
        compile lowers it), and what a synthesised one is built for."""
        placed, links, stages = _bare(name, pp), self.world.links(pp, dp), len(bounds) - 1
        hops = [links.seconds(placed.placement(s)[0], placed.placement(s + 1)[0],
                              self.costs[bounds[s + 1] - 1].output_bytes) for s in range(stages - 1)]
        hops = [h for h in hops if h > 0]
        f, b, w = (sum(c.phases(True)[k] for c in self.costs) / stages for k in range(3))
        return Costs(f, b, w, sum(hops) / len(hops) if hops else 0.0)

    def score(self, pp: int, dp: int, m: int, schedules: Sequence[Schedule], bounds: Sequence[int],
              recompute: int | None) -> Candidate:
        """The twin's step for m microbatches (extended linearly from the simulated counts), and its figures."""
        world, s = self.world, self.settings
        twins = [predict(self.costs, bounds, schedule, dp=dp, links=world.links(pp, dp), recompute=recompute,
                         optimizer_states=2, zero=s.zero, input_bytes=self.input_bytes, processes=1, cores=1.0,
                         host=HOST_CUDA, optimizer_bandwidth=world.gpu.memory_gbs * 1e9,
                         dp_bandwidth=world.dp_bandwidth(pp, dp)) for schedule in schedules]
        self.scored += len(twins)
        counts = [sch.microbatches for sch in schedules]
        parts = dict(twins[-1].parts)
        if len(twins) == 2:   # linear in m past the warm-up: compute and the host's part grow, the rest does not
            for k in ("compute", "host"):
                slope = (twins[1].parts[k] - twins[0].parts[k]) / (counts[1] - counts[0])
                parts[k] = twins[1].parts[k] + slope * (m - counts[1])
        step = sum(parts.values())
        schedule = schedules[-1]
        busy = self.busy(bounds, schedule, recompute, m)
        work = sum(w.flops for w in self.work) * m * dp   # the model's FLOPs in a step (recompute not counted)
        tflops = work / step / world.size / 1e12
        return Candidate(pp, dp, schedule.name, schedule.chunks, recompute, m, step, parts,
                         self.memory(bounds, schedule, dp, recompute), 1 - sum(busy) / len(busy) / parts["compute"],
                         s.global_batch * s.context / step, tflops, tflops / world.gpu.tflops, tuple(counts),
                         list(bounds))

    def busy(self, bounds: Sequence[int], schedule: Schedule, recompute: int | None, m: int) -> list[float]:
        """Each position's compute in a step: its stages' F, B and W (and F again under recompute), m times."""
        out = []
        for p in range(schedule.pp):
            layers = [c for k in range(schedule.chunks)
                      for c in self.costs[bounds[schedule.stage(p, k)]:bounds[schedule.stage(p, k) + 1]]]
            out.append(m * sum(c.total + (c.f if recompute is not None else 0.0) for c in layers))
        return out
