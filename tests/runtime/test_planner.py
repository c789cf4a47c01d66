"""The split search: exact min-max balance, the simple methods, the simulated best split (against brute force and on
20 cost profiles), and errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from benchmarks.planner import PROFILES, makespan_of, profile_costs
from pipeengine.runtime import planner
from pipeengine.runtime.planner import (LayerCost, PartitionError, balance_min_max, choose_bounds, describe,
                                        even_bounds, partition)
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


def _random_layers(rng: random.Random, n: int) -> list[LayerCost]:
    out = []
    for _ in range(n):
        f, b, w = (rng.uniform(0.2, 2.0) for _ in range(3))
        out.append(LayerCost(f, b, w, b + w, rng.randint(1, 9) * 100, rng.randint(1, 9) * 1000))
    return out


SMALL = [("1f1b", 2, 3, 1), ("1f1b", 3, 4, 1), ("zb-h1", 2, 3, 1), ("zb-h1", 3, 5, 1), ("gpipe", 2, 2, 1),
         ("interleaved-1f1b", 2, 2, 2), ("interleaved-1f1b", 2, 4, 2)]


@pytest.mark.parametrize("search", ["exhaustive", "local"])
def test_choose_bounds_equals_brute_force_on_every_small_case(search: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every small schedule x layer count, random per-layer costs: the planner's split is the brute-force best
    (each split simulated with its stages' own costs; ties to the smaller slowest stage, then earlier bounds),
    both by its exact search and, forced, by its local search."""
    if search == "local":
        monkeypatch.setattr(planner, "EXACT_LIMIT", 0)
    rng = random.Random(3)
    simulated = splits = 0
    for name, pp, m, v in SMALL:
        sched = compile_schedule(name, pp, m, v)
        stages = sched.num_stages
        for n in range(stages, stages + 5):
            costs = _random_layers(rng, n)
            every = [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), stages - 1)]
            widest = [max(sum(c.total for c in costs[x:y]) for x, y in zip(b, b[1:])) for b in every]
            brute = min((makespan_of(costs, sched, b), wide, b) for b, wide in zip(every, widest))
            choice = choose_bounds(costs, sched)
            assert choice.makespan == pytest.approx(brute[0], rel=1e-12), (name, pp, m, v, n)
            if search == "exhaustive":
                assert choice.bounds == brute[2]
                simulated, splits = simulated + choice.candidates, splits + len(every)
    if search == "exhaustive":
        assert simulated < 0.6 * splits   # the lower bound spared the simulation of the rest


def test_the_simulator_sees_each_stage_not_a_positions_mean() -> None:
    """Two chunks of 1 and 9 layers on one position are slower than two of 5: per-position means hid it."""
    sched = compile_schedule("interleaved-1f1b", 2, 4, 2)
    even = [Costs(5, 5, 5)] * 4
    lopsided = [Costs(1, 1, 1), Costs(5, 5, 5), Costs(9, 9, 9), Costs(5, 5, 5)]   # stages 0 and 2 on position 0
    assert simulate(sched, lopsided).makespan > simulate(sched, even).makespan
    uniform = [LayerCost(1, 1, 1, 2, 0, 0)] * 20
    choice = choose_bounds(uniform, sched)   # shorter stages where the pipeline fills and drains: 132 < 135
    assert (choice.bounds, choice.makespan) == ([0, 4, 10, 16, 20], 132.0)
    assert makespan_of(uniform, sched, [0, 5, 10, 15, 20]) == 135.0


@pytest.mark.parametrize("profile", list(PROFILES))
def test_planner_on_the_20_cost_profiles(profile: str) -> None:
    """Never worse than the equal-count split or the min-max split of the layer costs (the old search gave
    82 uniform layers at pp 8 the sizes [1, 4, 13, 13, 13, 13, 13, 12], +12 % against the balanced split)."""
    costs = profile_costs(profile)
    for sched in (compile_schedule("1f1b", 8, 16), compile_schedule("interleaved-1f1b", 4, 8, 2)):
        choice = choose_bounds(costs, sched, budget=500)   # any budget: both baselines are always finalists
        even = even_bounds(len(costs), sched.num_stages)
        minmax = balance_min_max([c.total for c in costs], sched.num_stages)
        assert choice.makespan <= makespan_of(costs, sched, even) + 1e-9
        assert choice.makespan <= makespan_of(costs, sched, minmax) + 1e-9
        assert choice.makespan == pytest.approx(makespan_of(costs, sched, choice.bounds), rel=1e-12)


# ------------------------------------------------------------------ a profile that knows its noise

def _cost(total: float, noise: float = 0.0, kind: str = "") -> LayerCost:
    return LayerCost(total / 3, total / 3, total / 3, 2 * total / 3, activation_bytes=1, param_bytes=1, noise=noise,
                     kind=kind)


def test_a_gain_inside_the_noise_keeps_the_equal_split_and_says_why() -> None:
    schedule = compile_schedule("1f1b", 2, 8)
    costs = [_cost(1.0, noise=0.02)] * 4 + [_cost(2.0, noise=0.02)] * 2   # 4 + 4 beats 3 + 5 by about 20 %
    best = choose_bounds(costs, schedule)
    assert best.bounds == [0, 4, 6] and not best.kept_equal
    gain = 1 - best.makespan / simulate(schedule, [Costs(3 / 3, 3 / 3, 3 / 3), Costs(5 / 3, 5 / 3, 5 / 3)]).makespan
    assert 0.1 < gain < 0.3, gain
    noisy = choose_bounds([_cost(c.total, noise=0.30) for c in costs], schedule)
    assert noisy.bounds == [0, 3, 6], noisy
    assert noisy.kept_equal.startswith("the equal split kept: [0, 4, 6] was predicted ")
    assert f"{100 * gain:.1f}% faster, inside the profile's noise (30.0% spread between its timed runs)" in \
        noisy.kept_equal, noisy.kept_equal
    assert noisy.kept_equal in noisy.describe("1f1b")
    assert choose_bounds([_cost(c.total, noise=0.0) for c in costs], schedule).bounds == [0, 4, 6]


def test_alike_layers_take_one_cost_and_a_spread_beyond_the_noise_is_said() -> None:
    from pipeengine.runtime.profile import layer_kind, shared_costs
    x = torch.zeros(2, 8)
    assert layer_kind(nn.Linear(8, 8), x) == layer_kind(nn.Linear(8, 8), x)
    assert layer_kind(nn.Linear(8, 8), x) != layer_kind(nn.Linear(8, 8, bias=False), x)
    assert layer_kind(nn.Linear(8, 8), x) != layer_kind(nn.Linear(8, 8), torch.zeros(4, 8))
    assert layer_kind(nn.Dropout(0.1), x) != layer_kind(nn.Dropout(0.2), x)   # a setting, not in the parameters
    assert layer_kind(nn.Linear(8, 8), x, 1) != layer_kind(nn.Linear(8, 8), x, 2)   # the last layer times the loss
    blocks = [_cost(t, noise=0.05, kind="block") for t in (2.0, 2.1, 18.0, 2.05)]
    costs, lines = shared_costs([_cost(1.0, kind="embedding"), *blocks, _cost(3.0, kind="head")])
    assert [c.total for c in costs] == pytest.approx([1.0, 2.075, 2.075, 2.075, 2.075, 3.0])
    assert len(lines) == 1 and lines[0].startswith("layers 1..4 are alike but measured 2000.00 to 18000.00 ms"), lines
    assert "each is planned with their median F, B and W (2075.00 ms in all)" in lines[0]
    calm, quiet = shared_costs([_cost(t, noise=0.05, kind="block") for t in (2.0, 2.1)])
    assert quiet == [] and calm[0] == calm[1]
