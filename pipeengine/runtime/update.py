"""The end of a training step on one rank: gradients synced, tied, measured, then a step or a skip alike everywhere.

After its program (engine.py) a rank waits for its data-parallel gradient sync (grad_sync.py; ZeRO-1's
reduce-scatter, zero.py), sums tied copies (ties.py), unscales an fp16 loss scale, and joins the one
sum over the pipeline (consensus.py, [Note: the end of a step]); every rank then takes the same
decision: step (clipping to the global norm), skip (``on_nonfinite="skip"``: parameters, optimizer
state and buffers unchanged) or raise :class:`NonFiniteError` naming the first stage that went
non-finite. Replicas then take replica 0's buffers (BatchNorm statistics), as DDP does.

[Note: uneven replicas]
A step is a fixed set of examples, whatever dp. Replicas may take different numbers of equal-size
microbatches (a global batch of 16 microbatches over dp 3: 6, 5 and 5), each running the plan's
schedule for its own count (plan.py: the same kind, placement and split). Each microbatch's loss is
divided by the step's microbatches over every replica, and the gradients and losses are summed over
the replicas (never averaged): the step is the mean over the global batch, as one process computes it,
up to the order of the additions. At even dp this is the usual mean (dividing by dp x m, a power of
two dp giving the same bits as the mean of the replicas' means).

[Note: non-finite]
A step's decision needs only its loss and gradient norm: non-finite, the step is skipped or stopped. Naming where it
went non-finite (the first stage whose output, else the last whose input gradient, held a NaN or an inf) needs a
sum per tensor each F and B passes on: a kernel and its bookkeeping on every action's critical path, for a step that
comes once in a run if at all. So a step runs without them; one that stops (``on_nonfinite="stop"``) runs again
first, its program from its own data (kept until the decision) with the same dropout masks (rng.py), every stage
summing (stage.py) and no data-parallel sync (the origins come from each replica's own computation), and the
origins of that run name the place. The parameters are not stepped either way. The replay assumes the step is
reproducible: a first layer that changes its input in place, or non-deterministic kernels that make a NaN only now
and then, could make it name another place or none (the message then says the loss function returned it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .agree import on_every_rank
from .clock import Phase
from .consensus import Consensus
from .grad_sync import GradSync, broadcast_buffers, clip_grad_norm
from .numerics import LossScale, NonFiniteError, nonfinite_message, stop_signal
from .results import StepResult
from .zero import ShardedOptimizer

if TYPE_CHECKING:
    from .engine import PipelineEngine

__all__ = ["Update", "zero_grads"]


class Update:
    """One rank's end of a training step (see the module docstring): its gradient sync, optional ZeRO-1, the
    end-of-step collectives and the fp16 loss scale. Made once by the engine, after its stages and optimizer."""

    def __init__(self, engine: PipelineEngine, bucket_mb: float, overlap: bool | None, shard: bool) -> None:
        e = self.engine = engine
        self.consensus = Consensus(e.topology, e.rank, e.groups, e.plan.num_stages,
                                   e.schedule.placement(e.plan.num_stages - 1)[0], e.device, self._wait, e.watch)
        self.grad_sync = GradSync(
            e.parameters, e.groups.dp_group, e.topology.dp, e.watch, self.consensus.dp_peers, bucket_mb,
            e.device.type == "cuda" if overlap is None else overlap, shard=e.replica if shard else None,
            whole=frozenset(id(p) for mine, _, _ in e.ties.copies for p in mine))
        self.loss_scale = LossScale(e.precision == "fp16")
        self.skipped_steps = 0
        self.zero: ShardedOptimizer | None = None   # ZeRO-1 (zero.py)
        self.gather_in_background = e.device.type == "cuda"   # ZeRO-1: see [Note: sharded optimizer state]
        self.stepped: Sequence[torch.nn.Parameter] = e.parameters   # what clipping scales (shards under ZeRO-1)
        if shard:
            peers = self.consensus.dp_peers
            self.zero = on_every_rank(lambda: ShardedOptimizer(   # a refusal on one rank is every rank's
                self.grad_sync, e.optimizer, e.replica, lambda w, what: self._wait(w, what, peers)))
            self.stepped = self.zero.params
            self.consensus.squares = self.zero.squares

    def _wait(self, work: Any, what: str, peers: Sequence[int]) -> None:
        self.engine.watch.wait(work, what, peers, cuda=self.engine.device.type == "cuda")

    def begin(self) -> list[torch.Tensor]:
        """Before the program: gradients zeroed (in the buckets), the loss scale on every stage; the buffers to put
        back if the step is skipped."""
        e = self.engine
        for st in e.stages:
            st.loss_scale = self.loss_scale.value
        if not self.grad_sync.prepare():
            zero_grads(e.optimizer)
        return e.local.saved_buffers() if e.on_nonfinite == "skip" else []

    def finish(self, result: StepResult, buffers: list[torch.Tensor]) -> tuple[Any, Any]:
        """After the program: sync, decide, step or skip (``buffers``: what :meth:`begin` saved). Returns the clock's
        stamps around the wait for the gradient sync, to be read once the step's records are (clock.py)."""
        e = self.engine
        sync_start = e.clock.mark()
        e.watch.doing = "the end-of-step gradient sync"
        self.grad_sync.finish()
        synced = e.clock.mark()
        e.ties.sum_grads(lambda work, peers: self._wait(work, "the tied-gradient sum", peers))
        self.loss_scale.unscale(self.stepped)
        if self.zero is not None:
            self.zero.mark_stepped(p for mine, _, _ in e.ties.copies for p in mine)   # every copy has the tie's sum
            self.zero.reduce_squares()
        riders = self.zero.got() if self.zero is not None else self.grad_sync.untouched()
        try:
            got = self._decide(result, riders)
        finally:
            e.step_data = None   # (kept for a replay: [Note: non-finite])
        if result.skipped:
            self.skipped_steps += result.nonfinite
            e.local.restore_buffers(buffers)
        else:
            if self.zero is None:
                self.grad_sync.drop_untouched(got)
            clip_grad_norm(self.stepped, e.grad_clip, result.grad_norm or 0.0)
            if self.zero is not None:   # on CUDA the all-gather overlaps until a stage's next F needs it
                self.zero.step(defer=self.gather_in_background, got=got)
            else:
                e.optimizer.step()
        if e.topology.dp > 1 and e.local.buffers:
            broadcast_buffers(e.local.buffers, e.topology.rank(e.position, 0), e.groups.dp_group,
                              lambda w: self._wait(w, "the buffer broadcast", self.consensus.dp_peers))
        e.clock.add(e.stages[0].index, Phase.SYNC, -1, sync_start, e.clock.mark())
        return sync_start, synced

    def _decide(self, result: StepResult, riders: torch.Tensor | None) -> list[float]:
        """The decision every rank takes alike from the step's one sum over the pipeline ([Note: the end of a step]);
        the values of ``riders`` (device flags the host needs too), read with it."""
        e = self.engine
        decision = self.consensus.signals(e.stages, e.plan, e.ties.norm_skip, e.stop_request, riders)
        signals = decision.signals
        result.grad_norm = math.sqrt(signals.grad_sq)
        result.loss = decision.loss
        result.stop = stop_signal(decision.stops)
        overflow = self.loss_scale.overflow(result.grad_norm)   # fp16: expected now and then
        result.nonfinite = not (math.isfinite(result.loss) and (overflow or math.isfinite(result.grad_norm)))
        if result.nonfinite and e.on_nonfinite == "stop":
            raise NonFiniteError(nonfinite_message(
                e.step_count, signals, result.loss, result.grad_norm, self._origins(),
                lambda s, r: f"layers {e.plan.bounds[s]}..{e.plan.bounds[s + 1] - 1}, "
                             f"rank {e.topology.rank(e.schedule.placement(s)[0], r)}"))
        result.skipped = overflow or result.nonfinite
        self.loss_scale.update(overflow)
        return decision.riders

    def _origins(self) -> list[float]:
        """Each replica's origin of the step's non-finite values, from the step run again summing what every stage
        passes on ([Note: non-finite])."""
        e = self.engine
        for st in e.stages:
            st.checking = True
        try:
            e._run(e.program, None, train=True, keep_outputs=False, replay=True)
            return self.consensus.signals(e.stages, e.plan, e.ties.norm_skip, None).origins
        finally:
            for st in e.stages:
                st.checking = False


def zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``. torch's own is done as its loop alone: its call's profiler range
    and compiler guard cost about 0.1 ms on a core woken for the step, at the first position's start of every step
    (``benchmarks.efficiency --critical-path``); an optimizer's own ``zero_grad`` (a subclass's, or one set on the
    instance) is called as it is."""
    if getattr(optimizer.zero_grad, "__func__", None) is not torch.optim.Optimizer.zero_grad:   # its own, or set on it
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
