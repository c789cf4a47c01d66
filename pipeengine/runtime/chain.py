"""A stage's layers applied in order, as ``nn.Sequential`` applies them, each drawing from its own random stream.

A layer that cannot take its input raises :class:`LayerError` naming it (see :class:`LayerChain`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .rng import generator_of, layer_seed
from .tensors import describe_value, device_of

__all__ = ["LayerChain", "LayerError"]


class LayerError(ValueError):
    """A layer could not run on its input; the message names the layer, its stage and the input's shapes."""

    def __init__(self, message: str, layer: int) -> None:
        super().__init__(message)
        self.layer = layer


class LayerChain(nn.Module):
    """Layers applied in order, one argument each, exactly as ``nn.Sequential`` does (a tuple stays a tuple).

    ``first`` is the model index of the first layer. With a ``key`` (rng.microbatch_key), each layer draws
    from its own stream: the generator of the input's device is seeded from (key, global layer index)
    before it runs (see [Note: randomness belongs to the model] in rng.py). Until the chain has run
    once, a layer that raises (typically on a shape or dtype it cannot take) raises :class:`LayerError`
    naming it and its input; later errors pass unchanged (a bug, not an input that does not fit).
    """

    def __init__(self, layers: list[nn.Module], first: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first
        self.ran = False
        self._generator: torch.Generator | None = None

    def forward(self, x: Any, key: int | None = None, between: Callable[[Any], Any] | None = None) -> Any:
        """``between``: applied to every layer's output but the last's (a segmented stage's cut)."""
        last = len(self.layers) - 1
        i = 0
        try:
            for i, layer in enumerate(self.layers):
                if key is not None:
                    self._seed(x, key, i)
                x = layer(x)
                if between is not None and i < last:
                    x = between(x)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            if self.ran or isinstance(exc, (LayerError, torch.OutOfMemoryError)):
                raise   # (once the chain ran, an error is a bug, not an input that does not fit)
            raise LayerError(f"layer {self.first + i} ({type(self.layers[i]).__name__}) cannot take its input "
                             f"{describe_value(x)}: {(str(exc).splitlines() or [''])[0]}", self.first + i) from exc
        self.ran = True
        return x

    def _seed(self, x: Any, key: int, i: int) -> None:
        """Seed layer ``i``'s stream (the generator of the input's device)."""
        if self._generator is None:
            self._generator = generator_of(device_of(x, tuple(self.parameters())))
        self._generator.manual_seed(layer_seed(key, self.first + i))
