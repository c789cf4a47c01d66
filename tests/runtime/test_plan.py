"""The plan: every rank agrees on the model and the bounds; the profile partition measures, simulates, picks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import WorldPool


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


def profile_worker(rank: int, world: int) -> list[Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    out: list[Any] = []
    for cap in (None, 4 * 4 * 2**20 + 2**20):
        engine = PipelineEngine(sleep_layers(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                topology=Topology(2, 1), microbatches=4, partition="profile", sample=sample,
                                memory_cap=cap, wire="strict")
        choice = engine.plan.choice
        assert choice is not None
        out.append((engine.bounds, choice.stage_costs, choice.describe("1f1b"), choice.kept_equal))
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_profile_partition_measures_in_parallel_and_every_rank_agrees(world2: WorldPool) -> None:
    results = world2.run(profile_worker, timeout=110)
    assert results[0][:2] == results[1][:2]   # bounds, costs and text: rank 0's, on every rank
    (bounds, stage_costs, text, _), (capped, _, _, kept) = results[0][:2]
    assert bounds == [0, 5, 6], text
    # F; the fused backward (1f1b), where layer 0's input needs no gradient: its input path costs nothing. At least
    # the layers' sleeps (a loaded machine only adds to them: how close they come is a benchmark's business)
    for (f, b, w), want in zip(stage_costs, ((20 * MS, 36 * MS), (20 * MS, 40 * MS))):
        assert want[0] <= f and want[1] <= b + w, stage_costs
    assert "partition profile: bounds [0, 5, 6]" in text and "stage 1: layers 5..5" in text and "backward" in text
    # 5 layers of 1 MiB parameters (x4 with grads and Adam) no longer fit: [0, 4, 6], 72 ms a microbatch against the
    # equal split's 84, unless the machine is so loaded that the profile's own spread exceeds that 14% gain (seen
    # under a parallel test run): then the equal split is kept, and said why
    assert capped == [0, 4, 6] or (capped == [0, 3, 6] and "[0, 4, 6] was predicted" in kept), (capped, kept)
    assert all("needs sample=(inputs, target)" in r for r in results[0][2:4])
    assert "fits the memory cap of 0.00 GiB" in results[0][4] and results[0][4] == results[1][4]
    assert results[0][5] == results[1][5] and results[0][5].startswith("profiling layers 0..2 on rank 0 failed")


def test_the_predicted_step_follows_the_microbatches_sizes() -> None:
    """Microbatches of their own lengths: the predicted step simulates each one at its size (sizes relative to the
    profiled one); a list of another length is not taken for them."""
    from pipeengine.runtime.measured import Choice
    from pipeengine.runtime.plan import _relowered
    from pipeengine.schedule import simulate
    choice = Choice([0, 2, 4], [(0.01, 0.02, 0.0), (0.012, 0.02, 0.0)], 0.0, [0.0, 0.0], 1, comm=[0.001])
    _, compiled, same = _relowered(choice, "1f1b", 2, 4, None, False)
    _, _, sized = _relowered(choice, "1f1b", 2, 4, None, False, [1.0, 0.5, 0.5, 0.25])
    assert sized.makespan == simulate(compiled, choice.costs(), sizes=[1.0, 0.5, 0.5, 0.25]).makespan
    assert sized.makespan < same.makespan == simulate(compiled, choice.costs()).makespan
    assert _relowered(choice, "1f1b", 2, 4, None, False, [1.0, 0.5])[2].makespan == same.makespan
