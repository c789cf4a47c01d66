"""Splitting layers into stages: exact min-max balance, methods, and errors."""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

from pipeengine.partition import PartitionError, balance_min_max, describe, measure_costs, partition


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


def test_measure_costs_sees_a_big_layer() -> None:
    import torch
    layers = [nn.Linear(8, 8), nn.Linear(8, 2048), nn.Linear(2048, 8)]
    costs = measure_costs(layers, torch.randn(64, 8), repeats=3)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert costs[2] > costs[0]
