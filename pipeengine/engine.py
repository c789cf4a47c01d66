"""PipelineEngine: train and evaluate a layer list over PP x DP ranks by executing a lowered schedule.

The engine knows no schedule. It compiles one by name (or takes a :class:`Schedule`), proves it
with the validator, and then interprets its own rank's list step by step: a compute step runs
F, B or W on a local chunk, a comm step posts one batch of paired sends/receives. Whatever order
the list has is the order that runs; 1F1B, GPipe, interleaved and zero-bubble differ only in data.

[Note: when gradients are synced]
The DP all-reduce of a rank's gradients starts right after the last backward (B or W) in its
program, asynchronously, so it overlaps the cooldown of the other stages; it is awaited after
the program ends. Tied copies are then summed over their tie group, the global norm is taken
once per logical parameter, and the optimizer steps on every rank with identical inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .actions import Action, Kind, Schedule, Step
from .grad_sync import GradSync, clip_grad_norm, sync_tied
from .metrics import ActionRecord
from .p2p import P2P, PendingBatch, PendingRecv, RecvOp, SendOp, TensorMeta
from .partition import partition as partition_layers
from .schedule import compile_schedule
from .simulate import Costs, validate
from .stage import LayerChain, StageChunk
from .topology import ProcessGroups, Topology, build_groups

__all__ = ["PipelineEngine", "StepResult"]

Tensors = tuple[torch.Tensor, ...]
_TAG_SPACE = 2**24


@dataclass
class StepResult:
    """What one train/eval step produced on this rank (loss and grad norm are global)."""

    loss: float
    grad_norm: float | None = None
    step_time: float = 0.0
    records: list[ActionRecord] = field(default_factory=list)
    peak_stored: dict[int, int] = field(default_factory=dict)   # stage -> peak microbatches held
    outputs: list[Any] | None = None                            # eval on the last stage, if asked


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(t, device) for t in x)
    return x


def default_device() -> torch.device:
    """cuda:<local rank> when the process group runs NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PipelineEngine:
    """Pipeline-parallel x data-parallel training of an ordered list of layers.

    Args:
        layers: the whole model as an ordered list (every rank builds the same list with the same
            seed; each keeps only its stages). Layer outputs feed the next layer; tuples are unpacked.
        loss_fn: ``loss_fn(output, target) -> scalar`` with mean reduction over the microbatch.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` for this rank's parameters.
        topology: the PP x DP grid (default: all ranks in one pipeline).
        schedule: a name (gpipe, 1f1b, interleaved-1f1b, zb-h1) or a compiled :class:`Schedule`.
        microbatches: microbatches per step and replica (the data iterator yields them one by one).
        chunks: model chunks per rank (interleaved schedules).
        partition: "parameters", "uniform", or explicit stage boundaries ``[0, b1, ..., len(layers)]``.
        tied: groups of ``(layer index, parameter name)`` that are one logical parameter.
        grad_clip: clip the global gradient norm to this value (None: only measure it).
        validate_schedule: prove a given Schedule before running it (turn off only to test faults).
    """

    def __init__(self, layers: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 topology: Topology | None = None, schedule: str | Schedule = "1f1b", microbatches: int = 4,
                 chunks: int = 1, partition: str | Sequence[int] = "parameters",
                 tied: Sequence[Sequence[tuple[int, str]]] = (), grad_clip: float | None = None,
                 device: torch.device | None = None, timeout: float = 300.0, validate_schedule: bool = True,
                 bucket_mb: float = 25.0, costs: Costs | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineEngine needs torch.distributed initialised first "
                               "(dist.init_process_group, or launch with torchrun / launch/pipe.sh)")
        world = dist.get_world_size()
        self.topology = topology or Topology.from_world(world)
        if self.topology.world_size != world:
            raise ValueError(f"topology pp={self.topology.pp} x dp={self.topology.dp} = "
                             f"{self.topology.world_size} ranks, but the world has {world}")
        self.rank = dist.get_rank()
        self.position = self.topology.stage_of(self.rank)      # index of this rank in its pipeline
        self.replica = self.topology.replica_of(self.rank)
        self.device = device or default_device()
        self.timeout = timeout
        pp, dp = self.topology.pp, self.topology.dp

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
        self.num_chunks = self.schedule.chunks
        num_stages = self.schedule.num_stages

        layers = list(layers)
        if isinstance(partition, str):
            self.bounds = partition_layers(layers, num_stages, partition)
        else:
            self.bounds = partition_layers(layers, num_stages, boundaries=list(partition))
        my_stages = [self.schedule.stage(self.position, c) for c in range(self.num_chunks)]
        stage_of_layer = {i: s for s in range(num_stages) for i in range(self.bounds[s], self.bounds[s + 1])}

        # ties: the positions (ranks of this replica) that hold each tied group
        tie_positions: list[tuple[int, ...]] = []
        for tie in tied:
            for i, _ in tie:
                if not 0 <= i < len(layers):
                    raise ValueError(f"tied parameter names layer {i}, but the model has {len(layers)} layers")
            tie_positions.append(tuple(sorted({self.schedule.placement(stage_of_layer[i])[0] for i, _ in tie})))
        self.groups: ProcessGroups = build_groups(self.topology, self.rank, ties=tie_positions)

        self.chunks: list[StageChunk] = []
        for s in my_stages:
            module = LayerChain(layers[self.bounds[s]:self.bounds[s + 1]]).to(self.device)
            self.chunks.append(StageChunk(module, s, num_stages, loss_fn, self.microbatches))
        self.parameters: list[nn.Parameter] = list({id(p): p for ch in self.chunks
                                                   for p in ch.module.parameters()}.values())

        # tied copies on this rank; the grad norm counts each tie on its lowest position only
        self._ties: list[tuple[list[nn.Parameter], Any, int]] = []   # (params, group, source rank)
        self._norm_skip: set[int] = set()
        for tie, positions in zip(tied, tie_positions):
            if len(positions) < 2 or self.position not in positions:
                continue
            local = [layers[i].get_parameter(name) for i, name in tie
                     if self.schedule.placement(stage_of_layer[i])[0] == self.position]
            unique = list({id(p): p for p in local}.values())
            self._ties.append((unique, self.groups.tie_groups[positions], self._global(positions[0])))
            if self.position != positions[0]:
                self._norm_skip.update(id(p) for p in unique)
        del layers

        self._broadcast_initial_parameters()
        self.optimizer = optimizer(self.parameters)
        self.grad_clip = grad_clip
        self.grad_sync = GradSync(self.parameters, self.groups.dp_group, dp, bucket_mb, timeout)
        self.p2p = P2P(self.device, timeout=timeout)
        self.program: list[Step] = self.schedule.programs[self.position]
        self.eval_program: list[Step] = self.eval_schedule.programs[self.position]
        backward = [i for i, st in enumerate(self.program) if st[0].kind in (Kind.B, Kind.W)]
        self._last_backward = backward[-1] if backward else -1
        self.needs_data = any(ch.is_first or ch.is_last for ch in self.chunks)
        self.step_count = 0

    # ------------------------------------------------------------------ setup helpers

    def _broadcast_initial_parameters(self) -> None:
        """Make DP replicas and tied copies start bit-identical (replica 0 / lowest position wins)."""
        with torch.no_grad():
            if self.topology.dp > 1:
                src = self.topology.rank(self.position, 0)
                for p in self.parameters:
                    dist.broadcast(p.data, src=src, group=self.groups.dp_group)
            for params, group, src in self._ties:
                for p in params:
                    dist.broadcast(p.data, src=src, group=group)
        # every rank joins one world collective first (NCCL wants that before subset p2p batches)
        dist.barrier()

    def _global(self, position: int) -> int:
        return self.topology.rank(position, self.replica)

    def _tag(self, direction: int, mb: int, producer_stage: int) -> int:
        return ((mb * self.schedule.num_stages + producer_stage) * 2 + direction) % _TAG_SPACE

    # ------------------------------------------------------------------ public API

    @property
    def peak_stored(self) -> dict[int, int]:
        """Stage -> most microbatches whose activations were held at once in the last step."""
        return {ch.stage: ch.peak_stored for ch in self.chunks}

    def train_batch(self, data_iter: Iterator[Any] | None) -> StepResult:
        """One optimizer step over ``microbatches`` microbatches per replica; returns the global mean loss.

        ``data_iter`` yields ``(inputs, target)`` microbatches; only ranks holding the first or last
        stage read it (inputs on the first, targets on the last), others may pass None.
        """
        for m in self.chunks:
            m.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        result = self._run(self.program, data_iter, train=True)
        t0 = time.perf_counter() - self._t0
        self.grad_sync.finish()
        for params, group, _ in self._ties:
            sync_tied(params, group)
        last = self.chunks[-1]
        replica_loss = sum(float(x) for x in last.losses) if last.is_last else 0.0
        result.grad_norm, replica_loss = clip_grad_norm(self.parameters, self.grad_clip, self.groups.pp_group,
                                                        self._norm_skip, carry=replica_loss)
        self.optimizer.step()
        result.loss = self._mean_over_replicas(replica_loss)
        result.records.append(ActionRecord(self.rank, self.chunks[0].stage, "SYNC", -1, t0,
                                           time.perf_counter() - self._t0))
        result.step_time = time.perf_counter() - self._t0
        self.step_count += 1
        return result

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any] | None, return_outputs: bool = False) -> StepResult:
        """Forward only over ``microbatches`` microbatches; global mean loss on every rank.

        With ``return_outputs`` the last stage's rank gets the model outputs per microbatch.
        """
        for m in self.chunks:
            m.module.eval()
        result = self._run(self.eval_program, data_iter, train=False, keep_outputs=return_outputs)
        result.loss = self._global_loss()
        if return_outputs and self.chunks[-1].is_last:
            result.outputs = [self.chunks[-1].outputs[k] for k in sorted(self.chunks[-1].outputs)]
        result.step_time = time.perf_counter() - self._t0
        return result

    # ------------------------------------------------------------------ execution

    def _run(self, program: list[Step], data_iter: Iterator[Any] | None, train: bool,
             keep_outputs: bool = False) -> StepResult:
        self._t0 = time.perf_counter()
        for ch in self.chunks:
            ch.reset()
        self._inputs: list[Any] = []
        self._targets: list[Any] = []
        if self.needs_data:
            if data_iter is None:
                raise ValueError(f"rank {self.rank} holds the first or last stage and needs a data iterator")
            for k in range(self.microbatches):
                try:
                    item = next(data_iter)
                except StopIteration:
                    raise ValueError(f"the data iterator ran out after {k} of {self.microbatches} microbatches "
                                     f"of step {self.step_count}") from None
                if not isinstance(item, (tuple, list)) or len(item) != 2:
                    raise TypeError(f"the data iterator must yield (inputs, target) pairs, got "
                                    f"{type(item).__name__}")
                self._inputs.append(_to(item[0], self.device))
                self._targets.append(_to(item[1], self.device))
        self._outbox: dict[tuple[Kind, int, int], Tensors] = {}    # (F|B, mb, chunk) -> tensors to pass on
        self._recvs: dict[tuple[Kind, int, int], PendingRecv] = {}
        self._w_grads: dict[tuple[int, int], Tensors | None] = {}
        self._send_batches: list[PendingBatch] = []
        # producer stage -> metas agreed this step (or the header receive that will tell them)
        self._agreed: dict[int, tuple[TensorMeta, ...] | PendingRecv] = {}
        self._out_metas: dict[int, tuple[TensorMeta, ...]] = {}   # my chunk -> float output metas
        records: list[ActionRecord] = []
        split = self.schedule.split_backward
        for idx, step in enumerate(program):
            start = time.perf_counter() - self._t0
            a = step[0]
            if a.kind is Kind.F:   # F and B return when their input arrived: waits are recorded apart
                start = self._forward(a, train, keep_outputs, records)
            elif a.kind is Kind.B:
                start = self._backward(a, split, records)
            elif a.kind is Kind.W:
                self.chunks[a.chunk].backward_weight(a.microbatch, self._w_grads.pop((a.microbatch, a.chunk)))
            else:
                self._post(step)
            kind = a.kind.value if a.kind.is_compute else "COMM"
            records.append(ActionRecord(self.rank, self.chunks[a.chunk].stage, kind, a.microbatch,
                                        start, time.perf_counter() - self._t0))
            if train and idx == self._last_backward:
                self.grad_sync.start()
        wait_start = time.perf_counter() - self._t0
        for batch in self._send_batches:
            batch.wait_sends()
        records.append(ActionRecord(self.rank, self.chunks[0].stage, "WAIT", -1, wait_start,
                                    time.perf_counter() - self._t0))
        return StepResult(loss=0.0, records=records, peak_stored=self.peak_stored)

    def _wait(self, key: tuple[Kind, int, int], records: list[ActionRecord], stage: int) -> Tensors:
        pending = self._recvs.pop(key)
        t = time.perf_counter() - self._t0
        tensors = pending.wait()
        records.append(ActionRecord(self.rank, stage, "WAIT", key[1], t, time.perf_counter() - self._t0))
        return tensors

    def _forward(self, a: Action, train: bool, keep_outputs: bool, records: list[ActionRecord]) -> float:
        chunk = self.chunks[a.chunk]
        if chunk.is_first:
            x = self._inputs[a.microbatch]
            inputs: Tensors = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        elif (Kind.F, a.microbatch, a.chunk - 1) in self._outbox and self.topology.pp == 1:
            inputs = self._outbox.pop((Kind.F, a.microbatch, a.chunk - 1))  # previous chunk, same rank
        else:
            inputs = self._wait((Kind.RECV_F, a.microbatch, a.chunk), records, chunk.stage)
        target = self._targets[a.microbatch] if chunk.is_last else None
        start = time.perf_counter() - self._t0
        out = chunk.forward(a.microbatch, inputs, target, train, keep_outputs)
        if not chunk.is_last:
            self._outbox[(Kind.F, a.microbatch, a.chunk)] = out
        return start

    def _backward(self, a: Action, split: bool, records: list[ActionRecord]) -> float:
        chunk = self.chunks[a.chunk]
        grads: Tensors | None = None
        if not chunk.is_last:
            if self.topology.pp == 1:
                grads = self._outbox.pop((Kind.B, a.microbatch, a.chunk + 1))
            else:
                grads = self._wait((Kind.RECV_B, a.microbatch, a.chunk), records, chunk.stage)
        start = time.perf_counter() - self._t0
        input_grads = chunk.backward(a.microbatch, grads, split)
        if split:
            self._w_grads[(a.microbatch, a.chunk)] = grads
        if not chunk.is_first:
            self._outbox[(Kind.B, a.microbatch, a.chunk)] = input_grads
        return start

    def _post(self, step: Step) -> None:
        """Post one comm batch (p2p.py does the header handshake; tags identify each transfer).

        [Note: first transfer of a stream carries the header]
        Forward activations from producer stage s form a stream; its first transfer of the step
        carries a header with shapes and dtypes, later ones reuse them (shapes may change between
        steps, not within one). Both ends see a stream's transfers in the same (paired) order, so
        both agree which one is first. A receiver idle while its producer runs F1 and F2 gets both
        receives in one batch; the batch is then posted in two parts, so the second receive knows
        the shapes the first one's header announced. Per-peer op order is unchanged by the split.
        """
        ops: list[SendOp | RecvOp] = []
        recv_keys: list[tuple[Kind, int, int]] = []
        header_streams: dict[int, int] = {}   # producer stage -> index in recv_keys of its header recv

        def flush() -> None:
            batch = self.p2p.post(ops)
            self._send_batches.append(batch)
            for key, pending in zip(recv_keys, batch.recvs):
                self._recvs[key] = pending
            for producer, i in header_streams.items():
                self._agreed[producer] = batch.recvs[i]   # shapes arrive with its header
            ops.clear()
            recv_keys.clear()
            header_streams.clear()

        for a in step:
            stage = self.schedule.stage(self.position, a.chunk)
            peer = self._global(a.peer)
            label = f"{a} on rank {self.rank} (pipeline position {self.position}, step {self.step_count})"
            if a.kind is Kind.SEND_F:
                tensors = self._outbox.pop((Kind.F, a.microbatch, a.chunk))
                metas = tuple(TensorMeta.of(t) for t in tensors)
                header = stage not in self._agreed
                if header:
                    self._agreed[stage] = metas
                    self._out_metas[a.chunk] = tuple(m for m in metas if m.dtype.is_floating_point)
                elif metas != self._agreed[stage]:
                    first = self._agreed[stage]
                    assert not isinstance(first, PendingRecv)
                    raise ValueError(
                        f"stage {stage} output for microbatch {a.microbatch} has shapes "
                        f"{[tuple(m.shape) for m in metas]} but this step's first microbatch had "
                        f"{[tuple(m.shape) for m in first]}: all microbatches of one step must "
                        f"share shapes (pad them); shapes may change from step to step")
                ops.append(SendOp(peer, self._tag(0, a.microbatch, stage), tensors, header, label))
            elif a.kind is Kind.RECV_F:
                producer = stage - 1
                if producer in header_streams:
                    flush()
                if producer not in self._agreed:
                    header_streams[producer] = len(recv_keys)
                    ops.append(RecvOp(peer, self._tag(0, a.microbatch, producer), None, True, label))
                else:
                    agreed = self._agreed[producer]
                    metas = agreed.metas if isinstance(agreed, PendingRecv) else agreed
                    self._agreed[producer] = metas
                    ops.append(RecvOp(peer, self._tag(0, a.microbatch, producer), metas, False, label))
                recv_keys.append((Kind.RECV_F, a.microbatch, a.chunk))
            elif a.kind is Kind.SEND_B:
                tensors = self._outbox.pop((Kind.B, a.microbatch, a.chunk))
                ops.append(SendOp(peer, self._tag(1, a.microbatch, stage), tensors, False, label))
            else:  # RECV_B: the gradients of what this chunk sent forward
                ops.append(RecvOp(peer, self._tag(1, a.microbatch, stage + 1), self._out_metas[a.chunk],
                                  False, label))
                recv_keys.append((Kind.RECV_B, a.microbatch, a.chunk))
        flush()

    def _mean_over_replicas(self, replica_loss: float) -> float:
        if self.topology.dp == 1:
            return replica_loss
        value = torch.tensor(replica_loss, dtype=torch.float64, device=self.device)
        dist.all_reduce(value, group=self.groups.dp_group)
        return float(value) / self.topology.dp

    def _global_loss(self) -> float:
        """Mean loss of the step on every rank: summed on the last stage, shared, averaged over DP."""
        last = self.chunks[-1]
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if last.is_last:
            value += sum(float(x) for x in last.losses)
        if self.topology.pp > 1:
            dist.broadcast(value, src=self._global(self.topology.pp - 1), group=self.groups.pp_group)
        return self._mean_over_replicas(float(value))
