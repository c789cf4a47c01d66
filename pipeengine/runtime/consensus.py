"""The collectives that end a step: one all-reduce over the pipeline, and the loss summed over replicas.

[Note: the end of a step]
The DP all-reduce of a rank's gradients is posted bucket by bucket, asynchronously: on CUDA from
inside the backward that finalises each bucket (grad_sync.py), elsewhere right after the last
backward (B or W) in the rank's program, so it overlaps the cooldown of the other positions; it is
awaited after the program ends. Tied copies are then summed over their tie group. One all-reduce
over the pipeline then carries the squared gradient norm (once per logical parameter), the loss
and, per stage, whether its outputs or gradients went non-finite (numerics.SignalVector); the loss
is summed over the replicas (each microbatch's loss was divided by the step's microbatches over every
replica: the sum is the global batch's mean) on the device, with each replica's origin (where it went
non-finite first), and the host reads the two results, with which parameters got gradients, in one
read through the watch ([Note: no hidden syncs] in device.py). Every rank thus takes the same decision: step, skip
(``on_nonfinite="skip"``: parameters, optimizer state and buffers unchanged) or raise
``NonFiniteError`` naming the first stage that went non-finite (``"stop"``). Every wait is timed
and watched (faults.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .device import constant
from .faults import Watch
from .numerics import SignalVector, StepSignals
from .plan import Plan
from .stage import Stage
from .topology import ProcessGroups, Topology

__all__ = ["Consensus", "Decision"]

Wait = Callable[[Any, str, Sequence[int]], None]


class Consensus:
    """This rank's part in the end-of-step collectives (see the module note)."""

    def __init__(self, topology: Topology, rank: int, groups: ProcessGroups, num_stages: int, last_position: int,
                 device: torch.device, wait: Wait, watcher: Watch) -> None:
        self.topology, self.groups, self.num_stages, self.device, self.wait = topology, groups, num_stages, device, wait
        self.rank = rank
        self.watch = watcher   # reads what the device computed (polled on CUDA, see faults.Watch.host_values)
        position, replica = topology.position_of(rank), topology.replica_of(rank)
        self.last_rank = topology.rank(last_position, replica)   # where the loss is computed
        self.pp_peers = [topology.rank(q, replica) for q in range(topology.pp) if q != position]
        self.dp_peers = [topology.rank(position, r) for r in range(topology.dp) if r != replica]
        # parameters -> their squared gradient norms (ZeRO-1 sums them over the replicas' shards: zero.py)
        self.squares: Callable[[Sequence[torch.Tensor | None]], torch.Tensor] = lambda ps: _squares(ps, device)

    def signals(self, stages: Sequence[Stage], plan: Plan, norm_skip: set[int], stop: int | None,
                riders: torch.Tensor | None = None) -> Decision:
        """Gradient norm, loss, non-finite flags and stop requests of the whole pipeline (one all-reduce over it),
        the loss and stop requests summed over the replicas with every replica's origin (one all-reduce over
        them), read by the host once with ``riders`` (this rank's device values the host needs: which parameters
        got gradients) (``stop``: a signal this rank got)."""
        vec = SignalVector(self.num_stages, sum(plan.param_counts), self.device)
        if stop is not None:
            vec.request_stop(stop)
        for st in stages:
            stage_sq = torch.zeros((), dtype=torch.float64, device=self.device)
            for index, layer in zip(plan.layers_of(st.index), st.module.layers):
                params = list(layer.parameters())
                squares = self.squares(params)
                stage_sq += squares.sum()   # tied copies too: any non-finite gradient
                skipped = [i for i, p in enumerate(params) if id(p) in norm_skip]   # (a tie's copies count once)
                if skipped:
                    squares = squares.index_fill(0, constant(skipped, torch.long, self.device), 0.0)
                vec.set_grad_sq(plan.param_slot(index), squares)
            vec.add_stage(st.index, st.nonfinite(), (~torch.isfinite(stage_sq)).double())
        if stages[-1].is_last:
            vec.set_loss(torch.stack(stages[-1].losses).double().sum())
        if self.topology.pp > 1:
            self.wait(dist.all_reduce(vec.tensor, group=self.groups.pp_group, async_op=True),
                      "the end-of-step all-reduce", self.pp_peers)
        parts = [vec.tensor]
        if self.topology.dp > 1:
            parts.append(self._over_replicas(vec.replica_part(self.topology.dp, self.topology.replica_of(self.rank))))
        if riders is not None:
            parts.append(riders.double())
        values = self.watch.host_values(torch.cat(parts), "the end-of-step all-reduce", self.pp_peers + self.dp_peers)
        n = len(vec.tensor)
        signals, ride = vec.decode(values[:n]), values[len(values) - (0 if riders is None else len(riders)):]
        if self.topology.dp == 1:
            return Decision(signals, signals.loss, signals.stops, [signals.origin()], ride)
        stops = len(signals.stops)
        summed = values[n:n + 1 + stops + self.topology.dp]
        return Decision(signals, summed[0], summed[1:1 + stops], summed[1 + stops:], ride)

    def _over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the replicas, on the device (the host reads it with the rest)."""
        self.wait(dist.all_reduce(value, group=self.groups.dp_group, async_op=True), "the loss all-reduce",
                  self.dp_peers)
        return value

    def eval_loss(self, last: Stage) -> float:
        """Mean loss of an eval step on every rank: summed on the last stage, shared, summed over DP; one read."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if last.is_last:
            value += torch.stack(last.losses).double().sum()
        if self.topology.pp > 1:
            self.wait(dist.broadcast(value, src=self.last_rank, group=self.groups.pp_group, async_op=True),
                      "the loss broadcast", self.pp_peers)
        if self.topology.dp > 1:
            value = self._over_replicas(value)
        return float(self.watch.host_values(value, "the loss broadcast", self.pp_peers + self.dp_peers)[0])


@dataclass
class Decision:
    """What every rank reads at the end of a step: the pipeline's signals and, over the replicas, the step's loss,
    the stop requests and each replica's origin (numerics.StepSignals.origin)."""

    signals: StepSignals
    loss: float
    stops: list[float]
    origins: list[float]
    riders: list[float]   # the riders' values (Consensus.signals)


def _squares(params: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Each parameter's squared gradient norm (float64; 0 for None or no gradient): per-tensor norms in the
    gradients' own dtype (one fused kernel), squared in float64."""
    grads = [(i, p.grad.detach()) for i, p in enumerate(params) if p is not None and p.grad is not None]
    out = torch.zeros(len(params), dtype=torch.float64, device=device)
    if grads:
        norms = torch.stack([n.double() for n in torch._foreach_norm([g for _, g in grads])])
        out[constant([i for i, _ in grads], torch.long, device)] = norms.pow(2)
    return out
