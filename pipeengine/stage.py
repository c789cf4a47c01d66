"""One model chunk on one rank: F, B and W for a microbatch, activation checkpointing, precision, freeing.

[Note: stage boundary detach]
A chunk's input arrives as fresh tensors (from a receive, or detached from the previous chunk
on the same rank) and its floating-point tensors become leaves with ``requires_grad=True``.
Backward of the chunk therefore stops at its own inputs and ``input.grad`` is exactly what the
previous stage needs. The graph never spans two chunks.

[Note: free at the earliest point]
Per microbatch a chunk keeps only what backward needs, and only as long as it needs it:

    what                         kept until        why
    input leaves (received)      B                 B computes their gradients
    output roots                 B (W if split)    autograd needs the node, not the data:
                                                   their storage is swapped for an empty one
                                                   right after F (the wire still holds the
                                                   sent alias until the send completed)
    received output gradients    B (W if split)    W re-runs the backward from them

Backward then runs from roots whose data is gone, so it calls autograd's engine directly
(``torch.autograd.backward`` would compare the gradient's shape with the emptied root), as
Megatron's ``deallocate_output_tensor`` does. An output that is a view, or that is one of the
chunk's inputs, keeps its data (freeing it would free someone else's).

[Note: split backward]
Zero-bubble schedules split backward into B (gradients of the chunk's inputs only, graph kept)
and W (gradients of the parameters, graph freed), both from the same roots with an explicit
``inputs=`` list: B never touches ``param.grad`` and W never touches the inputs.

[Note: activation checkpointing]
``checkpoint="full"`` runs the chunk's layers as one ``torch.utils.checkpoint`` region
(non-reentrant, RNG state preserved), so a microbatch keeps only its chunk input until its
backward recomputes the rest; ``"every:K"`` makes one region of every K consecutive layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = ["LayerChain", "LayerError", "StageChunk", "PRECISIONS", "parse_checkpoint"]

Tensors = tuple[torch.Tensor, ...]
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class LayerError(ValueError):
    """A layer could not run on its input; the message names the layer, its stage and the input's shapes."""

    def __init__(self, message: str, layer: int) -> None:
        super().__init__(message)
        self.layer = layer


class LayerChain(nn.Module):
    """Layers applied in order, one argument each, exactly as ``nn.Sequential`` does (a tuple stays a tuple).

    ``first`` is the model index of the first layer (for messages). Until the chain has run once,
    a layer that raises (typically on a shape or dtype it cannot take) raises :class:`LayerError`
    naming it and its input; later errors pass unchanged (a bug, not an input that does not fit).
    """

    def __init__(self, layers: list[nn.Module], first: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.ran = False

    def forward(self, x: Any) -> Any:
        if self.ran:
            for layer in self.layers:
                x = layer(x)
            return x
        i = 0
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x)
            self.ran = True
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            if isinstance(exc, (LayerError, torch.OutOfMemoryError)):
                raise
            raise LayerError(f"layer {self.first + i} ({type(self.layers[i]).__name__}) cannot take its input "
                             f"{describe_value(x)}: {(str(exc).splitlines() or [''])[0]}", self.first + i) from exc
        return x


def describe_value(x: Any) -> str:
    """Shapes and dtypes of the tensors in ``x``, e.g. ``(4, 16) float32``."""
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in _flat(x)]
    return "[" + ", ".join(parts) + "]" if len(parts) != 1 else parts[0]


def parse_checkpoint(spec: str) -> int | None:
    """Layers per checkpoint region: ``none`` -> None, ``full`` -> 0 (the whole chunk), ``every:K`` -> K."""
    if spec == "none":
        return None
    if spec == "full":
        return 0
    if spec.startswith("every:") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return int(spec[6:])
    raise ValueError(f"checkpoint must be 'none', 'full' or 'every:K' with K >= 1 layers per region (got {spec!r})")


def _deallocate(t: torch.Tensor, inputs: Tensors) -> None:
    """Swap a root's storage for an empty one (see [Note: free at the earliest point])."""
    if t.grad_fn is not None and t._base is None and not any(t is x for x in inputs):
        t.data = torch.empty((0,), dtype=t.dtype, device=t.device)


def _run_backward(roots: Tensors, grads: Tensors, inputs: Tensors, keep_graph: bool) -> None:
    torch.autograd.Variable._execution_engine.run_backward(
        roots, grads, keep_graph, False, inputs, allow_unreachable=True, accumulate_grad=True)


@dataclass
class _Saved:
    inputs: Tensors                  # leaves that need gradients (floating inputs of a non-first chunk)
    roots: Tensors                   # where backward starts (the scaled loss on the last stage)
    grads: Tensors = field(default=())   # gradients of the roots (kept for W when backward is split)


class StageChunk:
    """Runs one chunk (pipeline stage ``stage`` of ``num_stages``) for individual microbatches."""

    def __init__(self, module: LayerChain, stage: int, num_stages: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 microbatches: int, checkpoint: str = "none", precision: str = "fp32") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
        self.module = module
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.dtype = PRECISIONS[precision]      # autocast and wire dtype; None: fp32 throughout
        self.loss_scale = 1.0                   # fp16: the engine's dynamic loss scale
        per = parse_checkpoint(checkpoint)
        layers = list(module.layers)
        self.regions: list[LayerChain] | None = None
        if per is not None:
            size = per or len(layers)
            self.regions = [LayerChain(layers[i:i + size], module.first + i) for i in range(0, len(layers), size)]
        self.saved: dict[int, _Saved] = {}
        self.peak_stored = 0
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}     # last stage, eval with return_outputs
        self._params = tuple(p for p in module.parameters() if p.requires_grad)
        self.nonfinite = torch.zeros(2)         # this step: (non-finite outputs or loss, non-finite input grads)

    def reset(self) -> None:
        self.nonfinite = torch.zeros(2, dtype=torch.float64, device=_device_of((), self._params))
        self.saved.clear()
        self.losses.clear()
        self.outputs.clear()
        self.peak_stored = 0

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def _layers(self, x: Any) -> Any:
        if self.regions is None:
            return self.module(x)
        for region in self.regions:
            x = _checkpoint(region, x, use_reentrant=False, preserve_rng_state=True)
        return x

    def forward(self, mb: int, x: Any, target: Any, train: bool, keep_output: bool = False) -> Any:
        """Run F on one argument ``x``; return what to pass on (None on the last stage, which keeps its loss)."""
        inputs: Tensors = ()
        if not self.is_first:   # See [Note: stage boundary detach]
            inputs = tuple(_leaves(x))
            for t in inputs:
                t.requires_grad_(train)
        with torch.set_grad_enabled(train):
            with self._autocast(_device_of(x, self._params)):
                try:
                    out = self._layers(x)
                except LayerError as exc:
                    came = (f" (that input is the output of stage {self.stage - 1}, whose last layer is layer "
                            f"{exc.layer - 1})" if not self.is_first and exc.layer == self.module.first else "")
                    raise LayerError(f"stage {self.stage}: {exc}{came}", exc.layer) from exc.__cause__
            if self.is_last:
                loss = self.loss_fn(_to_float(out), target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar Tensor, got "
                                    f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
                if keep_output:
                    self.outputs[mb] = _detach(out)
                loss = loss.reshape(()) / self.microbatches
                self.losses.append(loss.detach())
                roots: Tensors = (loss * self.loss_scale,) if train else ()
            else:
                if self.dtype is not None:   # activations travel in the low precision
                    out = _map(out, lambda t: t.to(self.dtype) if t.is_floating_point() else t)
                roots = tuple(t for t in _flat(out) if t.is_floating_point())
        if not train:
            return None if self.is_last else out
        self._count_nonfinite(0, roots)
        self.saved[mb] = _Saved(inputs, roots)
        self.peak_stored = max(self.peak_stored, len(self.saved))
        if self.is_last:
            return None
        passed = _detach(out)
        for t in roots:
            _deallocate(t, inputs)
        return passed

    def backward(self, mb: int, grads: Tensors | None, split: bool) -> Tensors:
        """Run B; return the gradients of the chunk's floating-point inputs (empty on the first stage)."""
        saved = self.saved[mb]
        root_grads = self._root_grads(mb, saved, grads)
        pairs = [(r, g) for r, g in zip(saved.roots, root_grads) if r.requires_grad]
        roots, rgrads = tuple(r for r, _ in pairs), tuple(g for _, g in pairs)
        if split:   # See [Note: split backward]
            if saved.inputs and roots:
                _run_backward(roots, rgrads, saved.inputs, keep_graph=True)
            saved.grads = root_grads
        elif roots:
            _run_backward(roots, rgrads, (), keep_graph=False)
        result = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in saved.inputs)
        self._count_nonfinite(1, result)
        saved.inputs = ()
        if not split:
            del self.saved[mb]
        return result

    def backward_weight(self, mb: int) -> None:
        """Run W after a split B: accumulate the parameter gradients and free the microbatch."""
        saved = self.saved.pop(mb)
        pairs = [(r, g) for r, g in zip(saved.roots, saved.grads) if r.requires_grad]
        if pairs and self._params:
            _run_backward(tuple(r for r, _ in pairs), tuple(g for _, g in pairs), self._params, keep_graph=False)

    def _count_nonfinite(self, i: int, tensors: Tensors) -> None:
        """Count tensors holding a NaN or inf into ``nonfinite[i]`` (a sum per tensor, no host sync)."""
        for t in tensors:
            total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
            self.nonfinite[i] += (~torch.isfinite(total)).double()

    def _root_grads(self, mb: int, saved: _Saved, grads: Tensors | None) -> Tensors:
        if self.is_last:
            return (torch.ones_like(saved.roots[0]),)
        if grads is None:
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: backward needs the output gradients")
        if len(grads) != len(saved.roots):
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: got {len(grads)} output gradients "
                               f"for {len(saved.roots)} floating-point outputs")
        return grads


def _flat(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for t in x:
            yield from _flat(t)


def _leaves(x: Any) -> Iterator[torch.Tensor]:
    return (t for t in _flat(x) if t.is_floating_point())


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(t, fn) for t in x)
    return x


def _detach(x: Any) -> Any:
    return _map(x, lambda t: t.detach())


def _to_float(x: Any) -> Any:
    return _map(x, lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)


def _device_of(x: Any, params: Tensors) -> torch.device:
    for t in _flat(x):
        return t.device
    return params[0].device if params else torch.device("cpu")
