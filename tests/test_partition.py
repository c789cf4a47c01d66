"""Splitting layers into stages: exact min-max balance, methods, and errors."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.partition import LayerCost, PartitionError, balance_min_max, choose_bounds, describe, partition
from pipeengine.schedule import compile_schedule
from pipeengine.simulate import Costs, simulate
from tests.harness import run_distributed


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


# ------------------------------------------------------------------ partition by measured cost

class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd`` seconds in forward and ``bwd`` in backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:  # type: ignore[override]
        time.sleep(fwd)
        ctx.bwd = bwd
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        time.sleep(ctx.bwd)
        return g, None, None


class SleepLayer(nn.Module):
    """F, B and W of known cost: the input path sleeps f and b, the weight branch w (only in W when split)."""

    def __init__(self, f: float, b: float, w: float, extra_params: int = 0) -> None:
        super().__init__()
        self.cost = (f, b, w)
        self.scale = nn.Parameter(torch.ones(()))
        self.big = nn.Parameter(torch.zeros(extra_params))   # memory only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, b, w = self.cost
        return _Sleep.apply(x, f, b) * _Sleep.apply(self.scale, 0.0, w)


MS = 1e-3
MIB = 2**18   # float32 elements in 1 MiB


def sleep_layers() -> list[nn.Module]:
    """Five light layers (12 ms each, 1 MiB of parameters) and a heavy last one (60 ms): at pp=2 the only
    balanced split is [0, 5, 6]; parameter counts say [0, 3, 6]."""
    return [SleepLayer(4 * MS, 4 * MS, 4 * MS, MIB) for _ in range(5)] + [SleepLayer(20 * MS, 20 * MS, 20 * MS, MIB)]


def test_choose_bounds_minimises_the_simulated_step_and_respects_the_memory_cap() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    costs = [LayerCost(1, 1, 1, 2, 100, 1000) for _ in range(5)] + [LayerCost(5, 5, 5, 10, 100, 1000)]
    choice = choose_bounds(costs, sched)
    assert choice.bounds == [0, 5, 6] and choice.stage_costs == [(5, 5, 5), (5, 5, 5)]
    assert choice.makespan == simulate(sched, Costs(5, 5, 5)).makespan
    # memory: 4 x parameters + the schedule's peak in flight (2 on rank 0, 1 on rank 1) x activations
    assert choice.memory == [4 * 5000 + 2 * 500, 4 * 1000 + 1 * 100]
    capped = choose_bounds(costs, sched, memory_cap=4 * 4000 + 2 * 400)
    assert capped.bounds == [0, 4, 6] and max(capped.memory) <= 4 * 4000 + 2 * 400
    with pytest.raises(PartitionError, match=r"fits the memory cap of .* GiB per rank; the least is"):
        choose_bounds(costs, sched, memory_cap=1000)
    # the simulated step decides, not the slowest stage: [0, 1, 4] has the smaller slowest stage (16
    # against 17), but its F-heavy first stage delays the pipeline's fill more
    mixed = [LayerCost(f, b, w, b + w, 0, 0) for f, b, w in ((4, 4, 2), (2, 3, 2), (3, 1, 1), (1, 2, 2))]
    assert balance_min_max([c.total for c in mixed], 2) == [0, 1, 4]
    assert choose_bounds(mixed, sched).bounds == [0, 2, 4]
    assert simulate(sched, [Costs(4, 4, 2), Costs(6, 6, 5)]).makespan > choose_bounds(mixed, sched).makespan
    assert choose_bounds([LayerCost(1, 1, 1, 2, 0, 0)] * 6, sched).bounds == [0, 3, 6]   # deterministic tie


def profile_worker(rank: int, world: int) -> list[Any]:
    from pipeengine.engine import PipelineEngine
    from pipeengine.topology import Topology
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    out: list[Any] = []
    for cap in (None, 4 * 4 * 2**20 + 2**20):
        engine = PipelineEngine(sleep_layers(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                topology=Topology(2, 1), microbatches=4, partition="profile", sample=sample,
                                memory_cap=cap, wire="strict")
        choice = engine.partition_choice
        assert choice is not None
        out.append((engine.bounds, choice.stage_costs, choice.describe("1f1b")))
        before = [p.detach().clone() for p in engine.parameters]
        engine.train_batch(iter([sample] * 4))   # it trains on the split it chose
        assert any(not torch.equal(a, p) for a, p in zip(before, engine.parameters))
    for bad in (None, "x"):
        try:
            PipelineEngine(sleep_layers(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                           topology=Topology(2, 1), partition="profile", sample=bad)  # type: ignore[arg-type]
        except ValueError as exc:
            out.append(str(exc))
    try:
        PipelineEngine(sleep_layers(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                       topology=Topology(2, 1), partition="profile", sample=(torch.randn(4, 3), torch.randn(4, 3)),
                       memory_cap=2**20)
    except ValueError as exc:
        out.append(str(exc))
    broken = sleep_layers()
    broken[1] = SleepLayer(0.0, -1.0, 0.0)   # its backward raises, after rank 0 passed its share's output on
    try:
        PipelineEngine(broken, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                       topology=Topology(2, 1), partition="profile", sample=sample)
    except ValueError as exc:
        out.append(str(exc))
    return out


@pytest.mark.timeout(120)
def test_profile_partition_measures_in_parallel_and_every_rank_agrees() -> None:
    results = run_distributed(profile_worker, 2, timeout=110)
    assert results[0][:2] == results[1][:2]   # bounds, costs and text: rank 0's, on every rank
    (bounds, stage_costs, text), (capped, _, _) = results[0][:2]
    assert bounds == [0, 5, 6], text
    # F; the fused backward (1f1b), where layer 0's input needs no gradient: its input path costs nothing
    for (f, b, w), want in zip(stage_costs, ((20 * MS, 36 * MS), (20 * MS, 40 * MS))):
        assert want[0] <= f < 1.5 * want[0] and want[1] <= b + w < 1.5 * want[1], stage_costs
    assert "partition profile: bounds [0, 5, 6]" in text and "stage 1: layers 5..5" in text and "backward" in text
    assert capped == [0, 4, 6]   # 5 layers of 1 MiB parameters (x4 with grads and Adam) no longer fit
    assert all("needs sample=(inputs, target)" in r for r in results[0][2:4])
    assert "fits the memory cap of 0.00 GiB" in results[0][4] and results[0][4] == results[1][4]
    assert results[0][5] == results[1][5] and results[0][5].startswith("profiling layers 0..2 on rank 0 failed")
