"""One candidate of the dry run scored by the twin: its split, its schedule, its recompute and its memory.

See [Note: the projection] in projection.py, which searches the candidates this module scores.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Sequence

from ..runtime.budget import recompute_text
from ..runtime.measured import LayerCost
from ..runtime.planner import balance_min_max
from ..runtime.twin import HOST_CUDA, MemoryParts, predict, stage_memory
from ..schedule import Costs, Schedule, build_schedule, lower
from ..schedule.builders import PLACEMENT, default_chunks, synthesis_caps
from ..schedule.simulate import in_flight_peaks
from .hardware import World
from .meta_costs import LayerWork, layer_costs

__all__ = ["Settings", "Candidate", "Search", "SCHEDULES", "ACTIONS", "CHECK_ACTIONS", "EXTEND_FROM", "SAVERS",
           "simulated_counts", "split", "refusal"]

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zbv", "v-half", "v-min")   # runtime/budget.py's SHAPES
ACTIONS = 1024       # pp x m x chunks simulated in full; beyond, two smaller counts and a linear extension
CHECK_ACTIONS = 2**14   # pp x m x chunks up to which an extended candidate's real count is built to check it builds
# memory savers, each tried only where it may fit without the recompute the schedule named needs (the savers are
# in SCHEDULES' order, least saving first: one is also left out where a lesser saver fits without recompute)
SAVERS = {"v-half": "zbv", "v-min": "zbv"}
EXTEND_FROM = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 4, "zbv": 2}


@dataclass(frozen=True)
class Settings:
    """What the run will be: sequences per step and per microbatch, tokens per sequence, and the assumptions.

    ``global_batch`` is exact (a pp whose dp x micro batch does not divide it is skipped) unless ``round_batch``:
    then it is a target each pp rounds to the nearest multiple of its dp x micro batch (at least one)."""

    global_batch: int
    micro_batch: int
    context: int
    mfu: float = 0.5           # the fraction of the GPU's peak the layers' kernels reach
    reserve: float = 0.10      # of the GPU's memory, left for what the twin does not count
    zero: bool = False         # ZeRO-1: the optimizer state sharded over dp
    round_batch: bool = False  # global_batch a target, rounded per pp (the dry run's default batch)

    def batch_for(self, dp: int) -> int | None:
        """The global batch at this dp: the target rounded (``round_batch``), else it if dp x micro batch divides
        it, else None."""
        unit = dp * self.micro_batch
        if self.round_batch:
            return max(1, (2 * self.global_batch + unit) // (2 * unit)) * unit   # nearest, halves up
        return None if self.global_batch % unit else self.global_batch


@dataclass
class Candidate:
    """One scored configuration: its shape, the twin's step and its parts, and memory per position."""

    pp: int
    dp: int
    schedule: str
    chunks: int
    recompute: int | None      # None: none, 0: full, K: every K layers
    microbatches: int
    global_batch: int          # sequences a step: microbatches x dp x micro batch
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
        return recompute_text(self.recompute)


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


def refusal(name: str, pp: int, microbatches: int) -> str | None:
    """Why the builder refuses schedule ``name`` at pp and this many microbatches (None: it builds). The unlowered
    schedule is built at the count itself while pp x m x chunks is at most :data:`CHECK_ACTIONS` (milliseconds for
    the hand-written builders, the ones a step is extended for); beyond, at m mod pp (or pp): the builders' rules see
    m only through its residue modulo pp (interleaved-1f1b's groups of pp), and the count itself could take
    seconds: at the least count of that residue."""
    if pp * microbatches * default_chunks(name) > CHECK_ACTIONS:
        microbatches = microbatches % pp or pp
    try:
        build_schedule(name, pp, microbatches)
    except ValueError as e:
        return str(e)
    return None


class Search:
    """The candidates of one world and model, scored lazily (schedules built once per pp, m and name)."""

    def __init__(self, work: Sequence[LayerWork], world: World, settings: Settings) -> None:
        self.work, self.world, self.settings = list(work), world, settings
        self.costs: list[LayerCost] = layer_costs(work, world.gpu.tflops, settings.mfu)
        self.totals = tuple(c.total for c in self.costs)
        self.cap = world.gpu.memory_bytes * (1 - settings.reserve)
        self.input_bytes = 8.0 * settings.micro_batch * settings.context   # int64 token ids
        self.least: tuple[float, str] | None = None   # the least peak any candidate needed, and which
        # state alone too large: (state, its state under ZeRO-1, pp, dp, m, name, bounds)
        self.pruned: list[tuple[float, float, int, int, int, str, tuple[int, ...]]] = []
        self.zero_would_fit = False   # some dp > 1 candidate that did not fit would with its optimizer state sharded
        self.scored = 0
        self.unsimulated: set[str] = set()   # schedules left out where their step was too long to simulate
        self.unbuilt: dict[str, tuple[list[str], str]] = {}   # schedule -> where its builder refused, and why
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
        options = [(self.memory(bounds, schedule, dp, r), r) for r in self.recompute_options(bounds)]
        peak, best = min(((max(m.total for m in mems), r) for mems, r in options), key=lambda o: (o[0], o[1]))
        self.need(peak, f"{what}, recompute {recompute_text(best)}")
        if peak > self.cap and dp > 1 and not self.settings.zero:   # the excess the optimizer state over dp removes
            self.zero_would_fit |= min(self._zeroed(mems, dp) for mems, _ in options) <= self.cap
        return best if peak <= self.cap else ""

    @staticmethod
    def _zeroed(memory: Sequence[MemoryParts], dp: int) -> float:
        """The fullest position's peak with its optimizer state sharded over dp (ZeRO-1)."""
        return max(m.total - m.optimizer * (1 - 1 / dp) for m in memory)

    def state(self, bounds: Sequence[int], name: str, pp: int, dp: int) -> tuple[float, float]:
        """The fullest position's parameters, gradients, optimizer state and weight copies (no schedule built): as the
        settings shard the optimizer state, and sharded over dp (what ZeRO-1 would leave)."""
        bare = self.memory(bounds, _bare(name, pp), dp, None)
        return max(m.total for m in bare), self._zeroed(bare, dp)

    def _orders(self, name: str, pp: int, m: int, counts: tuple[int, ...], mean: Costs) -> list[Schedule] | None:
        """The schedules to simulate, built at ``counts``, or None when the builder refuses the real count m (checked
        by :func:`refusal` where the counts are not m itself) or those."""
        try:
            reason = refusal(name, pp, m) if counts != (m,) else None
            orders = None if reason else [build_schedule(name, pp, c, costs=mean) for c in counts]
        except ValueError as e:   # does not apply to this pp and m (interleaved-1f1b: m a multiple of pp)
            reason, orders = str(e), None
        if orders is None:
            where, _ = self.unbuilt.setdefault(name, ([], (reason or "").split(" (got")[0].split(":")[0]))
            where.append(f"pp {pp} (m {m})")
        return orders

    def candidate(self, pp: int, dp: int, m: int, name: str) -> Candidate | None:
        """The scored candidate, or None when it does not build, has too few layers or does not fit."""
        chunks = default_chunks(name)
        if pp * chunks > len(self.costs):
            return None
        bounds = split(self.totals, name, pp)
        state, zeroed = self.state(bounds, name, pp, dp)
        if state > self.cap:   # no schedule and no recompute can help: scored only if nothing fits (least_need)
            self.pruned.append((state, zeroed, pp, dp, m, name, bounds))
            return None
        counts = simulated_counts(name, pp, m, chunks)
        if counts is None:
            self.unsimulated.add(name)
            return None
        mean = self.mean_costs(name, pp, bounds, dp)
        orders = self._orders(name, pp, m, counts, mean)   # memory needs only the order; lowering it (the slow
        if orders is None:                                 # part) waits until it fits
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
        """The least peak of any candidate (those whose state alone was too large measured now, least first; and
        those ZeRO-1 may bring within the memory, to say whether it would)."""
        for state, zeroed, pp, dp, m, name, bounds in sorted(self.pruned):
            lesser = self.least is None or state < self.least[0]
            if not lesser and (self.zero_would_fit or self.settings.zero or dp == 1 or zeroed > self.cap):
                continue
            counts = simulated_counts(name, pp, m, default_chunks(name))
            orders = self._orders(name, pp, m, counts[-1:], self.mean_costs(name, pp, bounds, dp)) if counts \
                else None
            if orders is not None:
                self.fitting(bounds, orders[0], dp, f"pp {pp} x dp {dp}, {name}")
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
        batch = m * dp * s.micro_batch
        bubble = max(0.0, 1 - sum(busy) / len(busy) / parts["compute"])   # rounding: -1e-16 at pp 1
        return Candidate(pp, dp, schedule.name, schedule.chunks, recompute, m, batch, step, parts,
                         self.memory(bounds, schedule, dp, recompute), bubble, batch * s.context / step, tflops,
                         tflops / world.gpu.tflops, tuple(counts), list(bounds))

    def busy(self, bounds: Sequence[int], schedule: Schedule, recompute: int | None, m: int) -> list[float]:
        """Each position's compute in a step: its stages' F, B and W (and F again under recompute), m times."""
        out = []
        for p in range(schedule.pp):
            layers = [c for k in range(schedule.chunks)
                      for c in self.costs[bounds[schedule.stage(p, k)]:bounds[schedule.stage(p, k) + 1]]]
            out.append(m * sum(c.total + (c.f if recompute is not None else 0.0) for c in layers))
        return out
