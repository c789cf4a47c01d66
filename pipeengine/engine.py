"""PipelineEngine: train and evaluate a layer list over PP x DP ranks by interpreting a proven schedule.

The engine knows no schedule. It compiles one by name (or takes a :class:`Schedule`), proves it
with the validator, and interprets its own rank's list step by step: a compute step runs F, B or
W on a local chunk (stage.py), a comm step goes to the wire as it is (p2p.py). 1F1B, GPipe,
interleaved and zero-bubble differ only in data.

Words: a *position* is a rank's index in its pipeline (0..pp-1); a *stage* is a virtual stage
``chunk * pp + position``; a *replica* is a rank's index among the DP copies of its position.

[Note: the end of a step]
The DP all-reduce of a rank's gradients is posted bucket by bucket, asynchronously: on CUDA from
inside the backward that finalises each bucket (grad_sync.py), elsewhere right after the last
backward (B or W) in the rank's program, so it overlaps the cooldown of the other stages; it is
awaited after the program ends. Tied copies are then summed over their tie group. One all-reduce over the
pipeline then carries the squared gradient norm (once per logical parameter), the loss and, per
stage, whether its outputs or gradients went non-finite; the loss is averaged over the replicas.
Every rank thus takes the same decision: step, skip (``on_nonfinite="skip"``: parameters,
optimizer state and buffers unchanged) or raise :class:`NonFiniteError` naming the first stage
that went non-finite (``"stop"``). Every wait is timed and watched (faults.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .actions import Action, Kind, Schedule, Step
from .faults import STARTUP_TIMEOUT, NonFiniteError, adaptive_timeout, nonfinite_message, watch
from .grad_sync import GradSync, LossScale, Ties, broadcast_buffers, clip_grad_norm, final_gradients, grad_sq_norm
from .layers import LayerSpec, build_layer
from .metrics import ActionClock, ActionRecord, Phase
from .p2p import Wire
from .partition import agree_bounds
from .schedule import compile_schedule
from .simulate import Costs, validate
from .stage import LayerChain, StageChunk, to_device
from .topology import ProcessGroups, Topology, build_groups

__all__ = ["PipelineEngine", "StepResult", "NonFiniteError"]


@dataclass
class StepResult:
    """What one train/eval step produced on this rank (loss and grad norm are global)."""

    loss: float
    grad_norm: float | None = None
    step_time: float = 0.0
    records: list[ActionRecord] = field(default_factory=list)
    peak_stored: dict[int, int] = field(default_factory=dict)   # stage -> peak microbatches held
    outputs: list[Any] | None = None                            # eval on the last stage, if asked
    skipped: bool = False                                       # no optimizer step (non-finite, see below)
    nonfinite: bool = False                                     # the loss or gradients were non-finite
    grad_sync_wait: float = 0.0                                 # seconds waiting for the DP all-reduce


@dataclass
class _StepState:
    """One train or eval step in progress on this rank."""

    train: bool
    keep_outputs: bool
    inputs: list[Any]
    targets: list[Any]
    local: dict[tuple[Kind, int, int], Any] = field(default_factory=dict)  # pp = 1: chunk -> next chunk


def default_device() -> torch.device:
    """cuda:<current device> when the process group runs NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PipelineEngine:
    """Pipeline-parallel x data-parallel training of an ordered list of layers.

    Args:
        layers: the whole model as an ordered list, run as ``nn.Sequential(*layers)`` runs it (one
            argument per layer; a tuple stays a tuple). Either built modules (every rank builds the
            same list; each keeps only its stages) or zero-argument factories, of which each rank
            calls only its own stages' (see layers.py: a model too big for one device).
        loss_fn: ``loss_fn(output, target) -> scalar`` with mean reduction over the microbatch.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` for this rank's parameters.
        topology: the PP x DP grid (default: all ranks in one pipeline).
        schedule: a name (gpipe, 1f1b, interleaved-1f1b, zb-h1) or a compiled :class:`Schedule`.
        microbatches: microbatches per step and replica (the data iterator yields them one by one).
        chunks: model chunks per rank (interleaved schedules).
        partition: "profile" (measure every layer's F, B and W on ``sample``, in parallel over the ranks,
            and take the bounds whose simulated step with this schedule is shortest, see
            partition.py), "parameters", "uniform", or explicit bounds ``[0, b1, ..., len(layers)]``.
        sample: one microbatch ``(inputs, target)`` for ``partition="profile"`` (every rank passes it).
        memory_cap: bytes per rank the profile partition may plan for (None: no limit).
        tied: groups of ``(layer index, parameter name)`` that are one logical parameter; the first
            entry's value wins at the start.
        grad_clip: clip the global gradient norm to this value (None: only measure it).
        seed: factories build layer i under ``layer_seed(seed, i)``.
        checkpoint: activation checkpointing per chunk: "none", "full" or "every:K".
        precision: "fp32", "bf16" (autocast, bf16 activations between stages, fp32 parameters,
            gradients and optimizer state) or "fp16" (the same with a dynamic loss scale).
        wire: "tags" (Gloo default) or "strict" (NCCL's per-peer order emulated on Gloo), see p2p.py.
        timeout: seconds any wait may take (default None: 600 s until the first step was timed,
            then max(60 s, 20 x the median step)); see faults.py for what happens then.
        on_nonfinite: "stop" (raise :class:`NonFiniteError` naming the first non-finite stage) or
            "skip" (no update for that step; counted in ``skipped_steps``).
        validate_schedule: prove a given Schedule before running it (turn off only to test faults).
        overlap_grad_sync: start each DP all-reduce bucket inside the backward that finalises its
            gradients (grad_sync.py); False posts them all after the rank's last backward. Default
            None: on CUDA only (see [Note: gradient all-reduce inside backward] for why not on CPU).
    """

    def __init__(self, layers: Sequence[LayerSpec], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 topology: Topology | None = None, schedule: str | Schedule = "1f1b", microbatches: int = 4,
                 chunks: int = 1, partition: str | Sequence[int] = "parameters",
                 tied: Sequence[Sequence[tuple[int, str]]] = (), grad_clip: float | None = None,
                 device: torch.device | None = None, timeout: float | None = None, validate_schedule: bool = True,
                 bucket_mb: float = 25.0, costs: Costs | None = None, seed: int = 0, checkpoint: str = "none",
                 precision: str = "fp32", wire: str = "tags", on_nonfinite: str = "stop",
                 overlap_grad_sync: bool | None = None, sample: tuple[Any, Any] | None = None,
                 memory_cap: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineEngine needs torch.distributed initialised first "
                               "(dist.init_process_group, or launch with torchrun / launch/pipe.sh)")
        world = dist.get_world_size()
        self.topology = topology or Topology.from_world(world)
        if self.topology.world_size != world:
            raise ValueError(f"topology pp={self.topology.pp} x dp={self.topology.dp} = "
                             f"{self.topology.world_size} ranks, but the world has {world}")
        self.rank = dist.get_rank()
        self.position = self.topology.position_of(self.rank)
        self.replica = self.topology.replica_of(self.rank)
        self.device = device or default_device()
        pp = self.topology.pp
        self.precision = precision
        if precision == "fp16" and self.device.type != "cuda":
            raise ValueError("precision fp16 (with a loss scale) needs CUDA; use bf16 on CPU")
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip' (got {on_nonfinite!r})")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds (got {timeout})")
        self.on_nonfinite = on_nonfinite
        self.watch = watch()
        self._fixed_timeout = timeout
        self.watch.timeout = timeout or STARTUP_TIMEOUT
        self._step_times: list[float] = []
        self.skipped_steps = 0

        if isinstance(schedule, Schedule):
            if schedule.pp != pp:
                raise ValueError(f"schedule is for pp={schedule.pp} but the topology has pp={pp}")
            if validate_schedule:
                validate(schedule)
            self.schedule = schedule
        else:
            self.schedule = compile_schedule(schedule, pp, microbatches, chunks, costs)
        self.eval_schedule = compile_schedule("forward", pp, self.schedule.microbatches, self.schedule.chunks)
        self.microbatches = self.schedule.microbatches
        num_stages = self.schedule.num_stages

        specs = list(layers)
        self.loss_fn = loss_fn
        self.bounds, self.partition_choice = agree_bounds(
            specs, self.schedule, partition, seed=seed, sample=sample, memory_cap=memory_cap, precision=precision,
            loss_fn=loss_fn, device=self.device)
        if self.partition_choice is not None and isinstance(schedule, str) and costs is None:
            # the schedule's communication order (and zb-h1's variant) from the measured costs
            costs = self.partition_choice.mean_costs()
            self.schedule = compile_schedule(schedule, pp, microbatches, chunks, costs)
        self.schedule_costs = costs   # what the schedule was lowered with (None: unit costs), kept in checkpoints
        self.num_layers = len(specs)
        stage_of_layer = {i: s for s in range(num_stages) for i in range(self.bounds[s], self.bounds[s + 1])}
        my_stages = [self.schedule.stage(self.position, c) for c in range(self.schedule.chunks)]
        mine = {i: build_layer(specs[i], i, seed) for s in my_stages for i in range(self.bounds[s], self.bounds[s + 1])}
        del specs   # see [Note: per-stage construction] in layers.py

        self.ties = Ties(tied, self.num_layers, lambda i: self.schedule.placement(stage_of_layer[i])[0])
        self.groups: ProcessGroups = build_groups(self.topology, self.rank, ties=self.ties.positions)
        self.ties.share(mine, self.groups.tie_groups, self.position, self._global)

        self.chunks: list[StageChunk] = []
        for s in my_stages:
            module = LayerChain([mine[i] for i in range(self.bounds[s], self.bounds[s + 1])], self.bounds[s])
            module = module.to(self.device)
            self.chunks.append(StageChunk(module, s, num_stages, loss_fn, self.microbatches, checkpoint, precision))
        del mine
        self.parameters: list[nn.Parameter] = list({id(p): p for ch in self.chunks
                                                   for p in ch.module.parameters()}.values())
        owner = {id(p): c for c in reversed(range(len(self.chunks))) for p in self.chunks[c].module.parameters()}
        self._chunk_params = [[p for p in self.parameters if owner[id(p)] == c] for c in range(len(self.chunks))]
        self._chunk_skips = [any(id(p) in self.ties.norm_skip for p in ps) for ps in self._chunk_params]
        self._buffers = [b for ch in self.chunks for b in ch.module.buffers()]
        self._broadcast_initial_state()
        self.optimizer = optimizer(self.parameters)
        self.grad_clip = grad_clip
        self._dp_peers = [self.topology.rank(self.position, r) for r in range(self.topology.dp) if r != self.replica]
        self._pp_peers = [self._global(q) for q in range(pp) if q != self.position]
        self.grad_sync = GradSync(self.parameters, self.groups.dp_group, self.topology.dp, self.watch,
                                  self._dp_peers, bucket_mb,
                                  self.device.type == "cuda" if overlap_grad_sync is None else overlap_grad_sync)
        self.wire = Wire(self.device, self._global, lambda c: self.schedule.stage(self.position, c), num_stages,
                         self.microbatches, mode=wire, watcher=self.watch)
        self.clock = ActionClock(self.rank, self.device)
        self.program: list[Step] = self.schedule.programs[self.position]
        self.eval_program: list[Step] = self.eval_schedule.programs[self.position]
        backward = [i for i, st in enumerate(self.program) if st[0].kind in (Kind.B, Kind.W)]
        self._last_backward = backward[-1] if backward else -1
        # armed for the in-backward all-reduce only when it overlaps (grad_sync.py)
        self._arm_at = (final_gradients(self.program, [list(ch.module.parameters()) for ch in self.chunks],
                                        self.schedule.split_backward)
                        if self.grad_sync.overlap and self.topology.dp > 1 else {})
        self.needs_data = any(ch.is_first or ch.is_last for ch in self.chunks)
        self.loss_scale = LossScale(precision == "fp16")
        self.step_count = 0

    # ------------------------------------------------------------------ setup helpers

    def _broadcast_initial_state(self) -> None:
        """Make DP replicas and tied copies start bit-identical (replica 0 / the tie's first entry wins)."""
        with torch.no_grad():
            if self.topology.dp > 1:
                src = self.topology.rank(self.position, 0)
                for p in self.parameters:
                    dist.broadcast(p.data, src=src, group=self.groups.dp_group)
                broadcast_buffers(self._buffers, src, self.groups.dp_group)
        self.ties.broadcast()
        # every rank joins one world collective first (NCCL wants that before subset p2p batches)
        dist.barrier()

    def _global(self, position: int) -> int:
        return self.topology.rank(position, self.replica)

    # ------------------------------------------------------------------ public API

    @property
    def peak_stored(self) -> dict[int, int]:
        """Stage -> most microbatches whose activations were held at once in the last step."""
        return {ch.stage: ch.peak_stored for ch in self.chunks}

    def train_batch(self, data_iter: Iterator[Any] | None) -> StepResult:
        """One optimizer step over ``microbatches`` microbatches per replica; returns the global mean loss.

        ``data_iter`` yields ``(inputs, target)`` microbatches; only ranks holding the first or last
        stage read it (inputs on the first, targets on the last), others may pass None. An exception
        on any rank ends the step on every rank (faults.py); see [Note: the end of a step].
        """
        try:
            result = self._train_batch(data_iter)
        except BaseException as exc:
            self.watch.report(exc)
            raise
        if self._fixed_timeout is None and self.step_count > 1:   # the first step (start-up) does not count
            self._step_times = (self._step_times + [result.step_time])[-50:]
            self.watch.timeout = adaptive_timeout(self._step_times)
        return result

    def _train_batch(self, data_iter: Iterator[Any] | None) -> StepResult:
        for ch in self.chunks:
            ch.module.train()
            ch.loss_scale = self.loss_scale.value
        if not self.grad_sync.prepare():
            self.optimizer.zero_grad(set_to_none=True)
        buffers = [b.clone() for b in self._buffers] if self.on_nonfinite == "skip" else []
        result = self._run(self.program, data_iter, train=True, keep_outputs=False)
        sync_start = self.clock.mark()
        self.watch.doing = "the end-of-step gradient sync"
        self.grad_sync.finish()
        synced = self.clock.mark()
        self.ties.sum_grads(lambda work, peers: self._wait(work, "the tied-gradient sum", peers))
        if self.loss_scale.enabled:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.div_(self.loss_scale.value)
        # one all-reduce over the pipeline: squared norm, loss, per stage (non-finite outputs, gradients)
        last = self.chunks[-1]
        stages = self.schedule.num_stages
        vec = torch.zeros(2 + 2 * stages, dtype=torch.float64, device=self.device)
        for ch, params, skips in zip(self.chunks, self._chunk_params, self._chunk_skips):
            sq = grad_sq_norm(params)
            vec[0] += grad_sq_norm(params, self.ties.norm_skip) if skips else sq
            vec[2 + 2 * ch.stage:4 + 2 * ch.stage] += ch.nonfinite
            vec[3 + 2 * ch.stage] += (~torch.isfinite(sq)).double()
        if last.is_last:
            vec[1] = torch.stack(last.losses).double().sum()
        if self.topology.pp > 1:
            self._wait(dist.all_reduce(vec, group=self.groups.pp_group, async_op=True),
                       "the end-of-step all-reduce", self._pp_peers)
        values = vec.tolist()
        result.grad_norm = math.sqrt(values[0])
        result.loss = self._mean_over_replicas(values[1])
        overflow = self.loss_scale.overflow(result.grad_norm)   # fp16: expected now and then
        result.nonfinite = not (math.isfinite(result.loss) and (overflow or math.isfinite(result.grad_norm)))
        if result.nonfinite and self.on_nonfinite == "stop":
            raise NonFiniteError(nonfinite_message(
                self.step_count, result.loss, result.grad_norm, values[2:], self.replica,
                lambda s: f"layers {self.bounds[s]}..{self.bounds[s + 1] - 1}, "
                          f"rank {self._global(self.schedule.placement(s)[0])}"))
        result.skipped = overflow or result.nonfinite
        if result.skipped:
            self.skipped_steps += result.nonfinite
            with torch.no_grad():
                for b, saved in zip(self._buffers, buffers):
                    b.copy_(saved)
        else:
            clip_grad_norm(self.parameters, self.grad_clip, result.grad_norm)
            self.optimizer.step()
        self.loss_scale.update(overflow)
        if self.topology.dp > 1 and self._buffers:
            broadcast_buffers(self._buffers, self.topology.rank(self.position, 0), self.groups.dp_group,
                              lambda w: self._wait(w, "the buffer broadcast", self._dp_peers))
        self.clock.add(self.chunks[0].stage, Phase.SYNC, -1, sync_start, self.clock.mark())
        result.records = self.clock.records()
        result.step_time = max(r.end for r in result.records)
        result.grad_sync_wait = self.clock.elapsed(synced) - self.clock.elapsed(sync_start)
        self.step_count += 1
        return result

    def _wait(self, work: Any, what: str, peers: Sequence[int]) -> None:
        self.watch.wait(work, what, peers, cuda=self.device.type == "cuda")

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any] | None, return_outputs: bool = False) -> StepResult:
        """Forward only over ``microbatches`` microbatches; global mean loss on every rank.

        With ``return_outputs`` the last stage's rank gets the model outputs per microbatch.
        """
        for ch in self.chunks:
            ch.module.eval()
        try:
            result = self._run(self.eval_program, data_iter, train=False, keep_outputs=return_outputs)
            result.loss = self._global_loss()
        except BaseException as exc:
            self.watch.report(exc)
            raise
        if return_outputs and self.chunks[-1].is_last:
            result.outputs = [self.chunks[-1].outputs[k] for k in sorted(self.chunks[-1].outputs)]
        result.records = self.clock.records()
        result.step_time = self.clock.elapsed(self.clock.mark())
        return result

    # ------------------------------------------------------------------ execution

    def _read_data(self, data_iter: Iterator[Any] | None) -> tuple[list[Any], list[Any]]:
        if not self.needs_data:
            return [], []
        if data_iter is None:
            raise ValueError(f"rank {self.rank} holds the first or last stage and needs a data iterator")
        inputs, targets = [], []
        for k in range(self.microbatches):
            try:
                item = next(data_iter)
            except StopIteration:
                raise ValueError(f"the data iterator ran out after {k} of {self.microbatches} microbatches "
                                 f"of step {self.step_count}") from None
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"the data iterator must yield (inputs, target) pairs, got {type(item).__name__}")
            inputs.append(to_device(item[0], self.device))
            targets.append(to_device(item[1], self.device))
        return inputs, targets

    def _run(self, program: list[Step], data_iter: Iterator[Any] | None, train: bool,
             keep_outputs: bool) -> StepResult:
        self.watch.context = f"position {self.position}, replica {self.replica}, step {self.step_count}"
        self.watch.doing = "reading the data"
        self.clock.start()
        for ch in self.chunks:
            ch.reset()
        st = _StepState(train, keep_outputs, *self._read_data(data_iter))
        self.wire.begin_step()
        for idx, step in enumerate(program):
            if train and idx in self._arm_at:
                self.grad_sync.arm(self._arm_at[idx])
            self._execute(step, st)
            if train and idx == self._last_backward:
                self.grad_sync.start()
        self.watch.doing = "waiting for the step's sends"
        if self.topology.pp > 1:
            start = self.clock.mark()
            self.wire.finish()
            self.clock.add(self.chunks[0].stage, Phase.WAIT, -1, start, self.clock.mark())
        return StepResult(loss=0.0, peak_stored=self.peak_stored)

    def _receive(self, st: _StepState, kind: Kind, a: Action, stage: int, local_key: tuple[Kind, int, int]) -> Any:
        """An input of ``a``: from the previous chunk on this rank (pp = 1), or taken from the wire (timed)."""
        if self.topology.pp == 1:
            return st.local.pop(local_key)
        start = self.clock.mark()
        value = self.wire.take(kind, a.microbatch, a.chunk)
        self.clock.add(stage, Phase.WAIT, a.microbatch, start, self.clock.mark())
        return value

    def _pass_on(self, st: _StepState, kind: Kind, a: Action, value: Any) -> None:
        if self.topology.pp == 1:
            st.local[(kind, a.microbatch, a.chunk)] = value
        else:
            self.wire.put(kind, a.microbatch, a.chunk, value)

    def _execute(self, step: Step, st: _StepState) -> None:
        """Interpret one step of the program (a compute action, or a comm step for the wire)."""
        a = step[0]
        chunk = self.chunks[a.chunk]
        mb = a.microbatch
        self.watch.doing = step   # formatted only if reported (faults.doing_text)
        if a.kind is Kind.F:
            if chunk.is_first:
                x = st.inputs[mb]
            else:
                x = self._receive(st, Kind.RECV_F, a, chunk.stage, (Kind.F, mb, a.chunk - 1))
            start = self.clock.mark()
            out = chunk.forward(mb, x, st.targets[mb] if chunk.is_last else None, st.train, st.keep_outputs)
            if not chunk.is_last:
                self._pass_on(st, Kind.F, a, out)
        elif a.kind is Kind.B:
            grads = None if chunk.is_last else self._receive(st, Kind.RECV_B, a, chunk.stage, (Kind.B, mb, a.chunk + 1))
            start = self.clock.mark()
            input_grads = chunk.backward(mb, grads, self.schedule.split_backward)
            if not chunk.is_first:
                self._pass_on(st, Kind.B, a, input_grads)
        elif a.kind is Kind.W:
            start = self.clock.mark()
            chunk.backward_weight(mb)
        else:
            start = self.clock.mark()
            if self.wire.settle():   # the proof's completions before this step: timed as waiting
                self.clock.add(chunk.stage, Phase.WAIT, mb, start, self.clock.mark())
                start = self.clock.mark()
            self.wire.post(step)
        phase = Phase(a.kind.value) if a.kind.is_compute else Phase.COMM
        self.clock.add(chunk.stage, phase, mb, start, self.clock.mark())
        self.wire.poll()

    def _mean_over_replicas(self, replica_loss: float) -> float:
        if self.topology.dp == 1:
            return replica_loss
        value = torch.tensor(replica_loss, dtype=torch.float64, device=self.device)
        self._wait(dist.all_reduce(value, group=self.groups.dp_group, async_op=True), "the loss all-reduce",
                   self._dp_peers)
        return float(value) / self.topology.dp

    def _global_loss(self) -> float:
        """Mean loss of the step on every rank: summed on the last stage, shared, averaged over DP."""
        last = self.chunks[-1]
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if last.is_last:
            value += sum(float(x) for x in last.losses)
        if self.topology.pp > 1:
            self._wait(dist.broadcast(value, src=self._global(self.topology.pp - 1), group=self.groups.pp_group,
                                      async_op=True), "the loss broadcast", self._pp_peers)
        return self._mean_over_replicas(float(value))
