"""Gradient sync: a parameter no replica gave a gradient is left alone by the optimizer at every dp."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import WorldPool


class Gated(nn.Module):
    """A layer with an expert it uses only for inputs it never gets here (a conditionally used parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.expert = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y * self.expert if bool(x.sum() > 1e6) else y


def train(rank: int, world: int) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.manual_seed(0)
    layers = [Gated(), nn.Linear(4, 2)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
                            topology=Topology(1, world), microbatches=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        per = 8 // world
        mine = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        half = per // 2
        engine.train_batch(iter([(mine[0][:half], mine[1][:half]), (mine[0][half:], mine[1][half:])]))
    expert = engine.stages[0].module.layers[0].expert
    return {"expert": expert.detach().clone(), "lin": engine.stages[0].module.layers[0].lin.weight.detach().clone(),
            "state": len(engine.optimizer.state.get(expert, {}))}


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_without_a_gradient_is_not_decayed_at_any_dp(world: int, request: pytest.FixtureRequest) -> None:
    """Measured before: 1.0 stayed 1.0 at dp 1 but became 0.95 at dp 2 (AdamW decayed a zero gradient)."""
    pool: WorldPool = request.getfixturevalue(f"world{world}")
    for r in pool.run(train):
        assert torch.equal(r["expert"], torch.ones(4)), r["expert"]
        assert r["state"] == 0                      # no optimizer state either: it never stepped
        assert not torch.equal(r["lin"], torch.zeros(4, 4))
