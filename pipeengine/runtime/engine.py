"""PipelineEngine: train and evaluate a layer list over PP x DP ranks by interpreting a proven plan.

The engine knows no schedule. It takes a :class:`~pipeengine.runtime.plan.Plan` (or makes one:
plan.py) and interprets its own position's program step by step: a compute step runs F, B or W on
one of its stages (stage.py), a comm step goes to the wire as it is (wire.py). 1F1B, GPipe,
interleaved and zero-bubble differ only in data. The end of a training step (gradient sync, the decision to step
or skip) is update.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Action, Costs, Kind, Schedule, Step
from .clock import ActionClock, Phase
from .faults import adaptive_timeout, watch
from .device import default_device
from .grad_sync import final_gradients
from .header import shape_table
from .layers import LayerSpec
from .links import links_for
from .local import LocalModel
from .microbatches import merged, read_microbatches
from .numerics import NonFiniteError
from .options import STARTUP_TIMEOUT, check_engine_arguments, checked_optimizer
from .plan import Plan, make_plan, replica_counts
from .release import opened, release
from .results import StepResult, StepState
from .rng import generator_of, kept, microbatch_key, step_key
from .chain import LayerChain
from .stage import DTYPES, Stage, cast_cache_scope
from .state import EngineState, TensorInfo
from .topology import Topology
from .transfer import receives_ahead
from .wire import Wire
from .update import Update

__all__ = ["PipelineEngine", "StepResult", "NonFiniteError"]


class PipelineEngine:
    """Pipeline-parallel x data-parallel training of an ordered list of layers.

    Args:
        layers: the whole model as an ordered list, run as ``nn.Sequential(*layers)`` runs it (one
            argument per layer; a tuple stays a tuple). Either built modules (every rank builds the
            same list; each keeps only its stages) or zero-argument factories, of which each rank
            calls only its own stages' (see layers.py: a model too big for one device).
        loss_fn: ``loss_fn(output, target) -> scalar``, the microbatch's loss (the step's is their mean).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` for this rank's parameters.
        topology: the PP x DP grid (default: all ranks in one pipeline).
        plan: a :class:`Plan` made with :func:`make_plan`; without one, the engine makes it from the
            planning arguments ``schedule`` (a name from ``SCHEDULES``, "auto", or a compiled
            :class:`Schedule`), ``microbatches`` (per step and replica, or one count per replica: see
            [Note: uneven replicas] in update.py), ``chunks`` (stages per position; None: the schedule's own),
            ``partition`` ("profile", "parameters", "uniform" or explicit bounds), ``sample``, ``memory_cap``
            and ``costs``: plan.py's :func:`make_plan` documents each.
        tied: groups of ``(layer index, parameter name)`` that are one parameter; the first one's value wins at start.
        grad_clip: clip the global gradient norm to this value (None: only measure it).
        seed: factories build layer i under ``layer_seed(seed, i)``.
        recompute: per stage "none", "selective", "full" or "every:K" (layers per region): [Note: recompute].
        precision: "fp32", "bf16" (autocast, bf16 activations between stages, fp32 parameters,
            gradients and optimizer state) or "fp16" (the same with a dynamic loss scale, CUDA only).
        wire: "tags" (Gloo default) or "strict" (NCCL's per-peer order emulated on Gloo), see wire.py.
        static_shapes: training steps keep the first one's shapes, and no header goes between stages after it
            ([Note: static training shapes] in wire.py; a changed shape is refused).
        boundary_dtype: "fp32" or "bf16": fp32 activations and gradients cross between stages as bf16 (half the
            traffic; results then depend on the split), see [Note: boundary dtype] in wire.py.
        timeout: seconds any wait may take (None: 600 s until a step was timed, then max(60 s, 20 x the median
            step)); see faults.py for what happens then.
        on_nonfinite: "stop" (raise :class:`NonFiniteError` naming the first non-finite stage) or "skip" (no
            update for that step; counted in ``skipped_steps``).
        bucket_mb: MiB of gradients per data-parallel all-reduce bucket.
        overlap_grad_sync: start each DP all-reduce bucket inside the backward that finalises its gradients
            (grad_sync.py; False: all after the rank's last backward; None: on CUDA only, [Note: gradient all-reduce
            inside backward] says why).
        shard_optimizer: ZeRO-1, the optimizer state sharded over each stage's data-parallel group
            (zero.py; a no-op at dp 1); the optimizer must update elements on their own (SGD, Adam, AdamW...).
        link_gbps: with ``partition="profile"``, every pipeline link's bandwidth in Gbit/s instead of measuring
            each neighbour link at start ([Note: links in the plan] in links.py); ``microbatch_sizes``: each
            microbatch's size relative to ``sample`` (shapes of their own), for the split, auto and the predicted step.
        memory_budget: bytes per rank (twin.py's parts): schedule shape, recompute per stage, split and pieces
            per microbatch chosen to fit it ([Note: memory budget], budget.py; [Note: microbatch pieces],
            microbatches.py; ``cut_microbatches=False``: never as pieces); ``facts``: the run's facts (plan.py).
    """

    def __init__(self, layers: Sequence[LayerSpec], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *, topology: Topology | None = None,
                 plan: Plan | None = None, schedule: str | Schedule = "1f1b", microbatches: int | Sequence[int] = 4,
                 chunks: int | None = None, partition: str | Sequence[int] = "parameters",
                 sample: tuple[Any, Any] | None = None, memory_cap: float | None = None, costs: Costs | None = None,
                 tied: Sequence[Sequence[tuple[int, str]]] = (), grad_clip: float | None = None,
                 device: torch.device | None = None, timeout: float | None = None, validate_schedule: bool = True,
                 bucket_mb: float = 25.0, seed: int = 0, recompute: str = "none", precision: str = "fp32",
                 wire: str = "tags", on_nonfinite: str = "stop", overlap_grad_sync: bool | None = None,
                 shard_optimizer: bool = False, boundary_dtype: str = "fp32", link_gbps: float | None = None,
                 microbatch_sizes: Sequence[float] | None = None, memory_budget: float | None = None,
                 facts: Mapping[str, Any] | None = None, cut_microbatches: bool = True,
                 static_shapes: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineEngine needs torch.distributed initialised first "
                               "(dist.init_process_group, or launch with torchrun / launch/pipe.sh)")
        check_engine_arguments(layers, loss_fn, optimizer, precision, recompute, wire, on_nonfinite, timeout,
                               grad_clip, seed, boundary_dtype)
        self._place(topology, device, plan, len(layers), precision)
        self.precision, self.on_nonfinite, self.grad_clip, self.loss_fn = precision, on_nonfinite, grad_clip, loss_fn
        self.watch, self._fixed_timeout, self.seed = watch(), timeout, seed
        self.watch.timeout = timeout or STARTUP_TIMEOUT
        given = isinstance(schedule, Schedule) and isinstance(microbatches, int)   # a compiled schedule says its own
        counts = replica_counts(schedule.microbatches if given else microbatches, self.topology.dp)   # type: ignore
        self.plan = plan or make_plan(
            layers, self.topology.pp, schedule=schedule, microbatches=counts, chunks=chunks,
            partition=partition, costs=costs, sample=sample, memory_cap=memory_cap, seed=seed, precision=precision,
            loss_fn=loss_fn, device=self.device, validate_schedule=validate_schedule,
            agree={"pp x dp": (self.topology.pp, self.topology.dp), "schedule": getattr(schedule, "name", schedule),
                   "microbatches": counts, "chunks": chunks, "partition": partition, "precision": precision,
                   "recompute": recompute, "wire": wire, "static_shapes": static_shapes, "grad_clip": grad_clip,
                   "on_nonfinite": on_nonfinite, "bucket_mb": bucket_mb, "timeout": timeout,
                   "tied": [list(map(tuple, g)) for g in tied], "shard_optimizer": shard_optimizer,
                   "boundary_dtype": boundary_dtype, "link_gbps": link_gbps, "memory_budget": memory_budget,
                   "cut_microbatches": cut_microbatches},
            links=links_for(self.topology, self.device, link_gbps), sizes=microbatch_sizes,
            memory_budget=memory_budget, facts=facts, selective=recompute == "selective", cut=cut_microbatches)
        self.schedule, eval_schedule = self.plan.schedules_of(self.replica)
        self.pieces = self.plan.pieces   # each microbatch the data gives runs as pieces ([Note: microbatch pieces])
        self.microbatches = self.schedule.microbatches // self.pieces   # this replica's, as its data gives them
        counts = list(self.plan.counts or [self.schedule.microbatches] * self.topology.dp)
        self.total_microbatches = sum(counts)            # (pieces) over every replica: a mean loss divides by it
        self.first_microbatch = sum(counts[:self.replica])   # this replica's first, counted over the step
        self._build(layers, tied, seed, recompute)
        # no parameters here (ReLU, pooling): an optimizer still, on a placeholder never stepped (torch refuses [])
        placeholder = [nn.Parameter(torch.empty(0, device=self.device))]
        self.optimizer: torch.optim.Optimizer = checked_optimizer(optimizer(self.parameters or placeholder))
        self.step_count = 0       # optimizer steps taken (restored from a checkpoint)
        self.stop_request: int | None = None   # a signal this rank got, told to every rank with the next step
        u = self.update = Update(self, bucket_mb, overlap_grad_sync, shard_optimizer and self.topology.dp > 1)
        self.grad_sync, self.zero, self.consensus, self.loss_scale = u.grad_sync, u.zero, u.consensus, u.loss_scale
        self._buckets_of = [self.zero.buckets_of(s.module.parameters()) for s in self.stages] if self.zero else []
        self._take_program(eval_schedule, mode=wire, boundary=DTYPES[boundary_dtype], static=static_shapes)
        self.clock = ActionClock(self.rank, self.device, lambda event: self.watch.poll(event, "timing the step", []))
        self.needs_data = any(s.is_first or s.is_last for s in self.stages)
        self.step_data: tuple[list[Any], list[Any]] | None = None   # a training step's (inputs, targets) until its end
        self._step_times: list[float] = []
        self._steps_run, self.closed = 0, False   # steps run by this engine object (the first is start-up)
        self._state = EngineState(self)
        opened(self)

    # ------------------------------------------------------------------ setup

    def _place(self, topology: Topology | None, device: torch.device | None, plan: Plan | None, num_layers: int,
               precision: str) -> None:
        """This rank in the grid, and its device; a plan or precision that does not fit them is refused."""
        world = dist.get_world_size()
        self.topology = topology or Topology.from_world(world)
        if self.topology.world_size != world:
            raise ValueError(f"topology pp={self.topology.pp} x dp={self.topology.dp} = "
                             f"{self.topology.world_size} ranks, but the world has {world}")
        self.rank = dist.get_rank()
        self.position, self.replica = self.topology.position_of(self.rank), self.topology.replica_of(self.rank)
        self.device = device or default_device()
        if plan is not None and (plan.schedule.pp != self.topology.pp or plan.num_layers != num_layers):
            raise ValueError(f"the plan is for pp={plan.schedule.pp} and {plan.num_layers} layers, but the topology "
                             f"has pp={self.topology.pp} and the model {num_layers} layers")
        if precision == "fp16" and self.device.type != "cuda":
            raise ValueError("precision fp16 (with a loss scale) needs CUDA; use bf16 on CPU")

    def _build(self, specs: Sequence[LayerSpec], tied: Sequence[Sequence[tuple[int, str]]], seed: int,
               recompute: str) -> None:
        def make_stage(module: LayerChain, index: int) -> Stage:
            divisor = self.total_microbatches // (self.pieces if self.plan.piece_losses == "sum" else 1)
            return Stage(module, index, self.plan.num_stages, self.loss_fn, divisor,
                         self.plan.recompute[index] if self.plan.recompute else recompute,
                         self.precision, segmented=self.plan.schedule.split_backward)
        self.local = LocalModel(self.plan, specs, self.topology, self.rank, tied, seed, self.device, make_stage)
        self.stages, self.parameters, self.ties = self.local.stages, self.local.parameters, self.local.ties
        self.groups = self.local.groups

    def _take_program(self, eval_schedule: Schedule, **wire: Any) -> None:
        """This position's programs and what interpreting them needs: the wire (``wire``: its options), where the
        gradients become final."""
        self.wire = Wire(self.device, lambda q: self.topology.rank(q, self.replica),
                         lambda c: self.schedule.stage(self.position, c),
                         self.plan.num_stages, self.schedule.microbatches, watcher=self.watch, **wire)
        self._chunk_of = {st.index: c for c, st in enumerate(self.stages)}   # this rank's stages, by chunk
        # (position, microbatch, chunk) whose B is followed by a W (none on a stage that runs B whole: recompute.py)
        self._split = self.schedule.split_backwards(whole={st.index for st in self.stages if st.selective})
        self.program: list[Step] = self.schedule.programs[self.position]
        self.eval_program: list[Step] = eval_schedule.programs[self.position]
        self._ahead = {True: receives_ahead(self.program), False: receives_ahead(self.eval_program)}   # by train
        self._last_backward = max((i for i, s in enumerate(self.program) if s[0].kind in (Kind.B, Kind.W)), default=-1)
        # the first gradient's receive: the end-of-step sum's receives go with it ([Note: the pipeline's sum])
        self._expect_at = next((i for i, st in enumerate(self.program) if Kind.RECV_B in (a.kind for a in st)), -1)
        # armed for the in-backward all-reduce only when it overlaps (grad_sync.py)
        self._arm_at = (final_gradients(self.program, [list(s.module.parameters()) for s in self.stages],
                                        lambda a: self.schedule.releases(self.position, a, self._split))
                        if self.grad_sync.overlap and self.topology.dp > 1 else {})

    # ------------------------------------------------------------------ public API

    def close(self) -> None:
        """Let go of torch.distributed (release.py): the watcher stopped (unless an open engine shares it), the process
        groups' references dropped (``dist.destroy_process_group()`` frees them); later calls do nothing (``with``)."""
        release(self)

    def __enter__(self) -> PipelineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this PipelineEngine was closed (close() or the end of its with block)")

    @property
    def bounds(self) -> list[int]:
        """Stage s holds layers ``bounds[s]`` .. ``bounds[s + 1] - 1``."""
        return list(self.plan.bounds)

    @property
    def num_layers(self) -> int:
        return self.plan.num_layers

    @property
    def peak_stored(self) -> dict[int, int]:
        """Stage -> most microbatches whose activations were held at once in the last step."""
        return {st.index: st.peak_stored for st in self.stages}

    def parameters_ready(self) -> None:
        """Wait until the parameters hold the last step's update (ZeRO-1 gathers them in the background on CUDA)."""
        if self.zero is not None:
            self.zero.ready()

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (``on_nonfinite="skip"``, or an fp16 overflow)."""
        return self.update.skipped_steps

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group from the next step on."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state keyed by global names (see state.py): model, optimizer, counters, RNG."""
        return self._state.state_dict()

    def loadable_state_dict(self, saved: Mapping[str, TensorInfo | None], restore_rng: bool = False) -> dict[str, Any]:
        """The entries of a saved state (``saved``: key -> (shape, dtype)) this rank loads, as tensors to fill
        in place; then :meth:`load_state_dict` them (see state.py)."""
        return self._state.template(saved, restore_rng)

    def load_state_dict(self, state: Mapping[str, Any], fp16_scale: bool = False) -> None:
        """Take a filled :meth:`loadable_state_dict`: optimizer state, counters and RNG (the model entries
        were filled in place). ``fp16_scale``: continue the saved fp16 loss scale."""
        self._state.load_state_dict(state, fp16_scale)

    def train_batch(self, data_iter: Iterator[Any] | None) -> StepResult:
        """One optimizer step over ``microbatches`` microbatches per replica; returns the global mean loss.

        ``data_iter`` yields ``(inputs, target)`` microbatches; only ranks holding the first or last
        stage read it (inputs on the first, targets on the last), others may pass None. An exception
        on any rank ends the step on every rank (faults.py); see [Note: the end of a step].
        """
        self._check_open()
        try:
            result = self._train_batch(data_iter)
        except BaseException as exc:
            self.watch.report(exc)
            raise
        self._steps_run += 1
        if self._fixed_timeout is None and self._steps_run > 1:   # the first step (start-up) does not count
            self._step_times = (self._step_times + [result.step_time])[-50:]
            self.watch.timeout = adaptive_timeout(self._step_times)
        return result

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any] | None, return_outputs: bool = False) -> StepResult:
        """Forward only over ``microbatches`` microbatches; global mean loss on every rank. With ``return_outputs``
        the last stage's rank gets the model outputs per microbatch."""
        self._check_open()
        try:
            result = self._run(self.eval_program, data_iter, train=False, keep_outputs=return_outputs)
            result.loss = self.consensus.eval_loss(self.stages[-1])
        except BaseException as exc:
            self.watch.report(exc)
            raise
        if return_outputs and self.stages[-1].is_last:
            result.outputs = merged([self.stages[-1].outputs[k] for k in sorted(self.stages[-1].outputs)], self.pieces)
        result.step_time = self.clock.elapsed(self.clock.mark())   # (the loss's sum included; one wait on CUDA)
        result.records = self.clock.records()
        return result

    # ------------------------------------------------------------------ a training step

    def _train_batch(self, data_iter: Iterator[Any] | None) -> StepResult:
        buffers = self.update.begin()
        result = self._run(self.program, data_iter, train=True, keep_outputs=False)
        sync_start, synced = self.update.finish(result, buffers)
        result.step_time = self.clock.end()   # (one wait for the device: the stamps below are read after it)
        result.records = self.clock.records()
        result.started_at = self.clock.started_at
        result.grad_sync_wait = self.clock.elapsed(synced) - self.clock.elapsed(sync_start)
        self.step_count += 1
        return result

    # ------------------------------------------------------------------ interpreting the program

    def _run(self, program: list[Step], data_iter: Iterator[Any] | None, train: bool,
             keep_outputs: bool, replay: bool = False) -> StepResult:
        """``program`` on the step's data (``replay``: the last's again, no DP sync: update.py's [Note: non-finite])."""
        self.watch.context = f"position {self.position}, replica {self.replica}, step {self.step_count}"
        self.watch.doing = "reading the data"
        self.clock.start()
        for st in self.stages:
            st.reset(train)
        data = self.step_data if replay and self.step_data else (
            read_microbatches(data_iter, self.microbatches, self.device, self.step_count, self.rank, self.pieces)
            if self.needs_data else ([], []))
        self.step_data = data if train else None   # (kept until the step's decision: update.py)
        state = StepState(train, keep_outputs, *data, key=step_key(self.seed, self.step_count, train))
        self.wire.begin_step(shape_table(state.inputs), self._ahead[train], train)   # [Note: ragged microbatches]
        # one low-precision copy per weight and step; the caller's RNG as it was (rng.py)
        with cast_cache_scope(self.device, self.precision), kept(generator_of(self.device)):
            for idx, step in enumerate(program):
                if train and idx == self._expect_at:
                    self.consensus.expect(self.plan)
                if train and not replay and idx in self._arm_at:
                    self.grad_sync.arm(self._arm_at[idx])
                self._execute(step, state)
                if train and not replay and idx == self._last_backward:
                    self.grad_sync.start()
        self.watch.doing = "waiting for the step's sends"
        if self.topology.pp > 1:
            start = self.clock.mark()
            self.wire.finish()
            self.clock.add(self.stages[0].index, Phase.WAIT, -1, start, self.clock.mark())
        return StepResult(loss=0.0, peak_stored=self.peak_stored)

    def _receive(self, state: StepState, kind: Kind, a: Action, stage: int, producer: int) -> Any:
        """An input of ``a``: from stage ``producer`` on this rank (pp = 1, a V's turn) or from the wire (timed)."""
        chunk = self._chunk_of.get(producer)
        if chunk is not None:
            return state.local.pop((Kind.F if kind is Kind.RECV_F else Kind.B, a.microbatch, chunk))
        start = self.clock.mark()
        value = self.wire.take(kind, a.microbatch, a.chunk)
        self.clock.add(stage, Phase.WAIT, a.microbatch, start, self.clock.mark())
        return value

    def _pass_on(self, state: StepState, kind: Kind, a: Action, value: Any, consumer: int) -> None:
        """Hand what ``a`` made to stage ``consumer``: kept on this rank when it runs there, else to the wire."""
        if consumer in self._chunk_of:
            state.local[(kind, a.microbatch, a.chunk)] = value
        else:
            self.wire.put(kind, a.microbatch, a.chunk, value)

    def _execute(self, step: Step, state: StepState) -> None:
        """Interpret one step of the program (a compute action, or a comm step for the wire)."""
        a = step[0]
        stage, mb, phase = self.stages[a.chunk], a.microbatch, Phase(a.kind.value) if a.kind.is_compute else Phase.COMM
        self.watch.doing = step   # formatted only if reported (faults.doing_text)
        if a.kind is Kind.F:
            if self.zero is not None:   # this stage's parameters, gathered after the last step ([Note: sharded ...])
                self.zero.ready(self._buckets_of[a.chunk])
            if stage.is_first:
                x = state.inputs[mb]
            else:
                x = self._receive(state, Kind.RECV_F, a, stage.index, stage.index - 1)
            start = self.clock.mark()
            out = stage.forward(mb, x, state.targets[mb] if stage.is_last else None, state.train, state.keep_outputs,
                                microbatch_key(state.key, self.first_microbatch + mb))
            if not stage.is_last:
                self._pass_on(state, Kind.F, a, out, stage.index + 1)
        elif a.kind is Kind.B:
            grads = (None if stage.is_last
                     else self._receive(state, Kind.RECV_B, a, stage.index, stage.index + 1))
            start = self.clock.mark()
            input_grads = stage.backward(mb, grads, (self.position, mb, a.chunk) in self._split)
            if not stage.is_first:
                self._pass_on(state, Kind.B, a, input_grads, stage.index - 1)
        elif a.kind is Kind.W:
            start = self.clock.mark()
            stage.backward_weight(mb)
        else:
            start = self.clock.mark()
            if self.wire.settle(state.computed):   # the proof's completions before this step: timed as waiting
                self.clock.add(stage.index, Phase.WAIT, mb, start, start := self.clock.mark())
            self.wire.post(step, state.computed, read_headers=False)
            if self.wire.headers_due:   # and so is a header step's wait for its header
                self.clock.add(stage.index, Phase.COMM, mb, start, start := self.clock.mark())
                self.wire.read_headers()
                phase = Phase.WAIT
        state.computed = a.kind.is_compute
        self.clock.add(stage.index, phase, mb, start, self.clock.mark())
        self.wire.poll()
