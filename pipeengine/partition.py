"""Split an ordered layer list into pipeline stages: uniform, by parameters, by cost, or explicit bounds."""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["PartitionError", "balance_min_max", "partition", "split", "measure_costs", "describe"]

METHODS = ("parameters", "uniform", "cost")


class PartitionError(ValueError):
    """Layers that cannot be split as asked (too few layers, bad bounds, unknown method)."""


def _feasible(weights: Sequence[float], parts: int, cap: float) -> bool:
    count, acc = 1, 0.0
    for w in weights:
        if w > cap:
            return False
        if acc + w > cap:
            count, acc = count + 1, w
        else:
            acc += w
    return count <= parts


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
    (e.g. from :func:`measure_costs`).
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
                                 f"{'none' if costs is None else len(costs)}; see measure_costs()")
        return balance_min_max(list(costs), num_stages)
    raise PartitionError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)} "
                         f"or pass boundaries=")


def split(layers: Sequence[nn.Module], bounds: Sequence[int]) -> list[list[nn.Module]]:
    return [list(layers[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def measure_costs(layers: Sequence[nn.Module], sample_input: Any, repeats: int = 3) -> list[float]:
    """Median seconds of forward + backward of each layer, chaining the sample through the list."""
    costs: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats):
        x: Any = sample_input
        for i, layer in enumerate(layers):
            inputs = x if isinstance(x, tuple) else (x,)
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                           for t in inputs)
            t0 = time.perf_counter()
            out = layer(inputs if isinstance(x, tuple) else inputs[0])   # one argument, as nn.Sequential
            outs = out if isinstance(out, tuple) else (out,)
            floats = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            if floats:
                torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
            costs[i].append(time.perf_counter() - t0)
            x = tuple(o.detach() for o in outs) if isinstance(out, tuple) else out.detach()
    return [statistics.median(c) for c in costs]


def describe(layers: Sequence[nn.Module], bounds: Sequence[int]) -> str:
    """One line per stage: its layer range, parameter count and share of the total."""
    counts = [_param_count(layer) for layer in layers]
    total = max(1, sum(counts))
    lines = []
    for s in range(len(bounds) - 1):
        n = sum(counts[bounds[s]:bounds[s + 1]])
        lines.append(f"stage {s}: layers {bounds[s]}..{bounds[s + 1] - 1}  {n:,} params ({100 * n / total:.1f}%)")
    return "\n".join(lines)
