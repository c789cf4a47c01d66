"""Uneven replicas: a global batch that dp does not divide trains as one process on the same examples.

Replicas take different numbers of equal-size microbatches (each runs the schedule for its own count);
the loss of each microbatch is divided by the step's microbatches over every replica and the
gradients summed, so the step is the global batch's mean ([Note: uneven replicas] in update.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.runtime.equivalence import OPTIMIZERS, RTOL, ATOL, STEPS, batch, mlp_layers, train_alone

MICRO = 2


def _reference(examples: int, opt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_alone(opt, lambda net, x, y: nn.functional.mse_loss(net(x[:examples]), y[:examples]))


def _uneven(rank: int, world: int, pp: int, counts: list[int], opt: str, extra: dict[str, Any]) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.set_default_dtype(torch.float64)
    try:
        engine = PipelineEngine(mlp_layers(), nn.functional.mse_loss, OPTIMIZERS[opt],
                                topology=Topology(pp=pp, dp=world // pp), microbatches=counts, wire="strict", **extra)
        first = sum(counts[:engine.replica]) * MICRO
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            mine = [(x[first + k * MICRO:first + (k + 1) * MICRO], y[first + k * MICRO:first + (k + 1) * MICRO])
                    for k in range(engine.microbatches)]
            losses.append(engine.train_batch(iter(mine) if engine.needs_data else None).loss)
        params = {f"{engine.bounds[st.index] + j}.{k}": v.detach().clone() for st in engine.stages
                  for j, layer in enumerate(st.module.layers) for k, v in layer.state_dict().items()}
        return {"losses": losses, "params": params, "microbatches": engine.microbatches,
                "program": len(engine.program)}
    finally:
        torch.set_default_dtype(torch.float32)


CASES = [  # (pp, counts per replica, optimizer, engine options)
    (1, [2, 2, 1, 1], "adam", {}),
    (1, [2, 2, 1, 1], "sgd", {"shard_optimizer": True, "bucket_mb": 1e-4}),
    (2, [3, 2], "adam", {"schedule": "1f1b"}),
    (2, [3, 2], "adam", {"schedule": "zb-h1"}),
    (2, [4, 3], "sgd", {"schedule": "interleaved-1f1b", "chunks": 2}),
    (2, [3, 2], "adam", {"schedule": "zbv", "chunks": 2, "shard_optimizer": True}),
]


@pytest.mark.parametrize("pp, counts, opt, extra", CASES, ids=[f"pp{c[0]}-{c[1]}-{c[2]}-{'-'.join(c[3])}"
                                                               for c in CASES])
def test_replicas_with_uneven_shares_train_as_one_process(pp: int, counts: list[int], opt: str, extra: dict[str, Any],
                                                          world4: Any) -> None:
    ranks = world4.run(_uneven, pp, counts, opt, extra)
    ref_losses, ref_params = _reference(sum(counts) * MICRO, opt)
    seen: set[str] = set()
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref_params[k], rtol=RTOL, atol=ATOL, msg=lambda e: f"{k}: {e}")
            seen.add(k)
    assert seen == set(ref_params)
    dp = 4 // pp
    assert [r["microbatches"] for r in ranks] == [counts[rank % dp] for rank in range(4)]   # position-major
    assert len({r["program"] for r in ranks}) > 1   # the replicas run programs of different lengths


def _refused(rank: int, world: int, microbatches: Any) -> str:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    try:
        PipelineEngine(mlp_layers(), nn.functional.mse_loss, OPTIMIZERS["sgd"], topology=Topology(pp=1, dp=2),
                       microbatches=microbatches)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_counts_that_do_not_fit_the_replicas_are_refused(world2: Any) -> None:
    assert world2.run(_refused, [2, 1, 1])[0].startswith("microbatches must be a number, or a count per replica (2")
    assert world2.run(_refused, [2, 0])[0].startswith("microbatches must be a whole number >= 1")
