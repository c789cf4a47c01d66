"""Tied parameters: a GPT whose LM head is its embedding, split over two positions, trains as one process does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import WorldPool


def gpt_run(rank: int, world: int) -> dict[str, Any]:
    from pipeengine.models import gpt
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.set_default_dtype(torch.float64)
    cfg = gpt.presets()["tiny"]()
    engine = PipelineEngine(gpt.layer_factories(cfg), gpt.loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            topology=Topology(2, 1), schedule="1f1b", microbatches=2, seed=3,
                            tied=gpt.tied_parameters(cfg.n_layer + 2), grad_clip=1.0)
    losses = []
    for step in range(4):
        x, y = gpt_batch(step)
        losses.append(engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])])).loss)
    layers = engine.stages[0].module.layers
    tied = layers[0].wte.weight if engine.position == 0 else layers[-1].lm_head.weight
    return {"losses": losses, "tied": tied.detach().clone()}


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, 256, (4, 17), generator=g)
    return seq[:, :-1], seq[:, 1:]


@pytest.mark.timeout(200)
def test_tied_embedding_stays_bit_identical_and_matches_single_process(world2: WorldPool) -> None:
    results = world2.run(gpt_run, timeout=180)
    assert torch.equal(results[0]["tied"], results[1]["tied"])
    from pipeengine.models import gpt
    torch.set_default_dtype(torch.float64)
    try:
        layers = gpt.build(gpt.presets()["tiny"](), seed=3)
        net = nn.Sequential(*layers)
        assert layers[-1].lm_head.weight is layers[0].wte.weight
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            x, y = gpt_batch(step)
            loss = gpt.loss_fn(net(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(results[0]["tied"], layers[0].wte.weight.detach(), rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)
