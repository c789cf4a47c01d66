"""``boundary_dtype="bf16"`` ([Note: boundary dtype] in wire.py): fp32 activations and gradients cross between
stages as bf16, half the bytes, and the run equals one process that rounds to bf16 at the same place."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import WorldPool

STEPS, M = 3, 4


class _Round(torch.autograd.Function):
    """What the boundary does to a tensor and to its gradient: bf16 and back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.bfloat16().float()


class Round(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Round.apply(x)  # type: ignore[no-any-return]


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]


def _train(rank: int, world: int, boundary: str, rounded: bool) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    layers = copy.deepcopy(_layers())
    if rounded:   # one process, rounding where the pipeline's boundary is
        layers = [*layers[:2], Round(), *layers[2:]]
    pp = world
    with PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                        topology=Topology(pp, 1), microbatches=M, partition=[0, 2, 4] if pp == 2 else "uniform",
                        boundary_dtype=boundary) as engine:
        losses, sent = [], 0
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            data = [(torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)) for _ in range(M)]
            engine.wire.log = []
            losses.append(engine.train_batch(iter(data)).loss)
            sent += sum(n for action, way, _, _, n in engine.wire.log if way == "send" and "H" not in action)
        params = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
    return {"losses": losses, "params": params, "sent": sent}


def test_bf16_boundary_halves_the_traffic_and_equals_one_process_rounding_there(
        world1: WorldPool, world2: WorldPool) -> None:
    fp32, bf16 = (world2.run(_train, b, False) for b in ("fp32", "bf16"))
    (one,) = world1.run(_train, "fp32", True)
    assert bf16[0]["losses"] == one["losses"] and bf16[0]["losses"] != fp32[0]["losses"]
    params = {**bf16[0]["params"], **bf16[1]["params"]}
    renamed = {k.replace("layers.3.", "layers.2.").replace("layers.4.", "layers.3."): v
               for k, v in one["params"].items()}   # the rounding layer (2) has no parameters
    assert params.keys() == renamed.keys()
    different = [k for k in params if not torch.equal(params[k], renamed[k])]
    assert not different, different
    for rank in (0, 1):   # activations one way, gradients the other: half the bytes each
        assert bf16[rank]["sent"] * 2 == fp32[rank]["sent"] > 0, (bf16[rank]["sent"], fp32[rank]["sent"])


def test_an_unknown_boundary_dtype_is_one_line(world1: WorldPool) -> None:
    with pytest.raises(RuntimeError, match=r"boundary_dtype must be one of fp32, bf16 \(got 'fp16'\)"):
        world1.run(_train, "fp16", False)
