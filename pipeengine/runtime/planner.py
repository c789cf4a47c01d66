"""The split search: stage bounds for a layer list, by count, by parameters, by cost, or the simulated best.

Pure arithmetic over layer sizes and measured costs (no process group): :func:`partition` for the
simple methods, :func:`choose_bounds` for the split whose simulated step with a schedule is shortest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from ..schedule import Costs, Schedule, simulate

__all__ = ["PartitionError", "METHODS", "balance_min_max", "partition", "describe", "LayerCost", "Choice",
           "choose_bounds", "position_costs"]

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
        base, extra = divmod(n, num_stages)
        sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return bounds
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

@dataclass
class LayerCost:
    """One layer on one microbatch, as the engine runs it: seconds of F, of B and W (split backward, see
    stage.py) and of the fused backward, the bytes it keeps for backward (its output included) and the
    bytes of its parameters."""

    f: float
    b: float
    w: float
    fused: float
    activation_bytes: int
    param_bytes: int

    @property
    def total(self) -> float:
        return self.f + self.b + self.w

    def phases(self, split: bool) -> tuple[float, float, float]:
        """(f, b, w) as the simulator takes them: without a split, B runs b + w = the fused backward."""
        return (self.f, self.b, self.w) if split else (self.f, max(0.0, self.fused - self.w), self.w)


@dataclass
class Choice:
    """What the profile partition chose: bounds, the per-stage costs (seconds per microbatch) and the
    simulated step (seconds, compute only) and peak memory estimate per position (bytes)."""

    bounds: list[int]
    stage_costs: list[tuple[float, float, float]]
    makespan: float
    memory: list[float]
    candidates: int
    split: bool = False   # the schedule splits backward into B and W

    def mean_costs(self) -> Costs:
        """One stage's average F, B and W: what the schedule is lowered with."""
        n = len(self.stage_costs)
        return Costs(*(sum(c[k] for c in self.stage_costs) / n for k in range(3)))

    def describe(self, schedule_name: str) -> str:
        lines = [f"partition profile: bounds {self.bounds} (best of {self.candidates} simulated splits), "
                 f"predicted compute per step {1e3 * self.makespan:.1f} ms with {schedule_name}"]
        for s, (f, b, w) in enumerate(self.stage_costs):
            back = f"B {1e3 * b:.2f} ms  W {1e3 * w:.2f} ms" if self.split else f"backward {1e3 * (b + w):.2f} ms"
            lines.append(f"  stage {s}: layers {self.bounds[s]}..{self.bounds[s + 1] - 1}  per microbatch "
                         f"F {1e3 * f:.2f} ms  {back}")
        lines.append("  peak memory estimate per position: " + ", ".join(f"{m / 2**30:.2f} GiB" for m in self.memory))
        return "\n".join(lines)


def position_costs(stage_costs: Sequence[tuple[float, float, float]], schedule: Schedule) -> list[Costs]:
    """Per position, the simulator's costs of one of its stages: the mean of its stages' (f, b, w)."""
    out = []
    for p in range(schedule.pp):
        mine = [c for s, c in enumerate(stage_costs) if schedule.placement(s)[0] == p]
        out.append(Costs(*(sum(x[k] for x in mine) / len(mine) for k in range(3))))
    return out


class _Splits:
    """Contiguous splits of measured layers into a schedule's stages: their widths, memory and stage costs."""

    def __init__(self, costs: Sequence[LayerCost], schedule: Schedule, state_factor: float) -> None:
        self.costs, self.schedule, self.state_factor = costs, schedule, state_factor
        self.n, self.stages = len(costs), schedule.num_stages
        self.prefix = [0.0]
        for c in costs:
            self.prefix.append(self.prefix[-1] + c.total)
        self.placement = [schedule.placement(s)[0] for s in range(self.stages)]
        self.peaks = simulate(schedule, Costs()).peak_in_flight

    def memory(self, bounds: list[int]) -> list[float]:
        """Estimated peak bytes per position: state_factor x parameters + peak in flight x activations."""
        mem = [0.0] * self.schedule.pp
        act = [0.0] * self.schedule.pp
        for s in range(self.stages):
            p = self.placement[s]
            layer = self.costs[bounds[s]:bounds[s + 1]]
            mem[p] += self.state_factor * sum(c.param_bytes for c in layer)
            act[p] = max(act[p], float(sum(c.activation_bytes for c in layer)))
        return [m + self.peaks[p] * act[p] for p, m in enumerate(mem)]

    def widest(self, bounds: list[int]) -> float:
        return max(self.prefix[b] - self.prefix[a] for a, b in zip(bounds, bounds[1:]))

    def enumerate(self, limit: float, most: int = 100_000) -> list[list[int]]:
        """Splits whose every stage costs at most ``limit`` (depth first, at most ``most``)."""
        found: list[list[int]] = []
        n, stages, prefix = self.n, self.stages, self.prefix

        def rec(start: int, s: int, acc: list[int]) -> None:
            if len(found) >= most:
                return
            if s == stages - 1:
                if prefix[n] - prefix[start] <= limit:
                    found.append(acc + [n])
                return
            for end in range(start + 1, n - (stages - 1 - s) + 1):
                if prefix[end] - prefix[start] > limit:
                    break
                rec(end, s + 1, acc + [end])
        rec(0, 0, [0])
        return found

    def stage_costs(self, bounds: list[int]) -> list[tuple[float, float, float]]:
        split = self.schedule.split_backward
        out = []
        for s in range(self.stages):
            phases = [c.phases(split) for c in self.costs[bounds[s]:bounds[s + 1]]]
            out.append((sum(x[0] for x in phases), sum(x[1] for x in phases), sum(x[2] for x in phases)))
        return out


def choose_bounds(costs: Sequence[LayerCost], schedule: Schedule, memory_cap: float | None = None,
                  state_factor: float = 4.0, max_candidates: int = 300) -> Choice:
    """Contiguous stage bounds minimising the simulated makespan of ``schedule`` with these layer costs.

    Candidates: every split whose slowest stage is within 1.5x of the best possible slowest stage
    (the ``max_candidates`` most balanced if there are more), each simulated (the first and last
    stage carry their data and loss work, which the layer costs include). A position's memory is
    estimated as ``state_factor`` x its parameter bytes (parameter, gradient, two Adam moments) plus
    its schedule's peak of microbatches in flight x the activation bytes of a microbatch; with
    ``memory_cap`` (bytes) splits above it are left out.
    """
    n, stages = len(costs), schedule.num_stages
    if n < stages:
        raise PartitionError(f"{n} layers cannot fill {stages} stages (each stage needs >= 1 layer)")
    splits = _Splits(costs, schedule, state_factor)
    candidates = splits.enumerate(1.5 * splits.widest(balance_min_max([c.total for c in costs], stages)) + 1e-12)
    if memory_cap is not None:
        candidates = [b for b in candidates if max(splits.memory(b)) <= memory_cap]
        if not candidates:   # the cap may need an unbalanced split
            every = splits.enumerate(float("inf"))
            candidates = [b for b in every if max(splits.memory(b)) <= memory_cap]
            if not candidates:
                least = min(every, key=lambda b: max(splits.memory(b)))
                raise PartitionError(f"no split of the {n} layers into {stages} stages fits the memory cap of "
                                     f"{memory_cap / 2**30:.2f} GiB per position; the least is "
                                     f"{max(splits.memory(least)) / 2**30:.2f} GiB (bounds {least}). Raise the cap, "
                                     f"use more pipeline positions, or recompute (--recompute full)")
    candidates = sorted(candidates, key=lambda b: (splits.widest(b), b))[:max_candidates]
    scored = []
    for bounds in candidates:
        per_stage = splits.stage_costs(bounds)
        makespan = simulate(schedule, position_costs(per_stage, schedule)).makespan
        scored.append((makespan, splits.widest(bounds), bounds, per_stage))
    makespan, _, bounds, per_stage = min(scored, key=lambda x: (x[0], x[1], x[2]))
    return Choice(list(bounds), per_stage, makespan, splits.memory(bounds), len(scored), schedule.split_backward)
