"""This rank's part of the model: its stages built from the plan, tied, and started equal to their replicas."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .grad_sync import broadcast_buffers
from .layers import LayerSpec, build_layer
from .plan import Plan
from .chain import LayerChain
from .stage import Stage
from .ties import Ties
from .topology import ProcessGroups, Topology, build_groups

__all__ = ["LocalModel"]


class LocalModel:
    """The stages one rank runs (``stages[c]`` is its chunk c), their parameters and buffers, its groups.

    Only this rank's layers are built (see [Note: per-stage construction] in layers.py). Tied copies
    become one Parameter per rank and take the tie's first entry's value; DP replicas take replica
    0's parameters and buffers. Collective: every rank builds its LocalModel at the same point.
    """

    def __init__(self, plan: Plan, specs: Sequence[LayerSpec], topology: Topology, rank: int,
                 tied: Sequence[Sequence[tuple[int, str]]], seed: int, device: torch.device,
                 make_stage: Callable[[LayerChain, int], Stage]) -> None:
        position = topology.position_of(rank)
        replica = topology.replica_of(rank)
        mine = {i: build_layer(specs[i], i, seed) for s in plan.stages_at(position) for i in plan.layers_of(s)}
        self.ties = Ties(tied, plan.num_layers, plan.position_of_layer)
        self.groups: ProcessGroups = build_groups(topology, rank, ties=self.ties.positions)
        self.ties.share(mine, self.groups.tie_groups, position, lambda p: topology.rank(p, replica))
        self.stages = [make_stage(LayerChain([mine[i] for i in plan.layers_of(s)], plan.bounds[s]).to(device), s)
                       for s in plan.stages_at(position)]
        del mine
        self.parameters: list[nn.Parameter] = list({id(p): p for st in self.stages
                                                   for p in st.module.parameters()}.values())
        self.buffers = [b for st in self.stages for b in st.module.buffers()]
        self._start_equal(topology, position)

    def _start_equal(self, topology: Topology, position: int) -> None:
        with torch.no_grad():
            if topology.dp > 1:
                src = topology.rank(position, 0)
                for p in self.parameters:
                    dist.broadcast(p.data, src=src, group=self.groups.dp_group)
                broadcast_buffers(self.buffers, src, self.groups.dp_group)
        self.ties.broadcast()
        # every rank joins one world collective first (NCCL wants that before subset p2p batches)
        dist.barrier()

    def saved_buffers(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.buffers]

    def restore_buffers(self, saved: list[Any]) -> None:
        with torch.no_grad():
            for b, value in zip(self.buffers, saved):
                b.copy_(value)
