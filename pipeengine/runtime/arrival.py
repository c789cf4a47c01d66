"""A stage's received inputs (and, with segments, each layer's) as the outputs of one autograd node.

See [Note: stage boundary detach] and [Note: segments] in stage.py.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensors import floating, tree_map

__all__ = ["Arrived"]

Tensors = tuple[torch.Tensor, ...]


class _Arrival(torch.autograd.Function):
    """The stage's received inputs as the outputs of one node (see [Note: stage boundary detach])."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, arrived: "Arrived", *tensors: torch.Tensor) -> Tensors:
        ctx.arrived = arrived   # holds no tensor: outputs -> node -> ctx -> outputs would be a cycle never freed
        return tuple(t.detach() for t in tensors)   # the received storage itself, not an input: in-place allowed

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        ctx.arrived.grads = grads
        return (None,) * (2 + len(grads))


class Arrived:
    """A microbatch's floating-point inputs at a non-first stage: their metadata, and their gradients once B ran."""

    def __init__(self, tensors: Tensors) -> None:
        self.count = len(tensors)
        self.like = [(t.shape, t.dtype, t.device) for t in tensors]
        self.grads: tuple[torch.Tensor | None, ...] = ()

    def through(self, x: Any, anchor: torch.Tensor) -> tuple[Any, Tensors]:
        """``x`` with its floating tensors as outputs of an :class:`_Arrival` node, and those outputs."""
        outs = _Arrival.apply(anchor, self, *floating(x))
        it = iter(outs)
        return tree_map(x, lambda t: next(it) if t.is_floating_point() else t), tuple(outs)

    def gradients(self) -> Tensors:
        grads = self.grads or (None,) * self.count
        return tuple(g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                     for g, (shape, dtype, device) in zip(grads, self.like))
