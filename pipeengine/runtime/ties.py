"""Tied parameters: one logical parameter held at several layers, perhaps at several positions."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ties", "share_tied"]

Tie = Sequence[tuple[int, str]]   # (layer index, parameter name) entries that are one logical parameter


def share_tied(layers: dict[int, nn.Module], tie: Tie) -> list[nn.Parameter]:
    """Make the copies of one tied parameter held in ``layers`` one Parameter object; return it (or []).

    The first entry of ``tie`` present here wins. Sharing the object is what ``nn.Sequential`` with
    tied weights does: autograd sums the gradients and the optimizer sees one parameter.
    """
    local = [(i, name) for i, name in tie if i in layers]
    if not local:
        return []
    first = layers[local[0][0]].get_parameter(local[0][1])
    for i, name in local[1:]:
        owner_path, _, pname = name.rpartition(".")
        owner = layers[i].get_submodule(owner_path) if owner_path else layers[i]
        old = owner.get_parameter(pname)
        if old.shape != first.shape or old.dtype != first.dtype:
            raise ValueError(f"tied parameters differ: layer {local[0][0]} {local[0][1]} is {tuple(first.shape)} "
                             f"{first.dtype}, layer {i} {name} is {tuple(old.shape)} {old.dtype}")
        setattr(owner, pname, first)
    return [first]


class Ties:
    """Parameters that are one logical parameter (``tied``: groups of ``(layer index, name)``): one
    Parameter object per rank (:func:`share_tied`), the first entry's value everywhere at the start,
    gradients summed over the positions holding a copy, counted once in the norm (by the first)."""

    def __init__(self, tied: Sequence[Tie], num_layers: int, position_of_layer: Callable[[int], int]) -> None:
        for tie in tied:
            for i, _ in tie:
                if not 0 <= i < num_layers:
                    raise ValueError(f"tied parameter names layer {i}, but the model has {num_layers} layers")
        self.tied = [list(tie) for tie in tied]
        self.positions = [tuple(sorted({position_of_layer(i) for i, _ in tie})) for tie in tied]
        self._sources = [position_of_layer(tie[0][0]) for tie in tied]
        self.copies: list[tuple[nn.Parameter, Any, int]] = []   # (this rank's copy, tie group, source rank)
        self.norm_skip: set[int] = set()                        # ids of copies another position counts

    def aliases(self) -> dict[str, list[str]]:
        """Global key of every tied entry -> the keys of all entries of its tie (``layers.<i>.<name>``)."""
        return {f"layers.{i}.{n}": [f"layers.{j}.{m}" for j, m in tie] for tie in self.tied for i, n in tie}

    def share(self, layers: dict[int, nn.Module], tie_groups: dict[tuple[int, ...], Any], position: int,
              global_rank: Callable[[int], int]) -> None:
        """Tie this rank's copies (``layers``: its built layers by index) once the groups exist."""
        for tie, positions, source in zip(self.tied, self.positions, self._sources):
            shared = share_tied(layers, tie)
            if len(positions) > 1 and shared:
                self.copies.append((shared[0], tie_groups[positions], global_rank(source)))
                if position != source:
                    self.norm_skip.add(id(shared[0]))

    def broadcast(self) -> None:
        with torch.no_grad():
            for p, group, src in self.copies:
                dist.broadcast(p.data, src=src, group=group)

    def sum_grads(self, wait: Callable[[Any, Sequence[int]], None]) -> None:
        for p, group, _ in self.copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            wait(dist.all_reduce(p.grad, group=group, async_op=True), dist.get_process_group_ranks(group))
