"""Split backward (zero-bubble B and W): bitwise the fused backward's gradients, and W computes only dW."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeengine.models import gpt, mlp, resnet
from pipeengine.runtime.stage import LayerChain, Stage

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.convolution_backward.default}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in MATMULS:
            if func is torch.ops.aten.convolution_backward.default:   # one call; count what it computes
                self.count += sum(args[-1])
            else:
                self.count += 1
        return func(*args, **(kwargs or {}))


def _stage(layers: list[nn.Module], stage: int, loss: Any = None) -> Stage:
    ch = Stage(LayerChain([m.double() for m in layers], 1), stage, 3, loss, 2)
    ch.reset()
    return ch


def _step(ch: Stage, x: torch.Tensor, target: Any, gy: torch.Tensor | None, split: bool) -> tuple[Any, ...]:
    """Two microbatches through F, B (and W); returns input grads, param grads and matmul counts (B, W)."""
    for p in ch.params:
        p.grad = None
    grads, counts = [], [0, 0]
    for mb in range(2):
        ch.forward(mb, x[mb].clone(), None if target is None else target[mb], True)
    for mb in range(2):
        with CountMatmuls() as c:
            grads.append(ch.backward(mb, None if gy is None else (gy[mb],), split))
        counts[0] += c.count
        if split:
            with CountMatmuls() as c:
                ch.backward_weight(mb)
            counts[1] += c.count
    assert not ch.saved
    return grads, [p.grad.clone() for p in ch.params], counts


CASES = {
    "gpt": lambda: ([gpt.Block(gpt.Config(block_size=16, n_head=4, n_embd=32)) for _ in range(2)],
                    torch.randn(2, 3, 16, 32)),
    "resnet": lambda: (resnet.build(resnet.presets()["tiny"]())[1:4], None),
    "mlp": lambda: (mlp.build(mlp.presets()["tiny"]())[1:-1], torch.randn(2, 4, 64)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", sorted(CASES))
@pytest.mark.parametrize("last", [False, True])
def test_split_backward_is_bitwise_the_fused_one_and_w_runs_only_weight_matmuls(model: str, last: bool) -> None:
    torch.manual_seed(0)
    layers, x = CASES[model]()
    if x is None:   # resnet: the stem's output shape
        stem = resnet.build(resnet.presets()["tiny"]())[0]
        x = torch.stack([stem(torch.randn(2, 3, 32, 32)).detach() for _ in range(2)])
    x = x.double()
    with torch.no_grad():
        y = nn.Sequential(*[m.double() for m in layers])(x[0])
    target, gy, loss = None, torch.randn(2, *y.shape, dtype=torch.float64), None
    if last:
        target, gy, loss = torch.randn(2, *y.shape, dtype=torch.float64), None, nn.functional.mse_loss
    ch = _stage(layers, 2 if last else 1, loss)
    fused_in, fused_w, (fused_mm, _) = _step(ch, x, target, gy, split=False)
    split_in, split_w, (b_mm, w_mm) = _step(ch, x, target, gy, split=True)
    for a, b in zip(fused_in, split_in):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert len(fused_w) == len(split_w) and all(torch.equal(u, v) for u, v in zip(fused_w, split_w))
    # nothing computed twice: B + W do exactly the fused backward's matrix products, W only dW's
    weights = sum(1 for p in ch.params if p.dim() >= 2)
    assert b_mm + w_mm == fused_mm and w_mm == 2 * weights, (b_mm, w_mm, fused_mm, weights)
