"""1,000 randomized steps of documents of random lengths, packed or ragged, at pp 1-4, dp 1-2, every schedule: no
hang, and every step's loss and the final parameters equal one process training on the same microbatches
(float64, so the pipeline's other summation order is the only difference)."""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import pytest
import torch

from pipeengine.models import gpt
from pipeengine.training.packing import Packing

CFG = gpt.Config(block_size=12, n_layer=6, n_head=2, n_embd=8)   # 8 layers: 8 stages at pp 4 x 2 chunks
# (pp, dp, schedule, chunks, steps): every schedule once at least; 1,000 steps in all. No run is longer than 160
# steps: AdamW amplifies the last-bit differences of another summation order, and past ~300 steps float64 runs
# drift apart by 1e-5.
CONFIGS = [(1, 2, "1f1b", 1, 110), (1, 1, "gpipe", 1, 160), (1, 1, "1f1b", 1, 150), (2, 1, "gpipe", 1, 80),
           (2, 2, "1f1b", 1, 20), (2, 1, "zb-h1", 1, 80), (2, 1, "zb-h2", 1, 70), (2, 2, "zbv", 2, 20),
           (2, 1, "v-half", 2, 70), (2, 1, "v-min", 2, 70), (4, 1, "1f1b", 1, 30), (4, 1, "interleaved-1f1b", 2, 30),
           (4, 1, "interleaved-zb", 2, 30), (4, 1, "dualpipev", 2, 30), (4, 1, "zbv", 2, 30),
           (2, 2, "dualpipev", 2, 20)]


def sizes(pp: int, schedule: str) -> tuple[int, int]:
    """(microbatches, layers): as few as the schedule takes (the engine's cost is per action: the test's time), 2
    microbatches but 4 for interleaved-1f1b at pp 4; 8 layers at pp 4 (8 stages of 2 chunks), 4 below."""
    return (4 if (pp, schedule) == (4, "interleaved-1f1b") else 2), (8 if pp == 4 else 4)


def model_config(layers: int) -> gpt.Config:
    return dataclasses.replace(CFG, n_layer=layers - 2)   # the embedding, the blocks, the head


def step_data(step: int, dp: int, m: int) -> list[list[tuple[Any, Any]]]:
    """Each replica's m microbatches of the step: 2-4 sequences a microbatch of random lengths 1..context, packed
    or ragged (one a row, or one row a microbatch) at random, weighted so the loss is the mean over the global
    batch's real tokens (every configuration of one dp and m trains on the same stream: one reference run serves
    them all)."""
    rng = random.Random(step * 7 + dp * 3 + m)
    mode = rng.choice(["pack", "ragged", "ragged one row"])
    seqs = [[torch.tensor([rng.randrange(256) for _ in range(rng.randint(1, CFG.block_size) + 1)])
             for _ in range(rng.randint(2, 4) * m)] for _ in range(dp)]
    real = sum(len(s) - 1 for share in seqs for s in share)
    packing = Packing(mode.split()[0], CFG.block_size, linear_cost=rng.choice([0.0, 96.0]), one_row="row" in mode)
    return [packing.build([(s[:-1].clone(), s[1:].clone()) for s in share], m, dp * m / real) for share in seqs]


def _optimizer(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1)


def run(rank: int, world: int, config: int) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.set_default_dtype(torch.float64)
    pp, dp, schedule, chunks, steps = CONFIGS[config]
    m, layers = sizes(pp, schedule)
    factories = gpt.layer_factories(model_config(layers))
    with PipelineEngine(factories, gpt.loss_fn, _optimizer, topology=Topology(pp, dp), schedule=schedule,
                        microbatches=m, chunks=chunks, seed=3, tied=gpt.tied_parameters(len(factories)),
                        wire="strict", partition="uniform", timeout=60) as engine:
        losses = [engine.train_batch(iter(step_data(step, dp, m)[engine.replica])).loss
                  for step in range(steps)]
        params = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
    return {"losses": losses, "params": params}


@functools.lru_cache(maxsize=None)
def reference(dp: int, m: int, layers: int) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """One process, the same microbatches (every replica's), the same initial weights and optimizer: the loss of
    every step, and the parameters after each number of steps a configuration of this dp, m and depth runs."""
    ends = {c[-1] for c in CONFIGS if (c[1], *sizes(c[0], c[2])) == (dp, m, layers)}
    torch.set_default_dtype(torch.float64)
    try:
        built = gpt.build(model_config(layers), seed=3)
        params = list({id(p): p for layer in built for p in layer.parameters()}.values())
        opt, losses, snapshots = _optimizer(params), [], {}
        for step in range(max(ends)):
            total = torch.zeros(())
            for share in step_data(step, dp, m):
                for x, y in share:
                    for layer in built:
                        x = layer(x)
                    total = total + gpt.loss_fn(x, y) / (dp * m)
            opt.zero_grad()
            total.backward()
            opt.step()
            losses.append(float(total.detach()))
            if step + 1 in ends:
                snapshots[step + 1] = {f"layers.{i}.{n}": p.detach().clone() for i, layer in enumerate(built)
                                       for n, p in layer.named_parameters()}
        return losses, snapshots
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_thousand_random_ragged_and_packed_steps_equal_one_process(request: pytest.FixtureRequest) -> None:
    assert sum(c[-1] for c in CONFIGS) == 1000
    assert {c[2] for c in CONFIGS} >= {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "interleaved-zb",
                                       "dualpipev", "v-half", "v-min"}
    for config, (pp, dp, schedule, _, steps) in enumerate(CONFIGS):
        ranks = request.getfixturevalue(f"world{pp * dp}").run(run, config, timeout=240)
        losses, snapshots = reference(dp, *sizes(pp, schedule))
        want_losses, want_params = losses[:steps], snapshots[steps]
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want_losses), rtol=1e-9, atol=1e-12,
                                       msg=lambda e: f"pp {pp} dp {dp} {schedule}: {e}")
            got.update(r["params"])
        assert got.keys() == want_params.keys(), (schedule, sorted(got)[:4], sorted(want_params)[:4])
        for k, v in got.items():
            torch.testing.assert_close(v, want_params[k], rtol=1e-9, atol=1e-12, msg=lambda e: f"{schedule} {k}: {e}")
