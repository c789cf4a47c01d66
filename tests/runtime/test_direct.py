"""W without autograd's engine ([Note: W without the engine] in pipeengine/runtime/direct.py): torch's layers whose
weight gradients W computes itself give autograd's gradients bit for bit, with no autograd call; anything it cannot
see through goes through autograd as before."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from pipeengine.models import gpt
from pipeengine.runtime import backward
from pipeengine.runtime import stage as stage_module
from pipeengine.runtime.chain import LayerChain
from pipeengine.runtime.direct import covers
from pipeengine.runtime.stage import Stage
from tests.runtime.test_backward import SelfRecompute


def _frozen(module: nn.Module, name: str) -> nn.Module:
    getattr(module, name).requires_grad_(False)
    return module


class Flat(nn.Module):
    """A 3-D input through a Linear as 2-D rows (``addmm`` without the view autograd puts around a 3-D one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(-1, 6)).reshape(x.shape)


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(6, 6),
    "linear 2-d": Flat,
    "linear without bias": lambda: nn.Linear(6, 6, bias=False),
    "linear, weight frozen": lambda: _frozen(nn.Linear(6, 6), "weight"),
    "linear, bias frozen": lambda: _frozen(nn.Linear(6, 6), "bias"),
    "layernorm": lambda: nn.LayerNorm(6),
    "layernorm without bias": lambda: nn.LayerNorm(6, bias=False),
    "conv1d": lambda: nn.Conv1d(4, 4, 3, padding=1),
    "conv1d without bias, dilated": lambda: nn.Conv1d(4, 4, 3, padding=2, dilation=2, bias=False),
    "conv1d grouped": lambda: nn.Conv1d(4, 4, 3, padding=1, groups=2),
}


def _run(layers: list[nn.Module], split: bool, x: torch.Tensor, gy: torch.Tensor,
         monkeypatch: pytest.MonkeyPatch, precision: str = "fp32") -> tuple[list[Any], list[torch.Tensor | None], int]:
    """Two microbatches through a middle stage (F, B, and W when split): the input gradients, the parameters'
    gradients and the autograd calls W made."""
    calls = []
    for module in (backward, stage_module):
        real = module.run_backward
        monkeypatch.setattr(module, "run_backward", lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    stage = Stage(LayerChain(layers, 1), 1, 3, None, 2, precision=precision, segmented=True)
    stage.reset()
    for p in stage.module.parameters():
        p.grad = None
    grads = []
    in_w = 0
    for mb in range(2):
        stage.forward(mb, x[mb].clone(), None, True)
        grads.append(stage.backward(mb, (gy[mb],), split))
        if split:
            before = len(calls)
            stage.backward_weight(mb)
            in_w += len(calls) - before
    monkeypatch.undo()
    return grads, [p.grad for p in stage.module.parameters()], in_w


def _bitwise(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                         and torch.equal(a.view(torch.int32), b.view(torch.int32)))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_kind_is_bitwise_autograds_with_no_autograd_call_in_w(name: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Two of the layer with a Tanh between (so the second's input path leads to the first's weights), float32 as
    the trainer runs; W adds the second microbatch's gradients to the first's as AccumulateGrad does."""
    make = LAYERS[name]
    torch.manual_seed(0)
    same = [make(), nn.Tanh(), make()]
    torch.manual_seed(0)
    layers = [make(), nn.Tanh(), make()]
    assert covers(LayerChain(layers, 1))
    x = torch.randn(2, 3, 4, 6)   # (microbatch, batch, channels or rows, length or features)
    gy = torch.randn_like(x)
    fused = _run(same, False, x, gy, monkeypatch)
    split = _run(layers, True, x, gy, monkeypatch)
    assert all(_bitwise(a, b) for ga, gb in zip(fused[0], split[0]) for a, b in zip(ga, gb))
    assert len(fused[1]) == len(split[1]) and all(_bitwise(a, b) for a, b in zip(fused[1], split[1]))
    assert split[2] == 0, split[2]   # no autograd call in W, the first microbatch's included


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpt_stage_runs_w_with_no_autograd_call(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast a Linear's weight reaches its matmul through a cast, which W casts back."""
    torch.manual_seed(0)
    cfg = gpt.Config(block_size=8, n_head=2, n_embd=8)
    blocks = [gpt.Block(cfg) for _ in range(2)]
    x, gy = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    fused = _run(blocks, False, x, gy, monkeypatch, precision)
    split = _run(blocks, True, x, gy, monkeypatch, precision)
    assert all(_bitwise(a, b) for ga, gb in zip(fused[0], split[0]) for a, b in zip(ga, gb))
    assert all(_bitwise(a, b) for a, b in zip(fused[1], split[1]))
    assert split[2] == 0, split[2]   # 6 groups a block (qkv, proj, fc, fc_proj, ln1, ln2), none through autograd


def test_a_tensor_hook_sends_its_group_through_autograd_and_post_accumulate_hooks_run_as_autograd_runs_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter's ``register_hook`` changes its gradient before it is added: W cannot see it, so autograd runs that
    group; ``register_post_accumulate_grad_hook`` (the gradient all-reduce's) sees the same sums in the same order."""
    seen: dict[bool, list[tuple[str, torch.Tensor]]] = {}
    results = {}
    for split in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)]
        layers[0].weight.register_hook(lambda g: g * 3)
        log: list[tuple[str, torch.Tensor]] = []
        for name, p in (("w0", layers[0].weight), ("b0", layers[0].bias), ("w2", layers[2].weight)):
            p.register_post_accumulate_grad_hook(lambda q, name=name: log.append((name, q.grad.clone())))
        x, gy = torch.randn(2, 3, 4, 6), torch.randn(2, 3, 4, 6)
        results[split] = _run(layers, split, x, gy, monkeypatch)
        seen[split] = log
    assert all(_bitwise(a, b) for a, b in zip(results[False][1], results[True][1]))
    assert sorted(n for n, _ in seen[False]) == sorted(n for n, _ in seen[True]) and len(seen[True]) == 6
    fused = {}
    for n, g in seen[False]:
        fused.setdefault(n, []).append(g)
    for n, g in seen[True]:   # per parameter, the running sums in microbatch order
        assert _bitwise(g, fused[n].pop(0)), n
    assert results[True][2] == 2   # the hooked weight's group, each microbatch


def test_what_w_computes_itself_is_torchs_own_layers() -> None:
    assert covers(gpt.Block(gpt.Config()))
    assert not covers(nn.Embedding(4, 4)) and not covers(nn.BatchNorm1d(4))

    class MyLinear(nn.Linear):   # a subclass may compute otherwise
        pass

    assert not covers(MyLinear(2, 2))
    assert covers(_frozen(nn.Sequential(nn.Linear(2, 2), nn.Embedding(3, 2)), "1"))   # frozen: no W at all
    chain = LayerChain([gpt.Block(gpt.Config()) for _ in range(2)], 1)
    assert not Stage(chain, 1, 3, None, 2, segmented=True).segmented
    assert Stage(chain, 0, 3, None, 2, segmented=True).segmented   # the first: only its first layer from its roots
    assert not Stage(chain, 1, 3, None, 2, precision="bf16", segmented=True).segmented   # the casts: W sees them


def test_saved_tensors_with_hooks_go_through_autograd_so_a_checkpointed_layer_recomputes_once_in_w() -> None:
    """Its W goes through autograd (its saved tensors' unpack hook belongs to the engine), every microbatch's, and
    recomputes each layer once."""
    torch.manual_seed(0)
    layers = [SelfRecompute(), SelfRecompute()]
    stage = Stage(LayerChain(layers, 1), 1, 3, None, 2, segmented=True)
    assert not stage.segmented   # Linear layers only: W would run without autograd but for the hooks
    stage.reset()
    x, gy = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    for mb in range(2):
        stage.forward(mb, x[mb].clone(), None, True)
        stage.backward(mb, (gy[mb],), True)
        before = sum(m.runs for m in layers)
        stage.backward_weight(mb)
        assert sum(m.runs for m in layers) - before == 2, mb   # each layer once (one GraphExecGroup)


class FullBias(nn.Module):
    """``addmm`` with a bias of the output's own shape: its gradient would be the kept gradient itself."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, 6))
        self.weight = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight.t())


def test_a_bias_of_the_gradients_shape_goes_through_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its gradient would be the very tensor B kept (which autograd clones or takes as it sees fit): W leaves that
    group to autograd; the gradients are the fused backward's."""
    torch.manual_seed(0)
    same, layers = [FullBias(), nn.Tanh(), FullBias()], [FullBias(), nn.Tanh(), FullBias()]
    for a, b in zip(same, layers):
        b.load_state_dict(a.state_dict())
    x, gy = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    fused = _run(same, False, x, gy, monkeypatch)
    split = _run(layers, True, x, gy, monkeypatch)
    assert all(_bitwise(a, b) for a, b in zip(fused[1], split[1]))
    assert split[2] == 2 + 2   # autograd for both groups, both microbatches


class HookedOutputs(nn.Module):
    """A 2-D Linear and a LayerNorm whose outputs carry tensor hooks: the hooks run on their branch nodes' incoming
    gradient (AddmmBackward0, NativeLayerNormBackward0), before the node computes dW from it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x.reshape(-1, 6))
        if y.requires_grad:
            y.register_hook(lambda g: g * 2)
        z = self.ln(torch.tanh(y))
        if z.requires_grad:
            z.register_hook(lambda g: g - 0.25)
        return z.reshape(x.shape)


def test_tensor_hooks_on_a_branch_nodes_outputs_run_once_as_in_the_fused_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B keeps what the node sees (after the hooks); W, with or without autograd, applies them once."""
    torch.manual_seed(0)
    same, layers = [HookedOutputs(), HookedOutputs()], [HookedOutputs(), HookedOutputs()]
    for a, b in zip(same, layers):
        b.load_state_dict(a.state_dict())
    x, gy = torch.randn(2, 3, 4, 6), torch.randn(2, 3, 4, 6)
    fused = _run(same, False, x, gy, monkeypatch)
    split = _run(layers, True, x, gy, monkeypatch)
    assert all(_bitwise(a, b) for ga, gb in zip(fused[0], split[0]) for a, b in zip(ga, gb))
    assert all(_bitwise(a, b) for a, b in zip(fused[1], split[1]))


def _saved_after_b(hook_a_weight: bool) -> tuple[list[bool], list[torch.Tensor | None], list[torch.Tensor | None]]:
    """A middle stage Linear, GELU, Linear, split: per microbatch whether GELU's saved input (which only the input path
    reads) is still there after B; the parameters' gradients after W; the same from a fused backward."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)]
    same = [nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)]
    for a, b in zip(same, layers):
        a.load_state_dict(b.state_dict())
    if hook_a_weight:
        for m in (layers, same):
            m[0].weight.register_hook(lambda g: g * 3)
    nodes: list[Any] = []
    layers[1].register_forward_hook(lambda _m, _i, out: nodes.append(out.grad_fn))
    x, gy = torch.randn(2, 3, 4, 6), torch.randn(2, 3, 4, 6)
    kept, grads = [], []
    for split, chain in ((True, layers), (False, same)):
        stage = Stage(LayerChain(chain, 1), 1, 3, None, 2, segmented=True)
        stage.reset()
        for mb in range(2):
            stage.forward(mb, x[mb].clone(), None, True)
            stage.backward(mb, (gy[mb],), split)
            if split:
                try:
                    nodes[-1]._saved_self
                    kept.append(True)
                except RuntimeError:   # "... saved tensors after they have already been freed"
                    kept.append(False)
                stage.backward_weight(mb)
        grads.append([p.grad for p in stage.module.parameters()])
    return kept, grads[0], grads[1]


def test_b_frees_what_w_does_not_read_and_keeps_the_graph_where_w_needs_autograd() -> None:
    """[Note: B frees what W does not read] in backward.py: with every group run without autograd, GELU's saved input
    goes at B; a weight with a tensor hook sends its group through autograd, which needs the graph: kept until W.
    The gradients are the fused backward's bit for bit either way."""
    freed, split, fused = _saved_after_b(hook_a_weight=False)
    assert freed == [False, False]
    assert all(_bitwise(a, b) for a, b in zip(split, fused))
    kept, split, fused = _saved_after_b(hook_a_weight=True)
    assert kept == [True, True]
    assert all(_bitwise(a, b) for a, b in zip(split, fused))
