"""One model chunk on one rank: run F, B and W for a microbatch; keep and free its activations.

[Note: stage boundary detach]
A chunk's input arrives as fresh tensors (from a recv, or detached from the previous chunk on
the same rank), made leaves with ``requires_grad=True`` when floating point. Backward of the
chunk therefore stops at its own inputs, and ``input.grad`` is exactly the gradient to send to
the previous stage. The graph never spans two chunks, so each microbatch's graph is freed by its
own backward and nothing leaks across stages.

[Note: split backward]
Zero-bubble schedules split backward into B (gradients w.r.t. the chunk's inputs only, graph
retained) and W (gradients w.r.t. the parameters, graph freed). Both run ``autograd.backward``
with an explicit ``inputs=`` list, so B never touches ``param.grad`` and W never touches the
inputs. W re-traverses the graph: simple and exact, at the price of repeating the shared part
of the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["LayerChain", "StageChunk", "as_tuple"]

Tensors = tuple[torch.Tensor, ...]


def as_tuple(x: Any) -> Tensors:
    """A layer output as a tuple of tensors (a lone tensor becomes a 1-tuple)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"a stage may only pass a Tensor or a tuple of Tensors to the next stage, got "
                    f"{type(x).__name__}{'' if not isinstance(x, (tuple, list)) else [type(t).__name__ for t in x]}")


class LayerChain(nn.Module):
    """Layers applied in order; a tuple output is passed unpacked: ``x = layer(*x)``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any) -> Any:
        x: Any = args[0] if len(args) == 1 else tuple(args)
        for layer in self.layers:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x


@dataclass
class _Saved:
    inputs: Tensors          # leaves that need grads (floating inputs of a non-first chunk)
    outputs: Tensors         # roots of backward (the loss on the last stage)


class StageChunk:
    """Runs one chunk (pipeline stage ``stage`` of ``num_stages``) for individual microbatches."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int,
                 loss_fn: Callable[[Any, Any], torch.Tensor], microbatches: int) -> None:
        self.module = module
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.saved: dict[int, _Saved] = {}
        self.peak_stored = 0
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}     # last stage, eval with return_outputs
        self._params = [p for p in module.parameters() if p.requires_grad]

    def reset(self) -> None:
        self.saved.clear()
        self.losses.clear()
        self.outputs.clear()
        self.peak_stored = 0

    def forward(self, mb: int, inputs: Tensors, target: Any, train: bool, keep_output: bool = False) -> Tensors:
        """Run F; return the outputs to send on (empty on the last stage, which keeps its loss)."""
        if not self.is_first:
            # See [Note: stage boundary detach]
            inputs = tuple(t.requires_grad_(train) if t.is_floating_point() else t for t in inputs)
        with torch.set_grad_enabled(train):
            out = self.module(*inputs)
            if self.is_last:
                loss = self.loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar Tensor, got "
                                    f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
                if keep_output:
                    self.outputs[mb] = out.detach() if isinstance(out, torch.Tensor) else out
                loss = loss / self.microbatches
                self.losses.append(loss.detach())
                outputs: Tensors = (loss,)
            else:
                outputs = as_tuple(out)
        if train:
            leaves = tuple(t for t in inputs if t.is_floating_point()) if not self.is_first else ()
            self.saved[mb] = _Saved(leaves, outputs)
            self.peak_stored = max(self.peak_stored, len(self.saved))
        return () if self.is_last else tuple(t.detach() for t in outputs)

    def _roots(self, mb: int, grads: Tensors | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        saved = self.saved[mb]
        if self.is_last:
            return [saved.outputs[0]], None
        if grads is None:
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: backward needs the output gradients")
        floats = [o for o in saved.outputs if o.is_floating_point()]
        if len(floats) != len(grads):
            raise RuntimeError(f"stage {self.stage} microbatch {mb}: got {len(grads)} output gradients "
                               f"for {len(floats)} floating-point outputs")
        pairs = [(o, g) for o, g in zip(floats, grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, mb: int) -> Tensors:
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in self.saved[mb].inputs)

    def backward(self, mb: int, grads: Tensors | None, split: bool) -> Tensors:
        """Run B; return the gradients of the chunk's floating-point inputs (empty on the first stage)."""
        roots, root_grads = self._roots(mb, grads)
        saved = self.saved[mb]
        if split:
            # See [Note: split backward]
            if saved.inputs and roots:
                torch.autograd.backward(roots, root_grads, retain_graph=True, inputs=list(saved.inputs))
            return self._input_grads(mb)
        if roots:
            torch.autograd.backward(roots, root_grads)
        result = self._input_grads(mb)
        del self.saved[mb]
        return result

    def backward_weight(self, mb: int, grads: Tensors | None) -> None:
        """Run W after a split B: accumulate parameter gradients and free the microbatch."""
        roots, root_grads = self._roots(mb, grads)
        if roots and self._params:
            torch.autograd.backward(roots, root_grads, inputs=self._params)
        del self.saved[mb]
