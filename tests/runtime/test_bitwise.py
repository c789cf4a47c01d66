"""Bitwise the same whatever the split: at a fixed dp, losses and parameters do not depend on pp, the schedule
or the partition (fp32, bf16, and with dropout: each layer's masks are keyed to the model, rng.py), with
microbatches of one shape or, documents of random lengths packed or ragged, of their own shapes. A GPT with its
LM head tied to the embedding, the gradient norm clipped."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import WorldPool

STEPS, M, ROWS = 3, 4, 2
# (pp, schedule, chunks, partition): 8 layers (embedding, 6 blocks, head)
SPLITS = [(1, "1f1b", 1, "uniform"),
          (2, "1f1b", 1, "uniform"), (2, "1f1b", 1, (0, 3, 8)), (2, "gpipe", 1, (0, 6, 8)), (2, "zb-h1", 1, "uniform"),
          (2, "interleaved-1f1b", 2, "uniform"),
          (2, "zbv", 2, (0, 1, 4, 7, 8)),
          (4, "1f1b", 1, "uniform"), (4, "zb-h1", 1, (0, 1, 2, 7, 8)), (4, "interleaved-1f1b", 2, "uniform"),
          (4, "zbv", 2, "uniform"), (4, "dualpipev", 2, "uniform")]   # V: embedding and tied head on position 0


def documents(mode: str, context: int, g: torch.Generator) -> list[Any]:
    """A step's microbatches of 3 x M sequences of random lengths, laid out by a Packing (mode "ragged one row":
    ragged, a microbatch one row)."""
    from pipeengine.training.packing import Packing
    lengths = torch.randint(1, context + 1, (3 * M,), generator=g)
    seqs = [torch.randint(0, 256, (int(n) + 1,), generator=g) for n in lengths]
    packing = Packing(mode.split()[0], context, linear_cost=12.0 * 32, one_row="row" in mode)
    return packing.build([(s[:-1], s[1:]) for s in seqs], M, M / sum(len(s) - 1 for s in seqs))


def train(rank: int, world: int, schedule: str, chunks: int, partition: Any, precision: str) -> dict[str, Any]:
    from pipeengine.models import gpt
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    precision, _, variant = precision.partition("-")
    cfg = gpt.Config(block_size=16, n_layer=6, n_head=2, n_embd=32, dropout=0.2 if variant == "dropout" else 0.0)
    layers = gpt.layer_factories(cfg)
    engine = PipelineEngine(layers, gpt.loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                            topology=Topology(world, 1), schedule=schedule, microbatches=M, chunks=chunks,
                            partition=list(partition) if isinstance(partition, tuple) else partition, seed=7,
                            tied=gpt.tied_parameters(len(layers)), grad_clip=0.5, precision=precision, wire="strict")
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, 256, (M * ROWS, cfg.block_size + 1), generator=g)
        data = [(seq[k * ROWS:(k + 1) * ROWS, :-1], seq[k * ROWS:(k + 1) * ROWS, 1:]) for k in range(M)]
        if variant == "documents":   # of random lengths, packed, ragged, ragged one row by turns: shapes of their own
            data = documents(("pack", "ragged", "ragged one row")[step % 3], cfg.block_size, g)
        losses.append(engine.train_batch(iter(data)).loss)
    params = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                       pytest.param("fp32-dropout", marks=pytest.mark.slow),
                                       pytest.param("fp32-documents", marks=pytest.mark.slow)])
def test_losses_and_parameters_are_bitwise_the_same_at_every_split(
        precision: str, request: pytest.FixtureRequest) -> None:
    runs = {}
    for pp, schedule, chunks, partition in SPLITS:
        pool: WorldPool = request.getfixturevalue(f"world{pp}")
        ranks = pool.run(train, schedule, chunks, partition, precision, timeout=120)
        params: dict[str, torch.Tensor] = {}
        for r in ranks:
            params.update(r["params"])
        runs[(pp, schedule, chunks, partition)] = (ranks[0]["losses"], params)
    (base_losses, base_params), *_ = runs.values()
    assert len(set(map(tuple, (losses for losses, _ in runs.values())))) == 1, {k: v[0] for k, v in runs.items()}
    assert base_losses[0] != base_losses[-1]
    for split, (_, params) in runs.items():
        assert params.keys() == base_params.keys(), split
        different = [k for k in params if not torch.equal(params[k], base_params[k])]
        assert not different, (split, different[:3])
