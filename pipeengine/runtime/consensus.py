"""The collectives that end a step: one sum over the pipeline, and the loss summed over replicas.

[Note: the end of a step]
The DP all-reduce of a rank's gradients is posted bucket by bucket, asynchronously: on CUDA from
inside the backward that finalises each bucket (grad_sync.py), elsewhere right after the last
backward (B or W) in the rank's program, so it overlaps the cooldown of the other positions; it is
awaited after the program ends. Tied copies are then summed over their tie group. One sum over the
pipeline ([Note: the pipeline's sum]) then carries the squared gradient norm (once per logical parameter), the loss
and, per stage, whether its outputs or gradients went non-finite (numerics.SignalVector); the loss
is summed over the replicas (each microbatch's loss was divided by the step's microbatches over every
replica: the sum is the global batch's mean) on the device, with each replica's origin (where it went
non-finite first), and the host reads the two results, with which parameters got gradients, in one
read through the watch ([Note: no hidden syncs] in device.py). Every rank thus takes the same decision: step, skip
(``on_nonfinite="skip"``: parameters, optimizer state and buffers unchanged) or raise
``NonFiniteError`` naming the first stage that went non-finite (``"stop"``). Every wait is timed
and watched (faults.py).

[Note: the pipeline's sum]
Each rank of a pipeline sends its signal vector to the pipeline's first position, which adds them and
sends the total back: one hop after the last rank is done when that is the first position (the last backward
of every schedule here is position 0's), two otherwise. Gloo's all-reduce of a small vector takes rounds of
messages after the last rank comes, each a waiting process to wake: on this 2-core machine, with the first of 4
ranks 5 ms late, it took 3.4-5.6 ms to reach every rank, this 0.6-0.7 ms (2 ranks: 0.45-0.5 ms both). The sum is
exact in any order (a slot holds one rank's value, or counts), so every rank gets the all-reduce's bits. The first
position posts its receives early, with its first gradient's receive (engine.py): Gloo moves a message only once
its receive is posted (wire.py's [Note: receives one step early]), and posted at the end they cost it a round trip
after its last backward (pp 2, sleep stages: its sum took 0.35 ms, now 0.16). On NCCL, where a small all-reduce is
one kernel, the pipeline keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .device import constant, hand_over, nccl
from .faults import Watch
from .numerics import SignalVector, StepSignals
from .plan import Plan
from .stage import Stage
from .topology import ProcessGroups, Topology

__all__ = ["Consensus", "Decision"]

SUM_TAG = 2**25   # the pipeline's sum on the pp group (the wire's tags are below 2**24, on the world group)

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
        self.root = topology.rank(0, replica)   # where the pipeline's sum is taken ([Note: the pipeline's sum])
        self._pp_nccl = nccl(groups.pp_group) if topology.pp > 1 else False   # (NCCL keeps its all-reduce there)
        self.pp_peers = [topology.rank(q, replica) for q in range(topology.pp) if q != position]
        self.dp_peers = [topology.rank(position, r) for r in range(topology.dp) if r != replica]
        # parameters -> their squared gradient norms (ZeRO-1 sums them over the replicas' shards: zero.py)
        self.squares: Callable[[Sequence[torch.Tensor | None]], torch.Tensor] = lambda ps: _squares(ps, device)
        self._params: dict[int, tuple[list[nn.Parameter], int, list[int]]] = {}   # stage -> _params_of
        self._early: list[tuple[Any, torch.Tensor]] = []   # the root's receives of the peers' vectors, posted ahead

    def expect(self, plan: Plan) -> None:
        """In a training step, before the rank first waits: the pipeline's first position posts its receives of the
        other positions' signal vectors, so each moves as soon as its rank is done ([Note: the pipeline's sum]); kept
        while unused (a step that raised before its end)."""
        if self.rank == self.root and self.topology.pp > 1 and not self._pp_nccl and not self._early:
            self._early = self._receives(SignalVector.length(self.num_stages, sum(plan.param_counts)))

    def _receives(self, size: int) -> list[tuple[Any, torch.Tensor]]:
        parts = [torch.empty(size, dtype=torch.float64, device=self.device) for _ in self.pp_peers]
        return [(self._p2p(self.groups.pp_group.recv, part, peer), part) for part, peer in zip(parts, self.pp_peers)]

    def signals(self, stages: Sequence[Stage], plan: Plan, norm_skip: set[int], stop: int | None,
                riders: torch.Tensor | None = None) -> Decision:
        """Gradient norm, loss, non-finite flags and stop requests of the whole pipeline (one sum over it),
        the loss and stop requests summed over the replicas with every replica's origin (one all-reduce over
        them), read by the host once with ``riders`` (this rank's device values the host needs: which parameters
        got gradients) (``stop``: a signal this rank got)."""
        vec = SignalVector(self.num_stages, sum(plan.param_counts), self.device)
        if stop is not None:
            vec.request_stop(stop)
        for st in stages:
            params, first, skipped = self._params_of(st, plan, norm_skip)
            squares = self.squares(params)
            sums = st.step_sums()
            vec.add_stage(st.index, torch.cat([sums, squares.sum(0, keepdim=True)]))   # tied copies too
            if skipped:
                squares = squares.index_fill(0, constant(skipped, torch.long, self.device), 0.0)
            vec.set_grad_sq(first, squares)
            if st.is_last:
                vec.set_loss(sums[0])   # the losses' sum
        if self.topology.pp > 1:
            vec.tensor = self._sum_over_pipeline(vec.tensor)
        parts = [vec.tensor]
        if self.topology.dp > 1:
            part = vec.replica_part(self.topology.dp, self.topology.replica_of(self.rank),
                                    origin=any(st.checking for st in stages))
            parts.append(self._over_replicas(part))
        if riders is not None:
            parts.append(riders.double())
        values = self.watch.host_values(torch.cat(parts), "the end-of-step sum", self.pp_peers + self.dp_peers)
        n = len(vec.tensor)
        signals, ride = vec.decode(values[:n]), values[len(values) - (0 if riders is None else len(riders)):]
        if self.topology.dp == 1:
            return Decision(signals, signals.loss, signals.stops, [signals.origin()], ride)
        stops = len(signals.stops)
        summed = values[n:n + 1 + stops + self.topology.dp]
        return Decision(signals, summed[0], summed[1:1 + stops], summed[1 + stops:], ride)

    def _params_of(self, stage: Stage, plan: Plan, norm_skip: set[int]) -> tuple[list[nn.Parameter], int, list[int]]:
        """A stage's parameters in the model's order, layer by layer, the first one's slot (numerics.py) and those
        ``norm_skip`` leaves out (a tie's copies count once), worked out on the first step."""
        got = self._params.get(stage.index)
        if got is None:
            params = [p for layer in stage.module.layers for p in layer.parameters()]
            got = self._params[stage.index] = (params, plan.param_slot(plan.bounds[stage.index]),
                                               [i for i, p in enumerate(params) if id(p) in norm_skip])
        return got

    def _sum_over_pipeline(self, mine: torch.Tensor) -> torch.Tensor:
        """The pipeline's sum of ``mine`` on every rank of it, through its first position ([Note: the pipeline's
        sum])."""
        what, group = "the end-of-step sum over the pipeline", self.groups.pp_group
        if self._pp_nccl:   # one kernel there, not the point-to-point sends this saves Gloo's rounds with
            self.wait(dist.all_reduce(mine, group=group, async_op=True), what, self.pp_peers)
            return mine
        if self.rank != self.root:
            total = torch.empty_like(mine)
            for work in (self._p2p(group.send, mine, self.root), self._p2p(group.recv, total, self.root)):
                self.wait(work, what, [self.root])
            return total
        early, self._early = self._early or self._receives(len(mine)), []
        for work, _ in early:
            self.wait(work, what, self.pp_peers)
        total = torch.stack([mine, *(part for _, part in early)]).sum(0)
        for work in [self._p2p(group.send, total, peer) for peer in self.pp_peers]:
            self.wait(work, what, self.pp_peers)
        hand_over()   # to the peers, woken on this core ([Note: a send hands its core over] in device.py)
        return total

    def _p2p(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int) -> Any:
        """``op`` (the pp group's send or recv, started directly, as the wire does) of ``tensor`` with ``peer``."""
        return op([tensor], dist.get_group_rank(self.groups.pp_group, peer), SUM_TAG)

    def _over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the replicas, on the device (the host reads it with the rest)."""
        self.wait(dist.all_reduce(value, group=self.groups.dp_group, async_op=True), "the loss all-reduce",
                  self.dp_peers)
        return value

    def eval_loss(self, last: Stage) -> float:
        """Mean loss of an eval step on every rank: summed on the last stage, shared, summed over DP; one read."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if last.is_last:
            value += last.loss_terms().double().sum()
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
    if not grads:
        return torch.zeros(len(params), dtype=torch.float64, device=device)
    squares = torch.stack(torch._foreach_norm([g for _, g in grads])).double().pow(2)   # (a wider dtype: exact)
    if len(grads) == len(params):
        return squares
    out = torch.zeros(len(params), dtype=torch.float64, device=device)
    out[constant([i for i, _ in grads], torch.long, device)] = squares
    return out
