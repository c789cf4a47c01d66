"""The split search: exact min-max balance, the simple methods, the simulated best split, and errors."""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from pipeengine.runtime.planner import LayerCost, PartitionError, balance_min_max, choose_bounds, describe, partition
from pipeengine.schedule import Costs, compile_schedule, simulate


def brute_force(weights: list[float], k: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        best = min(best, max(sum(weights[b[i]:b[i + 1]]) for i in range(k)))
    return best


def test_balance_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        w = [float(rng.randint(0, 20)) for _ in range(n)]
        b = balance_min_max(w, k)
        assert len(b) == k + 1 and b[0] == 0 and b[-1] == n and all(x < y for x, y in zip(b, b[1:]))
        assert max(sum(w[b[i]:b[i + 1]]) for i in range(k)) == brute_force(w, k)


def test_balance_literals_and_tie_break() -> None:
    assert balance_min_max([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [0, 5, 7, 9]
    assert balance_min_max([1] * 10, 4) == [0, 2, 4, 7, 10]   # ties: later stages take the extra layers
    assert balance_min_max([5, 1], 2) == [0, 1, 2]


def test_methods() -> None:
    layers = [nn.Linear(10, 10), nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10)]
    assert partition(layers, 2, "uniform") == [0, 2, 5]
    assert partition(layers, 2, "parameters") == [0, 2, 5]   # 110+1100 | eps+1010+110
    assert partition(layers, 3, "cost", costs=[1, 1, 1, 1, 10]) == [0, 2, 4, 5]  # also balances the rest
    assert partition(layers, 2, boundaries=[0, 4, 5]) == [0, 4, 5]
    assert "stage 1: layers 2..4" in describe(layers, [0, 2, 5])


@pytest.mark.parametrize("kwargs,match", [
    ({"num_stages": 6}, r"5 layers cannot fill 6 stages"),
    ({"num_stages": 2, "method": "magic"}, r"unknown partition method 'magic'"),
    ({"num_stages": 2, "boundaries": [0, 5]}, r"must be 3 strictly increasing indices"),
    ({"num_stages": 2, "method": "cost"}, r"method 'cost' needs one cost per layer \(5\)"),
])
def test_errors(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(PartitionError, match=match):
        partition([nn.Linear(2, 2) for _ in range(5)], **kwargs)


def test_choose_bounds_minimises_the_simulated_step_and_respects_the_memory_cap() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    costs = [LayerCost(1, 1, 1, 2, 100, 1000) for _ in range(5)] + [LayerCost(5, 5, 5, 10, 100, 1000)]
    choice = choose_bounds(costs, sched)
    assert choice.bounds == [0, 5, 6] and choice.stage_costs == [(5, 5, 5), (5, 5, 5)]
    assert choice.makespan == simulate(sched, Costs(5, 5, 5)).makespan
    # memory: 4 x parameters + the schedule's peak in flight (2 at position 0, 1 at position 1) x activations
    assert choice.memory == [4 * 5000 + 2 * 500, 4 * 1000 + 1 * 100]
    capped = choose_bounds(costs, sched, memory_cap=4 * 4000 + 2 * 400)
    assert capped.bounds == [0, 4, 6] and max(capped.memory) <= 4 * 4000 + 2 * 400
    with pytest.raises(PartitionError, match=r"fits the memory cap of .* GiB per position; the least is"):
        choose_bounds(costs, sched, memory_cap=1000)
    # the simulated step decides, not the slowest stage: [0, 1, 4] has the smaller slowest stage (16
    # against 17), but its F-heavy first stage delays the pipeline's fill more
    mixed = [LayerCost(f, b, w, b + w, 0, 0) for f, b, w in ((4, 4, 2), (2, 3, 2), (3, 1, 1), (1, 2, 2))]
    assert balance_min_max([c.total for c in mixed], 2) == [0, 1, 4]
    assert choose_bounds(mixed, sched).bounds == [0, 2, 4]
    assert simulate(sched, [Costs(4, 4, 2), Costs(6, 6, 5)]).makespan > choose_bounds(mixed, sched).makespan
    assert choose_bounds([LayerCost(1, 1, 1, 2, 0, 0)] * 6, sched).bounds == [0, 3, 6]   # deterministic tie
