"""Tied parameters: one logical parameter held at several layers, perhaps at several positions.

[Note: tied copies are summed in tie order]
Every entry of a tie keeps its own Parameter, also when two entries sit on one rank: each copy
accumulates its own gradient over the step's microbatches, and after backward the copies' gradients
are summed in the tie's order (locally, then over the positions holding copies) and given to every
copy, so their updates stay identical. Sharing one object on a rank (what ``nn.Sequential`` with
tied weights does) would let autograd interleave the two uses microbatch by microbatch, a different
floating-point sum than across ranks: the losses would then depend on where the model was split.
For a tie of two entries the sum is exactly the same at every split (a + b); the cost is one more
copy of the parameter and its optimizer state on a rank that holds both ends.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ties", "Tie"]

Tie = Sequence[tuple[int, str]]   # (layer index, parameter name) entries that are one logical parameter


def _copy(layers: dict[int, nn.Module], i: int, name: str) -> nn.Parameter:
    return layers[i].get_parameter(name)


class Ties:
    """Parameters that are one logical parameter (``tied``: groups of ``(layer index, name)``): the first
    entry's value everywhere at the start, gradients summed in tie order (see the module note), counted
    once in the gradient norm (the first entry's copy)."""

    def __init__(self, tied: Sequence[Tie], num_layers: int, position_of_layer: Callable[[int], int]) -> None:
        for tie in tied:
            for i, _ in tie:
                if not 0 <= i < num_layers:
                    raise ValueError(f"tied parameter names layer {i}, but the model has {num_layers} layers")
        self.tied = [list(tie) for tie in tied]
        self.positions = [tuple(sorted({position_of_layer(i) for i, _ in tie})) for tie in tied]
        self._sources = [position_of_layer(tie[0][0]) for tie in tied]
        # per tie: (this rank's copies in tie order, the tie's group or None, the rank holding the first entry)
        self.copies: list[tuple[list[nn.Parameter], Any, int]] = []
        self.norm_skip: set[int] = set()   # ids of copies the norm leaves out (all but the first entry's)

    def aliases(self) -> dict[str, list[str]]:
        """Global key of every tied entry -> the keys of all entries of its tie (``layers.<i>.<name>``)."""
        return {f"layers.{i}.{n}": [f"layers.{j}.{m}" for j, m in tie] for tie in self.tied for i, n in tie}

    def share(self, layers: dict[int, nn.Module], tie_groups: dict[tuple[int, ...], Any], position: int,
              global_rank: Callable[[int], int]) -> None:
        """Find this rank's copies (``layers``: its built layers by index) once the groups exist."""
        for tie, positions, source in zip(self.tied, self.positions, self._sources):
            mine = [_copy(layers, i, name) for i, name in tie if i in layers]
            if not mine:
                continue
            first = tie[0][0] in layers
            for k, p in enumerate(mine):
                if p.shape != mine[0].shape or p.dtype != mine[0].dtype:
                    raise ValueError(f"tied parameters differ: {tie[0]} is {tuple(mine[0].shape)} {mine[0].dtype}, "
                                     f"a copy is {tuple(p.shape)} {p.dtype}")
                if k or not first:
                    self.norm_skip.add(id(p))
            group = tie_groups[positions] if len(positions) > 1 else None
            self.copies.append((mine, group, global_rank(source)))

    def broadcast(self) -> None:
        """Every copy takes the first entry's value."""
        with torch.no_grad():
            for mine, group, src in self.copies:
                if group is not None:
                    dist.broadcast(mine[0].data, src=src, group=group)
                for p in mine[1:]:
                    p.data.copy_(mine[0].data)

    def sum_grads(self, wait: Callable[[Any, Sequence[int]], None]) -> None:
        """Every copy's gradient becomes the sum of all copies' in tie order (see the module note)."""
        for mine, group, _ in self.copies:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mine]
            total = grads[0].clone() if len(grads) > 1 else grads[0]
            for g in grads[1:]:
                total += g
            if group is not None:
                wait(dist.all_reduce(total, group=group, async_op=True), dist.get_process_group_ranks(group))
            for p, g in zip(mine, grads):
                if g is not total:
                    g.copy_(total)
                p.grad = g
