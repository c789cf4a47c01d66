"""The split search: stage bounds for a layer list, by count, by parameters, by cost, or the simulated best.

Pure arithmetic over layer sizes and measured costs (no process group): :func:`partition` for the
simple methods, :func:`choose_bounds` for the split whose simulated step with a schedule is shortest.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import TYPE_CHECKING, Iterator, NoReturn, Sequence

from ..schedule import Costs, Schedule, simulate
from ..schedule.simulate import Dataflow
from .links import Links
from .measured import Choice, LayerCost, position_sizes, sized, with_transfers

if TYPE_CHECKING:   # the planner itself is torch-free: the schedule tool plans from given costs with it
    from torch import nn

__all__ = ["PartitionError", "METHODS", "balance_min_max", "even_bounds", "partition", "describe", "LayerCost",
           "Choice", "choose_bounds", "EXACT_LIMIT", "position_sizes"]

METHODS = ("profile", "parameters", "uniform", "cost")


class PartitionError(ValueError):
    """Layers that cannot be split as asked (too few layers, bad bounds, unknown method)."""


def balance_min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``num_parts`` non-empty parts minimising the largest part sum.

    Exact (dynamic programming over prefix sums, O(parts * n^2)), not greedy. Returns bounds of
    length ``num_parts + 1``. Ties are broken deterministically: every prefix keeps its earliest
    optimal cut, so the earlier stages are balanced too and, with equal weights, the later stages
    take the extra layers (the last stage also computes the loss).
    """
    n = len(weights)
    if num_parts < 1:
        raise PartitionError(f"need at least one part (got {num_parts})")
    if n < num_parts:
        raise PartitionError(f"{n} layers cannot fill {num_parts} stages (each stage needs >= 1 layer); "
                             f"use at most {n} stages or split the model into more layers")
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must be >= 0 (got {min(weights)})")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-part over splitting the first i weights into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:  # strict: keeps the earliest j among ties
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def even_bounds(n: int, num_stages: int) -> list[int]:
    """Equal layer counts per stage; the later stages take the extra layers (the last also computes the loss)."""
    base, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s >= num_stages - extra else 0))
    return bounds


def _param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in layer.parameters()}.values())


def partition(layers: Sequence[nn.Module], num_stages: int, method: str = "parameters", *,
              boundaries: Sequence[int] | None = None, costs: Sequence[float] | None = None) -> list[int]:
    """Stage bounds ``[0, b1, ..., len(layers)]``: stage s holds ``layers[bounds[s]:bounds[s+1]]``.

    ``boundaries`` (full bounds, num_stages + 1 entries) overrides ``method``. "uniform" balances
    layer counts (extra layers go to the later stages); "parameters" balances parameter counts
    (parameter-free layers weigh a little, so they still spread); "cost" balances ``costs``
    (e.g. each layer's total from :func:`profile_layers`).
    """
    n = len(layers)
    if boundaries is not None:
        b = list(boundaries)
        if len(b) != num_stages + 1 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in zip(b, b[1:])):
            example = partition(layers, num_stages, "uniform") if n >= num_stages else "(too few layers)"
            raise PartitionError(f"boundaries {b} must be {num_stages + 1} strictly increasing indices from 0 to "
                                 f"{n} (stage s holds layers[b[s]:b[s+1]]), e.g. {example}")
        return b
    if n < num_stages:
        raise PartitionError(f"{n} layers cannot fill {num_stages} stages (each stage needs >= 1 layer); "
                             f"use at most {n} stages or split the model into more layers")
    if method == "uniform":
        return even_bounds(n, num_stages)
    if method == "parameters":
        counts = [float(_param_count(layer)) for layer in layers]
        eps = max(1.0, sum(counts) / max(1, n) * 1e-3)
        return balance_min_max([c if c > 0 else eps for c in counts], num_stages)
    if method == "cost":
        if costs is None or len(costs) != n:
            raise PartitionError(f"method 'cost' needs one cost per layer ({n}), got "
                                 f"{'none' if costs is None else len(costs)}; see profile_layers()")
        return balance_min_max(list(costs), num_stages)
    if method == "profile":
        raise PartitionError("partition 'profile' measures the layers on the ranks: the engine does it "
                             "(PipelineEngine(..., partition='profile', sample=one microbatch))")
    raise PartitionError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)} "
                         f"or pass boundaries=")


def describe(layers: Sequence[nn.Module], bounds: Sequence[int]) -> str:
    """One line per stage: its layer range, parameter count and share of the total."""
    counts = [_param_count(layer) for layer in layers]
    total = max(1, sum(counts))
    lines = []
    for s in range(len(bounds) - 1):
        n = sum(counts[bounds[s]:bounds[s + 1]])
        lines.append(f"stage {s}: layers {bounds[s]}..{bounds[s + 1] - 1}  {n:,} params ({100 * n / total:.1f}%)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- by measured cost


class _Splits:
    """Contiguous splits of measured layers into a schedule's stages: their stage costs, memory and scores."""

    def __init__(self, costs: Sequence[LayerCost], schedule: Schedule, state_factor: float,
                 links: Links | None = None, sizes: Sequence[float] | None = None) -> None:
        self.costs, self.schedule, self.state_factor, self.links = costs, schedule, state_factor, links
        self.sizes = sized(sizes, schedule.microbatches)
        self.scale = sum(self.sizes) / schedule.microbatches if self.sizes else 1.0   # the step's work, relatively
        self.n, self.stages = len(costs), schedule.num_stages
        self.split = split = schedule.split_backward
        phases = [c.phases(split) for c in costs]
        self.prefix = [[0.0], [0.0], [0.0], [0.0]]   # f, b, w, total
        for f, b, w in phases:
            for k, x in enumerate((f, b, w, f + b + w)):
                self.prefix[k].append(self.prefix[k][-1] + x)
        self.stage_at = [[schedule.stage(p, c) for c in range(schedule.chunks)] for p in range(schedule.pp)]
        self.where = [schedule.placement(s)[0] for s in range(self.stages)]   # each stage's position
        self.peaks = simulate(schedule, Costs()).peak_in_flight
        self.timer = Dataflow(schedule)
        self.scored = 0

    def memory(self, bounds: Sequence[int]) -> list[float]:
        """Estimated peak bytes per position: state_factor x parameters + peak in flight x activations."""
        return [self.state_factor * params + self.peaks[p] * act
                for p, (params, act) in enumerate(position_sizes(self.costs, bounds, self.schedule))]

    def over(self, bounds: Sequence[int], cap: float | None) -> float:
        """Bytes the fullest position needs beyond the cap (0: it fits)."""
        return 0.0 if cap is None else max(0.0, max(self.memory(bounds)) - cap)

    def widest(self, bounds: Sequence[int]) -> float:
        t = self.prefix[3]
        return max(t[b] - t[a] for a, b in zip(bounds, bounds[1:]))

    def comm(self, bounds: Sequence[int]) -> list[float]:
        """[s]: seconds of a transfer between stage s and s + 1 (its last layer's output over their link)."""
        if self.links is None:
            return [0.0] * (self.stages - 1)
        return [self.links.seconds(self.where[s], self.where[s + 1], self.costs[bounds[s + 1] - 1].output_bytes)
                for s in range(self.stages - 1)]

    def stage_costs(self, bounds: Sequence[int]) -> list[tuple[float, float, float]]:
        f, b, w = self.prefix[:3]
        return [(f[z] - f[a], b[z] - b[a], w[z] - w[a]) for a, z in zip(bounds, bounds[1:])]

    def _table(self, bounds: Sequence[int]) -> list[list[tuple[float, float, float]]]:
        """Each stage's (F, B, W) durations as ``Dataflow`` takes them (a full backward runs b + w: the fused time)."""
        f, b, w = self.prefix[:3]
        return [[(f[bounds[s + 1]] - f[bounds[s]], b[bounds[s + 1]] - b[bounds[s]], w[bounds[s + 1]] - w[bounds[s]])
                 for s in row] for row in self.stage_at]

    def bound(self, bounds: Sequence[int]) -> float:
        """A lower bound of the makespan: the busiest position's work."""
        return max(self.timer.work(self._table(bounds))) * self.scale

    def quick(self, bounds: Sequence[int]) -> float:
        """The makespan under data dependencies alone, microbatches of one size (the search's score, see
        Dataflow): the sizes scale every stage alike, so they move the split little."""
        self.scored += 1
        return self.timer.makespan(self._table(bounds), self.comm(bounds))

    def exact(self, bounds: Sequence[int]) -> float:
        """The simulated makespan of the lowered schedule with each stage's own costs."""
        self.scored += 1
        return simulate(self.schedule, with_transfers(self.stage_costs(bounds), self.comm(bounds)),
                        sizes=self.sizes).makespan

    def choice(self, bounds: Sequence[int], makespan: float) -> Choice:
        return Choice(list(bounds), self.stage_costs(bounds), makespan, self.memory(bounds), self.scored,
                      self.schedule.split_backward, comm=self.comm(bounds))


EXACT_LIMIT = 2000   # splits: up to this many, every one is considered (pruned by its lower bound)


def choose_bounds(costs: Sequence[LayerCost], schedule: Schedule, memory_cap: float | None = None,
                  state_factor: float = 4.0, budget: int = 2000, links: Links | None = None,
                  sizes: Sequence[float] | None = None) -> Choice:
    """Contiguous stage bounds minimising the simulated makespan of ``schedule`` with these layer costs.

    Every stage is simulated with its own costs (never a position's mean: one position's chunks of
    1 and 9 layers differ from two of 5). When there are at most ``EXACT_LIMIT`` splits the search is
    exact: splits are taken in order of a lower bound (the busiest position's work) and simulated
    until the bound passes the best makespan found. Beyond that: the exact min-max split of the layer
    costs (dynamic programming) and the equal-count split are improved by moving one boundary at a
    time while the dependency-only makespan (:class:`Dataflow`) drops (then shaken and improved again until
    ``budget`` splits were scored), and the best few are simulated.
    A position's memory is estimated as ``state_factor`` x its parameter bytes (parameter, gradient,
    two Adam moments) plus its schedule's peak of microbatches in flight x the activation bytes of a
    microbatch; with ``memory_cap`` (bytes) no split above it is chosen. Ties go to the split with the
    smaller slowest stage, then to the earlier bounds. With ``links`` every transfer takes its link's time for
    the boundary layer's output ([Note: links in the plan], links.py), so a boundary may move to where the
    activation is small or the link fast. With ``sizes`` (each microbatch's cost relative to the measured one:
    microbatches of their own lengths) every split is simulated with them.
    """
    n, stages = len(costs), schedule.num_stages
    if n < stages:
        raise PartitionError(f"{n} layers cannot fill {stages} stages (each stage needs >= 1 layer)")
    splits = _Splits(costs, schedule, state_factor, links, sizes)
    best = (_exhaustive(splits, memory_cap) if math.comb(n - 1, stages - 1) <= EXACT_LIMIT
            else _local_search(splits, memory_cap, budget=budget))
    return _unless_noise(splits, best, memory_cap, noise(costs))


def noise(costs: Sequence[LayerCost]) -> float:
    """How far the measurement can be trusted: the median of the layers' relative spreads."""
    spreads = sorted(c.noise for c in costs)
    return spreads[len(spreads) // 2] if spreads else 0.0


def _unless_noise(splits: _Splits, best: Choice, cap: float | None, spread: float) -> Choice:
    """The equal split instead of ``best`` when ``best``'s predicted gain over it is inside the measurement's
    ``spread``: a gain the profile cannot tell from noise is not worth an uneven split."""
    even = even_bounds(splits.n, splits.stages)
    if spread <= 0 or best.bounds == even or splits.over(even, cap):
        return best
    makespan = splits.exact(even)
    gain = 1 - best.makespan / makespan
    if gain > spread:
        return best
    kept = splits.choice(even, makespan)
    kept.kept_equal = (f"the equal split kept: {best.bounds} was predicted {100 * gain:.1f}% faster, inside the "
                       f"profile's noise ({100 * spread:.1f}% spread between its timed runs)")
    return kept


def _every_split(n: int, stages: int) -> Iterator[list[int]]:
    for cuts in itertools.combinations(range(1, n), stages - 1):
        yield [0, *cuts, n]


def _exhaustive(splits: _Splits, cap: float | None) -> Choice:
    every = list(_every_split(splits.n, splits.stages))
    fits = [b for b in every if not splits.over(b, cap)]
    if not fits:
        _no_fit(splits, cap, min(every, key=lambda b: max(splits.memory(b))))
    best: tuple[float, float, list[int]] | None = None
    for low, bounds in sorted((splits.bound(b), b) for b in fits):
        if best is not None and low > best[0] * (1 + 1e-9):
            break   # no split from here on can beat the best: each needs at least its bound
        key = (splits.exact(bounds), splits.widest(bounds), bounds)
        if best is None or key < best:
            best = key
    assert best is not None
    return splits.choice(best[2], best[0])


def _local_search(splits: _Splits, cap: float | None, keep: int = 4, kicks: int = 8, budget: int = 2000) -> Choice:
    starts = [balance_min_max([c.total for c in splits.costs], splits.stages), even_bounds(splits.n, splits.stages)]
    seen: dict[tuple[int, ...], tuple[float, float]] = {}

    def score(b: list[int]) -> tuple[float, float]:
        key = tuple(b)
        if key not in seen:
            seen[key] = (splits.over(b, cap), splits.quick(b))
        return seen[key]

    def descend(current: list[int]) -> list[int]:
        improved = True
        while improved:   # first improvement, sweeping the boundaries
            improved = False
            for trial in _moves(current):
                if score(trial) < score(current):
                    current, improved = trial, True
        return current

    rng = random.Random(0)
    for start in starts:
        best = descend(list(start))
        for _ in range(kicks):   # iterated local search: shake a few boundaries, descend again
            if len(seen) >= budget:
                break
            shaken = _kick(best, rng)
            found = descend(shaken)
            if score(found) < score(best):
                best = found
    ranked = sorted(seen, key=lambda b: (seen[b], splits.widest(b), b))
    finalists: list[tuple[int, ...]] = list(dict.fromkeys([*ranked[:keep], *(tuple(s) for s in starts)]))
    fitting = [b for b in finalists if not seen[b][0]]
    if not fitting:
        _no_fit(splits, cap, list(min(seen.items(), key=lambda item: item[1][0])[0]))
    winner = min((splits.exact(b), splits.widest(b), list(b)) for b in fitting)
    return splits.choice(winner[2], winner[0])


def _moves(bounds: list[int]) -> Iterator[list[int]]:
    """Neighbours of a split: one boundary moved by 1 or 2, or two neighbouring boundaries moved together by 1
    (a stage shifted by a layer, or one layer taken from each side of a stage)."""
    last = len(bounds) - 1
    for i in range(1, last):
        for step in (-1, 1, -2, 2):
            if bounds[i - 1] < bounds[i] + step < bounds[i + 1]:
                yield bounds[:i] + [bounds[i] + step] + bounds[i + 1:]
        if i + 1 < last:
            for di, dj in ((-1, -1), (1, 1), (1, -1), (-1, 1)):
                x, y = bounds[i] + di, bounds[i + 1] + dj
                if bounds[i - 1] < x < y < bounds[i + 2]:
                    yield bounds[:i] + [x, y] + bounds[i + 2:]


def _kick(bounds: list[int], rng: random.Random) -> list[int]:
    """A split near ``bounds``: up to three boundaries moved by up to 3 layers (kept strictly increasing)."""
    out = list(bounds)
    for _ in range(3):
        i = rng.randrange(1, len(out) - 1)
        out[i] = min(max(out[i] + rng.choice((-3, -2, -1, 1, 2, 3)), out[i - 1] + 1), out[i + 1] - 1)
    return out


def _no_fit(splits: _Splits, cap: float | None, least: list[int]) -> NoReturn:
    assert cap is not None
    raise PartitionError(f"no split of the {splits.n} layers into {splits.stages} stages fits the memory cap of "
                         f"{cap / 2**30:.2f} GiB per position; the least is "
                         f"{max(splits.memory(least)) / 2**30:.2f} GiB (bounds {least}). Raise the cap, "
                         f"use more pipeline positions, or recompute (--recompute full)")
