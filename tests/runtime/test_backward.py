"""Split backward (zero-bubble B and W): bitwise the fused backward's gradients, and W computes only dW."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeengine.models import gpt, mlp, resnet
from pipeengine.runtime import backward
from pipeengine.runtime.backward import walk
from pipeengine.runtime.chain import LayerChain
from pipeengine.runtime.stage import Stage

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
@pytest.mark.parametrize("where", ["middle", "last", "first"])
def test_split_backward_is_bitwise_the_fused_one_and_w_runs_only_weight_matmuls(model: str, where: str) -> None:
    """Unsegmented and segmented ([Note: segments]: B and W a layer at a time, as a zero-bubble schedule runs them)
    against the fused backward of the unsegmented stage; the first stage's inputs need no gradient."""
    last = where == "last"
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
    index = {"first": 0, "middle": 1, "last": 2}[where]
    ch = _stage(layers, index, loss)
    segmented = Stage(ch.module, index, 3, loss, 2, segmented=True)
    # a stage past the first whose layers' W all run without autograd is not segmented: a layer at a time would
    # only add host time ([Note: W without the engine] in direct.py); ResNet's BatchNorm needs autograd
    assert segmented.segmented == (model == "resnet" or where == "first") and not ch.segmented
    fused_in, fused_w, (fused_mm, _) = _step(ch, x, target, gy, split=False)
    for stage in (ch, segmented):
        stage.reset()
        split_in, split_w, (b_mm, w_mm) = _step(stage, x, target, gy, split=True)
        for a, b in zip(fused_in, split_in):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert len(fused_w) == len(split_w) and all(torch.equal(u, v) for u, v in zip(fused_w, split_w))
        # nothing computed twice: B + W do exactly the fused backward's matrix products, W only dW's (but where
        # a part's inputs need no gradient: the first stage's first layer, or the whole first stage unsegmented,
        # runs from its roots in W)
        weights = sum(1 for p in ch.params if p.dim() >= 2)
        assert b_mm + w_mm == fused_mm, (b_mm, w_mm, fused_mm)
        assert w_mm == 2 * weights or where == "first", (b_mm, w_mm, fused_mm, weights)
        if where == "first" and stage.segmented:
            assert b_mm > 0   # the layers after the first are split


# ------------------------------------------------------------------ what the split cannot prove safe

class Reuse(torch.autograd.Function):
    """y = 2x, whose backward doubles its incoming gradient in place and returns it (allowed in torch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.mul_(2)


class ReuseLayer(nn.Module):
    """The gradient reaching ``a``'s matmul is the very tensor Reuse then doubles (AddBackward passes it on)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Reuse.apply(x) + self.a(x))


class ScaleFn(torch.autograd.Function):
    """y = x * w computing dX and dW in one backward, counting its calls."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        ScaleFn.calls += 1
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class ScaleLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((6,), 1.5))
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(ScaleFn.apply(x, self.w))


class SelfRecompute(nn.Module):
    """A layer that checkpoints itself (two weight groups inside); counts how often its inside runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.runs = 0

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.inner(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self._inner, x, use_reentrant=False)


def _one_microbatch(layers: list[nn.Module], split: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    ch = _stage([m.double() for m in layers], 1)
    x = torch.randn(4, 6, dtype=torch.float64)
    gy = torch.randn(4, 6, dtype=torch.float64)
    ch.forward(0, x, None, True)
    (gin,) = ch.backward(0, (gy,), split)
    before_w = sum(getattr(m, "runs", 0) for m in layers)
    if split:
        ch.backward_weight(0)
    return gin, [p.grad.clone() for p in ch.params], sum(getattr(m, "runs", 0) for m in layers) - before_w


def test_a_custom_function_reusing_its_gradient_in_place_gives_the_fused_gradients() -> None:
    """Split, the kept gradient of ``a`` changed under it: dW was wrong by up to 3.2 here."""
    torch.manual_seed(3)
    model = [ReuseLayer(), ReuseLayer()]
    fused_in, fused_w, _ = _one_microbatch(copy.deepcopy(model), split=False)
    split_in, split_w, _ = _one_microbatch(copy.deepcopy(model), split=True)
    assert torch.equal(fused_in, split_in)
    assert all(torch.equal(a, b) for a, b in zip(fused_w, split_w))


def test_a_custom_function_computing_dw_runs_its_backward_once() -> None:
    torch.manual_seed(3)
    model = [ScaleLayer()]
    ScaleFn.calls = 0
    fused = _one_microbatch(copy.deepcopy(model), split=False)
    assert ScaleFn.calls == 1
    ScaleFn.calls = 0
    split = _one_microbatch(copy.deepcopy(model), split=True)
    assert ScaleFn.calls == 1   # B and W once had it compute dX and dW twice
    assert all(torch.equal(a, b) for a, b in zip(fused[1], split[1]))


class Half(torch.autograd.Function):
    """y = x / 2, marked safe to split: its backward leaves its incoming gradient alone."""

    split_backward_safe = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x / 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g / 2


class HalfLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(Half.apply(x))


def test_a_custom_function_marked_safe_is_split_and_gives_the_fused_gradients() -> None:
    """Unmarked, the Function makes B fused (W finds no gradient left to compute); marked, W computes dW."""
    torch.manual_seed(3)
    model = [HalfLayer(), HalfLayer()]
    x = torch.randn(4, 6, dtype=torch.float64)
    assert walk((HalfLayer().double()(x.requires_grad_()),)).custom == []
    fused_in, fused_w, _ = _one_microbatch(copy.deepcopy(model), split=False)
    torch.manual_seed(0)
    ch = _stage([m.double() for m in copy.deepcopy(model)], 1)
    ch.forward(0, torch.randn(4, 6, dtype=torch.float64), None, True)
    (gin,) = ch.backward(0, (torch.randn(4, 6, dtype=torch.float64),), True)
    assert all(p.grad is None for p in ch.params)   # B left every dW to W
    ch.backward_weight(0)
    assert torch.equal(gin, fused_in) and all(torch.equal(p.grad, w) for p, w in zip(ch.params, fused_w))


def test_w_is_one_autograd_call_so_a_self_recomputing_layer_recomputes_once() -> None:
    torch.manual_seed(3)
    model = [SelfRecompute(), SelfRecompute()]
    fused = _one_microbatch(copy.deepcopy(model), split=False)
    split = _one_microbatch(copy.deepcopy(model), split=True)
    assert split[2] == 2, split[2]   # W: each layer recomputed once (was once per weight group: 4)
    assert torch.equal(fused[0], split[0]) and all(torch.equal(a, b) for a, b in zip(fused[1], split[1]))


class TwoPaths(nn.Module):
    """A layer whose graph depends on its input: through ``a`` then ``b``, or through ``b`` alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) if x.sum() > 0 else self.b(x)


class Either(nn.Module):
    """A layer whose graph has one shape either way but another parameter: ``a`` or ``b``, by its input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.a if x.sum() > 0 else self.b)


@pytest.mark.parametrize("first", [TwoPaths, Either])
def test_a_graph_of_another_shape_is_split_anew_and_one_of_the_same_shape_reuses_its_recipe(
        monkeypatch: pytest.MonkeyPatch, first: type[nn.Module]) -> None:
    """The split's groups are found once per graph shape (backward.Recipe): the node types, their edges and which
    parameter each AccumulateGrad is; a microbatch whose graph differs (a data-dependent branch, another parameter)
    is analysed again, and every one gives the fused gradients bit for bit."""
    import pipeengine.runtime.stage as stage_module
    walks = []
    monkeypatch.setattr(stage_module, "walk", lambda roots: walks.append(1) or backward.walk(roots))
    torch.manual_seed(0)
    layers = [first().double(), nn.Linear(6, 6).double()]
    x = torch.randn(4, 4, 6, dtype=torch.float64)
    x[1] = -x[1].abs() - 1   # microbatch 1 takes the other path (or parameter)
    x[0], x[2], x[3] = x[0].abs() + 1, x[2].abs() + 1, x[3].abs() + 1
    gy = torch.randn(4, 4, 6, dtype=torch.float64)
    grads = {}
    for split in (False, True):
        ch = Stage(LayerChain(layers, 1), 1, 3, None, 4, segmented=True)
        ch.reset()
        for p in ch.params:
            p.grad = None
        inputs = []
        for mb in range(4):
            ch.forward(mb, x[mb].clone(), None, True)
            inputs.append(ch.backward(mb, (gy[mb],), split))
            if split:
                ch.backward_weight(mb)
        grads[split] = (inputs, [p.grad.clone() for p in ch.params])
    for (a, b) in zip(grads[False][0], grads[True][0]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert all(torch.equal(u, v) for u, v in zip(grads[False][1], grads[True][1]))
    # segmented (Either: its parameters are no torch layer's, so W needs autograd): the first layer's first shape
    # once, the other once (microbatches 2 and 3 reuse the first's recipe), the second layer's one shape; not
    # segmented (TwoPaths: Linear layers only): the stage's two shapes once each
    assert len(walks) == (3 if ch.segmented else 2) and ch.segmented == (first is Either)
