"""Per-layer costs without running anything: FLOPs and saved bytes of each layer built on the meta device.

[Note: layer costs on meta]
For the dry run (``python -m pipeengine.plan``) each kind of layer is built once on the meta device (shapes and
dtypes, no memory, no compute) and run forward and backward on one meta microbatch:

* **FLOPs** by ``torch.utils.flop_counter.FlopCounterMode``: the forward's F; the backward's total split into W,
  the weight gradients (for every ``linear``, the same FLOPs as its forward product), and B, the rest (input
  gradients, and attention's backward, 2.5x its forward). Causal attention is counted at half the FLOPs the
  counter gives for the full square (the kernels skip the masked half). Seconds = FLOPs / (the GPU's dense peak x
  ``mfu``, the fraction of peak the kernels reach: one figure for every kind of work, an assumption).
* **Bytes kept for backward** by ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
  left out, as the engine's profile counts them (runtime/profile.py). Autocast does nothing on meta tensors, so
  :class:`_Autocast` applies bf16 autocast's casts itself (CUDA's lists: matrix products and attention in bf16;
  layer norm, softmax and the loss in fp32), which keeps the residual stream in fp32 as on a GPU. A weight's bf16
  copy is autocast's cached cast: one per weight for the step (runtime/stage.py, [Note: one weight cast per step]),
  counted apart (``cast_bytes``), not per microbatch. Attention is the fused kernel a GPU runs
  (``_scaled_dot_product_flash_attention``: it keeps q, k, v, its output and the log-sum-exp, not the score
  matrix; the meta device would otherwise take the math path).
* **A split backward's bytes**, on a second forward without the counting hooks (which would send W through
  autograd): where every trained parameter's gradient leaves at a node W computes itself (runtime/direct.py), the
  bytes of the gradients arriving at those nodes (B keeps them for W) and the bytes of the saved tensors W reads;
  the rest of what the layer keeps a split B frees (runtime/backward.py, [Note: B frees what W does not read]).
  Elsewhere the engine's defaults: the layer's output kept for W, nothing freed.
* **Parameters** in fp32 (the engine's bf16 mode: fp32 parameters, gradients and AdamW state).

Layers of one kind are measured once: a 70B's 80 blocks cost one block's measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..runtime import direct
from ..runtime.backward import accumulators, walk, weight_groups
from ..runtime.measured import LayerCost
from ..runtime.tensors import flat

__all__ = ["LayerWork", "measure_layer", "gpt_work", "layer_costs", "gpt_config"]

_LOW = (F.linear, torch.matmul, torch.bmm, torch.mm, F.scaled_dot_product_attention)
_FP32 = (F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.mse_loss)


@dataclass(frozen=True)
class LayerWork:
    """One layer on one microbatch: FLOPs of F, B (input gradients) and W (weight gradients), bytes kept for backward
    (its output not among them), its output's bytes, its fp32 parameters' bytes and its weights' bf16 copies."""

    forward: float
    input_grad: float
    weight_grad: float
    saved_bytes: int
    output_bytes: int
    param_bytes: int
    cast_bytes: int
    kind: str = ""
    tied_bytes: int = 0        # of its parameter bytes, those that are another layer's (a tie: each keeps a copy)
    held_for_w: int = 0        # bytes of the gradients a split B keeps for W (0: not known, its output's)
    freed_at_b: int = 0        # of saved_bytes, those a split B frees (W does not read them)

    @property
    def flops(self) -> float:
        return self.forward + self.input_grad + self.weight_grad


class _Autocast(TorchFunctionMode):
    """bf16 autocast's casts for meta tensors (see [Note: layer costs on meta]); weights cast once, cached."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}
        self.weight_flops = 0.0        # a forward product's FLOPs per linear: what its weight gradient costs
        self.sdpa_flops = 0.0          # causal attention's FLOPs the counter counts and the kernel skips

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if isinstance(x, (tuple, list)):
            return type(x)(self._cast(t, dtype) for t in x)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype:
            return x
        if isinstance(x, nn.Parameter):
            if id(x) not in self.cache:
                self.cache[id(x)] = x.to(dtype)
            return self.cache[id(x)]
        return x.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LOW:
            args, kwargs = self._cast(args, self.dtype), {k: self._cast(v, self.dtype) for k, v in kwargs.items()}
        elif func in _FP32:
            args = (self._cast(args[0], torch.float32), *args[1:])
        if func is F.linear:
            x, weight = args[0], args[1]
            self.weight_flops += 2.0 * x.numel() * weight.shape[0]
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None, **rest: Any) -> torch.Tensor:
        """The fused kernel a GPU runs (q, k, v, output and log-sum-exp kept); the math path only with a mask."""
        if attn_mask is not None or rest:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, **rest)
        if is_causal:   # forward 4 b h t^2 d in the counter, backward 2.5x that; the kernel does half of each
            self.sdpa_flops += 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
        first: torch.Tensor = out[0]
        return first


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in flat(x))


def _split_bytes(layer: nn.Module, x: Any, loss: Callable[[Any], torch.Tensor] | None,
                 dtype: torch.dtype) -> tuple[int, int | None]:
    """(bytes of the gradients B keeps for W, bytes of the saved tensors W reads) of ``layer`` on ``x``, its weight
    groups found and bound as the engine's B finds and binds them (backward.weight_groups, direct.bind_all); the
    second None where B would keep the graph (see [Note: layer costs on meta])."""
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    with _Autocast(dtype):
        out = layer(x)
        root = loss(out) if loss is not None else out
    roots = tuple(t for t in flat(root) if t.requires_grad)
    inputs = tuple(t for t in flat(x) if t.requires_grad)
    groups, rest = weight_groups(walk(roots), inputs, params, accumulators(params))
    for g in groups:
        g.direct = direct.plan(g.nodes, g.params)
    bound = direct.bind_all(groups) if not rest else None
    held = [0]
    for node in (n for g in groups for n in g.nodes):
        node.register_prehook(lambda grads: held.__setitem__(0, held[0] + _nbytes(grads)))
    torch.autograd.backward(roots, [torch.empty_like(t) for t in roots])
    return held[0], None if bound is None else direct.read_bytes(bound, layer.parameters())


def measure_layer(layer: nn.Module, x: Any, loss: Callable[[Any], torch.Tensor] | None = None,
                  dtype: torch.dtype = torch.bfloat16, kind: str = "") -> tuple[LayerWork, Any]:
    """``layer`` (on meta) forward and backward on meta input ``x`` (floating tensors require grad: the engine's
    received inputs do); ``loss(output)`` for the model's last layer. Returns its work and its output (detached, the
    next layer's input)."""
    from torch.utils.flop_counter import FlopCounterMode
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in casts:
            saved[storage._cdata] = storage.nbytes()
        return t

    mode = _Autocast(dtype)
    casts: set[int] = set()
    with FlopCounterMode(display=False) as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with mode:
            out = layer(x)
            root = loss(out) if loss is not None else out
        casts.update(c.untyped_storage()._cdata for c in mode.cache.values())
    for c in casts:
        saved.pop(c, None)
    grads = [torch.empty_like(t) for t in flat(root) if t.requires_grad]
    with FlopCounterMode(display=False) as backward:
        torch.autograd.backward([t for t in flat(root) if t.requires_grad], grads)
    w = mode.weight_flops
    work = LayerWork(forward=forward.get_total_flops() - mode.sdpa_flops,
                     input_grad=max(0.0, backward.get_total_flops() - 2.5 * mode.sdpa_flops - w), weight_grad=w,
                     saved_bytes=sum(saved.values()), output_bytes=_nbytes(out) if loss is None else 0,
                     param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                     cast_bytes=sum(c.numel() * c.element_size() for c in mode.cache.values()), kind=kind)
    held, read = _split_bytes(layer, x, loss, dtype)
    if read is not None:
        work = dataclasses.replace(work, held_for_w=held, freed_at_b=max(0, work.saved_bytes - read))
    nxt = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in out) if isinstance(out, tuple) else (
        out.detach().requires_grad_(out.is_floating_point()))
    return work, nxt


def gpt_config(preset: str | None, **sizes: int | None) -> Any:
    """The built-in GPT's Config: a preset of models/presets.py (``PRESETS`` or the dry run's ``PLAN_SIZES``; None:
    7b), with any size replaced (ValueError when the result is not a valid GPT)."""
    gpt = importlib.import_module("pipeengine.models.gpt")   # the example models: outside the layers, untyped
    sizes_for_plans = importlib.import_module("pipeengine.models.presets").PLAN_SIZES
    known = {**{k: v() for k, v in gpt.presets().items()}, **{k: gpt.Config(**v) for k, v in sizes_for_plans.items()}}
    if preset is not None and preset not in known:
        raise ValueError(f"unknown gpt preset {preset!r}; choose one of {', '.join(known)}")
    base = known[preset or "7b"]
    given = {k: v for k, v in sizes.items() if v is not None}
    return dataclasses.replace(base, **given)   # Config checks the sizes (heads divide the width, all >= 1)


@contextlib.contextmanager
def _quiet_rng() -> Iterator[None]:
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        yield


def gpt_work(cfg: Any, micro_batch: int) -> list[LayerWork]:
    """Per layer of the built-in GPT ([embedding, block x n_layer, head with the loss]) its work on a microbatch of
    ``micro_batch`` sequences of the context length; one block measured for all. The head's weight is tied to the
    embedding's and both layers count it in ``param_bytes``: the engine keeps one copy per entry of a tie, also when
    both sit on one position (runtime/ties.py, [Note: tied copies are summed in tie order]), so memory counts both
    copies wherever they sit; ``tied_bytes`` marks the head's copy, left out only of the parameter count."""
    gpt = importlib.import_module("pipeengine.models.gpt")
    makers, loss_fn = gpt.layer_factories(cfg), gpt.loss_fn
    tokens = torch.empty(micro_batch, cfg.block_size, dtype=torch.long, device="meta")
    with _quiet_rng():
        first, x = measure_layer(makers[0](), tokens, kind="embedding")
        block, y = measure_layer(makers[1](), x, kind="block")
        made = makers[-1]()
        head, _ = measure_layer(made, y, loss=lambda out: loss_fn(out, tokens), kind="head")
    tied = made.lm_head.weight
    return [first, *[block] * cfg.n_layer, dataclasses.replace(head, tied_bytes=tied.numel() * tied.element_size())]


def layer_costs(work: Sequence[LayerWork], tflops: float, mfu: float) -> list[LayerCost]:
    """Seconds per layer at ``mfu`` x ``tflops`` (see [Note: layer costs on meta]), in the profile's form."""
    rate = tflops * 1e12 * mfu
    return [LayerCost(w.forward / rate, w.input_grad / rate, w.weight_grad / rate,
                      (w.input_grad + w.weight_grad) / rate, activation_bytes=w.saved_bytes + w.output_bytes,
                      param_bytes=w.param_bytes, kind=w.kind, output_bytes=w.output_bytes, held_for_w=w.held_for_w,
                      freed_at_b=w.freed_at_b) for w in work]
