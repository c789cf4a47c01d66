"""Links in the plan ([Note: links in the plan], runtime/links.py): measured or stated, a transfer costs its link's
latency plus its bytes over the bandwidth, and the planner, auto and the simulator count it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.runtime.auto import auto_schedule
from pipeengine.runtime.links import Links, fixed_links, stated_links
from pipeengine.runtime.planner import LayerCost, _Splits, choose_bounds
from pipeengine.schedule import Costs, compile_schedule, simulate
from pipeengine.schedule.simulate import Dataflow
from tests.harness import WorldPool

MIB = 2**20


def test_a_transfer_costs_latency_plus_bytes_over_bandwidth_on_its_own_hop() -> None:
    links = Links((1e-5, 2e-5, 3e-5, 4e-5), (1e9, 2e9, 3e9, 4e9))   # pp 4: hops 0-1, 1-2, 2-3 and the wrap 3-0
    assert links.seconds(1, 2, 2e9) == pytest.approx(2e-5 + 1.0)
    assert links.seconds(2, 1, 2e9) == links.seconds(1, 2, 2e9)   # a gradient goes back over the same link
    assert links.seconds(0, 3, 4e9) == pytest.approx(4e-5 + 1.0)  # the looping placement's wrap
    assert links.seconds(2, 2, 1e12) == 0.0                       # the turn of the V stays on its position
    with pytest.raises(ValueError, match="positions 0 and 2 are not pipeline neighbours"):
        links.seconds(0, 2, 1)
    two = stated_links(2, 8.0)   # pp 2: one link, both ways
    assert two.bandwidth == (1e9,) and two.latency == (0.0,) and two.seconds(1, 0, 1e9) == pytest.approx(1.0)
    assert fixed_links(3, 0.5).seconds(2, 0, 10**12) == 0.5
    assert "0<->1 0 us 8.00 Gbit/s" in two.describe() and "stated" in two.describe()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="link bandwidth must be > 0 Gbit/s"):
            stated_links(2, bad)


def test_the_simulator_and_the_dataflow_bound_charge_each_boundary_its_own_transfer() -> None:
    """1F1B, pp 3, one microbatch: F0 F1 F2 then B2 B1 B0, every boundary crossed once each way."""
    s = compile_schedule("1f1b", 3, 1)
    costs = [Costs(1, 1, 1, 0.25), Costs(1, 1, 1, 2.0), Costs(1, 1, 1, 7.0)]   # the last stage's comm is unused
    assert simulate(s, costs).makespan == 3 + 6 + 2 * (0.25 + 2.0)
    flow = Dataflow(s)
    assert flow.makespan(flow.durations(costs), [0.25, 2.0]) == 3 + 6 + 2 * (0.25 + 2.0)
    assert flow.makespan(flow.durations(costs), 1.0) == 3 + 6 + 2 * 2 * 1.0   # one time for every boundary


def _pooling_model() -> list[LayerCost]:
    """12 layers of equal cost, each output 16 MiB but layer 6's (a pooling layer's) 1 KiB."""
    return [LayerCost(1e-3, 1e-3, 1e-3, 2e-3, 1000, 1000, output_bytes=2**10 if i == 6 else 16 * MIB)
            for i in range(12)]


def test_a_boundary_moves_to_a_small_activation_when_transfers_cost_time() -> None:
    schedule = compile_schedule("1f1b", 4, 8)
    free = choose_bounds(_pooling_model(), schedule)
    assert free.bounds == [0, 3, 6, 9, 12] and free.comm == [0.0, 0.0, 0.0]
    links = stated_links(4, 25.0)   # 16 MiB take 5.37 ms at 25 Gbit/s, a layer's F + B + W 3 ms
    costed = choose_bounds(_pooling_model(), schedule, links=links)
    assert 7 in costed.bounds   # a boundary right after the pooling layer, its transfer 1 KiB
    assert sorted(costed.comm) == pytest.approx([2**10 / 3.125e9, 16 * MIB / 3.125e9, 16 * MIB / 3.125e9])
    equal = _Splits(_pooling_model(), schedule, 4.0, links).choice([0, 3, 6, 9, 12], 0.0)
    assert costed.makespan < simulate(schedule, equal.costs()).makespan   # the equal split, with its transfers
    # the predicted step counts the transfers: longer than compute alone, as simulated with them
    assert costed.makespan == pytest.approx(simulate(schedule, costed.costs()).makespan)
    assert costed.makespan > free.makespan
    text = costed.describe("1f1b")
    assert "predicted step (compute and transfers)" in text and ("transfer to stage 1 5.369 ms" in text
                                                                 or "transfer to stage 1 0.000 ms" in text)


def test_auto_plans_with_the_links() -> None:
    free = auto_schedule(_pooling_model(), 2, 4)
    costed = auto_schedule(_pooling_model(), 2, 4, links=stated_links(2, 25.0))
    assert free.comm == [0.0] * (len(free.bounds) - 2) and any(costed.comm)
    assert costed.comm == [2**10 / 3.125e9] * len(costed.comm)   # every boundary where the pooling layer ends
    assert costed.makespan == pytest.approx(simulate(costed.schedule, [
        Costs(f, b, w, c) for (f, b, w), c in zip(costed.stage_costs, costed.comm + [0.0])]).makespan)
    assert costed.makespan > free.makespan and costed.bound <= costed.makespan
    assert "simulated step (compute and transfers)" in costed.describe()


def _measured(rank: int, world: int, pp: int) -> tuple[Any, ...]:
    from pipeengine.runtime.links import measure_links
    from pipeengine.runtime.topology import Topology
    links = measure_links(Topology(pp, world // pp), torch.device("cpu"))
    return links.latency, links.bandwidth, links.how


@pytest.mark.parametrize("pp", [4, 2])
def test_every_rank_measures_every_hop_and_gets_the_same_figures(world4: WorldPool, pp: int) -> None:
    """pp 4: hops 0-1, 1-2, 2-3 and the wrap 3-0; pp 2 x dp 2: one hop, measured by both replicas (the slower
    replica's figures kept). Gloo on one machine: latency and bandwidth only have to be positive and finite."""
    results = world4.run(_measured, pp)
    assert all(r == results[0] for r in results)
    latency, bandwidth, how = results[0]
    assert how == "measured" and len(latency) == len(bandwidth) == (4 if pp == 4 else 1)
    assert all(0 < x < 1 for x in latency) and all(0 < x < float("inf") for x in bandwidth)


def _planned(rank: int, world: int) -> list[Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    sample = (torch.randn(4, 64), torch.randn(4, 64))
    out = []
    for gbps in (None, 0.001):
        with PipelineEngine([nn.Linear(64, 64) for _ in range(4)], nn.functional.mse_loss,
                            lambda ps: torch.optim.SGD(ps, lr=0.1), topology=Topology(2, 1), microbatches=4,
                            partition="profile", sample=sample, link_gbps=gbps) as engine:
            links, choice = engine.plan.links, engine.plan.choice
            assert links is not None and choice is not None
            out.append((links.how, links.bandwidth, choice.comm))
    return out


def test_the_engine_measures_the_links_or_takes_them_as_stated(world2: WorldPool) -> None:
    results = world2.run(_planned)
    assert results[0] == results[1]
    (measured, _, comm), (stated, bandwidth, slow) = results[0]
    assert measured == "measured" and comm[0] > 0
    # 4 x 64 float32 outputs (1 KiB) over 0.001 Gbit/s: 8.192 ms per transfer
    assert stated == "stated" and bandwidth == (125e3,) and slow == pytest.approx([1024 / 125e3])
