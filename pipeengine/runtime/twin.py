"""The twin of a run: its step time and each position's peak memory, predicted before the first step (torch-free).

[Note: the twin]
From the layer profile (each layer's F, B, W, the engine's own cost around a layer, the bytes its forward
keeps and its parameter and output bytes), the links, the schedule, the recompute per stage, the optimizer and
the host, :func:`predict` gives

* **memory per position**, in five parts: parameters; gradients (one per trainable parameter byte);
  optimizer state (``optimizer_states`` per parameter byte, over dp under ZeRO-1); activations held between
  F and B (the most the position's program holds at once, walked in its order, :func:`held_activations`: each
  microbatch from F until its release keeps its stage's layers' saved bytes, or under recompute only each
  region's input (under "selective" what the profile counted each layer keep); between a split B and its W also
  the gradients W starts from, as the profile measured them (not on a "selective" stage: its B does it all); at
  most the sum of the stages' own peaks: a V's or an interleaved position's stages need not peak together);
  buffers (scratch: backward's working set while one microbatch is in B, :data:`BACKWARD_SET` times the largest
  layer's saved bytes, and under recompute the region recomputed; the wire's: the largest boundary tensor and its
  gradient per microbatch in flight, and one more with ``early_receives`` (Gloo's tags mode posts a step's
  receives with the step before, [Note: receives one step early] in wire.py); and ``runtime``: what the process
  holds beyond the model, measured before the first step);
* **the step time**: the simulated step of the lowered schedule with each stage's own costs and transfers, where a
  stage's F, B and W are its layers' measured phases with the engine's own cost counted once (the profile timed it
  around every layer; a split backward runs a stage a layer at a time, past the first stage unless W needs no
  autograd call (measured.segmented), so there it stays), plus posting the
  position's transfers (:class:`Host`), and under recompute B runs F again (and a split W runs from the roots
  again: F, B and W; "selective": B runs what the profile measured it add, the whole backward under a
  split); when the node's processes want more cores than it has, the pipeline's positions share its cores
  (``Dataflow.shared_makespan``: those computing at once each run at the cores' share, so a fill runs at full
  speed and a steady state slower, never faster than the node's work over its cores); plus the end of the
  step: a fixed host part, the gradient all-reduce over dp (ring: ``2 (dp - 1) / dp`` of the gradient bytes over
  the link) and the optimizer's pass over its parameters, gradients and state (bytes over
  ``optimizer_bandwidth``, timed at start), with a clip one more over the gradients.

The prediction is a model, not a measurement: the summary shows the measured figures beside it
(``predicted_step_s`` / ``median_step_s``, ``predicted_peak_memory_mib`` / ``peak_memory_mib``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedule import Costs, Schedule, simulate
from ..schedule.actions import Kind
from ..schedule.lower import lower
from ..schedule.simulate import Dataflow, stage_peaks
from .links import Links
from .measured import LayerCost, segmented, sized, with_transfers
from .options import SELECTIVE

__all__ = ["MemoryParts", "Host", "HOST", "HOST_CUDA", "Twin", "stage_memory", "stage_costs", "predict", "per_stage",
           "PARTS", "BACKWARD_SET", "held_activations"]

# B's working set beside the kept activations, in units of the largest layer's kept bytes: the gradients of its
# saved tensors and the kernels' scratch (fitted on this machine: GPT and ResNet blocks on CPU, benchmarks/twin.py)
BACKWARD_SET = 4.0
PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class MemoryParts:
    """One position's predicted peak, in bytes, by part."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def mib(self) -> dict[str, float]:
        return {k: getattr(self, k) / 2**20 for k in PARTS}


@dataclass(frozen=True)
class Host:
    """What the engine's own code costs on the host beyond each action's (which the profile measures, see
    ``LayerCost.host``), in seconds: the end of a step (the consensus, the norm, zeroing), and posting one batch
    of transfers: a fixed part and its bytes over ``post_bandwidth`` (Gloo copies them on CPU)."""

    per_step: float = 1.0e-3
    per_post: float = 0.3e-3
    post_bandwidth: float = 250e6


# on this machine (2 cores, Gloo): the comm and sync parts of the step breakdown (python -m benchmarks.twin prints
# them) of pp 2 runs with 2 KiB (mlp), 128 KiB (gpt tiny) and 1 MiB (gpt small) boundaries; the end of the step
# once more after it got cheaper (the pipeline's sum, fewer kernels for the signals): at pp 1 its sync part, the
# optimizer included, is 1.6-1.9 ms for MLP small and GPT tiny (three runs of 2026-11-26), of which the optimizer's
# predicted pass 0.5-1.4 ms (it was 2.5 ms with 2.2-2.7 ms measured before); on CUDA a post enqueues
HOST = Host()
HOST_CUDA = Host(per_step=1e-3, per_post=0.05e-3, post_bandwidth=float("inf"))


def per_stage(recompute: int | None | Sequence[int | None], stages: int) -> list[int | None]:
    """Each stage's recompute (one for every stage, or one per stage)."""
    if recompute is None or isinstance(recompute, int):
        return [recompute] * stages
    out = list(recompute)
    if len(out) != stages:
        raise ValueError(f"recompute per stage needs {stages} entries (got {len(out)})")
    return out


def _regions(layers: Sequence[LayerCost], recompute: int | None) -> list[Sequence[LayerCost]]:
    """The layers of one stage by recompute region (one region: the whole stage; K layers each for every:K)."""
    if not recompute:
        return [layers]
    return [layers[i:i + recompute] for i in range(0, len(layers), recompute)]


def _kept(layer: LayerCost) -> float:
    """Bytes a layer's forward keeps for backward beyond what the next layer keeps of it (its output)."""
    return max(0.0, float(layer.activation_bytes - layer.output_bytes))


def microbatch_activations(layers: Sequence[LayerCost], recompute: int | None,
                           input_bytes: float) -> tuple[float, float]:
    """(bytes one microbatch keeps between F and B on a stage of ``layers``, bytes more while one is recomputed)."""
    if recompute is None:
        return sum(_kept(c) for c in layers), 0.0
    if recompute == SELECTIVE:   # each layer a region: what it keeps, and one layer's rest while it is recomputed
        return (sum(_kept(c) if c.selective_bytes is None else float(c.selective_bytes) for c in layers),
                max(_kept(c) for c in layers))
    regions = _regions(layers, recompute)
    inputs = [input_bytes] + [float(r[-1].output_bytes) for r in regions[:-1]]
    return sum(inputs), max(sum(_kept(c) for c in r) for r in regions)


def held_activations(schedule: Schedule, position: int, keep: dict[int, float], for_w: dict[int, float],
                     split: frozenset[tuple[int, int, int]]) -> float:
    """The most ``position`` holds at once of what its microbatches keep: per stage ``keep`` bytes from F until B
    (until W when split) and ``for_w`` more (or less, where B freed more than W keeps) from a split B until its W,
    walked in the order its program runs them (at most the sum of the stages' own peaks: a V's or an interleaved
    position's stages need not peak together).
    Nothing for a forward-only schedule. ``split``: the backwards that are split (the schedule's
    :meth:`~Schedule.split_backwards`, less those the runtime runs whole in B)."""
    if schedule.forward_only:
        return 0.0
    live = peak = 0.0
    for a in schedule.compute_actions(position):
        s = schedule.stage(position, a.chunk)
        if a.kind is Kind.F:
            live += keep[s]
        elif schedule.releases(position, a, split):   # its activations go (and with a W what it kept for W)
            live -= keep[s] + (for_w[s] if a.kind is Kind.W else 0.0)
        elif a.kind is Kind.B:   # a split B: the gradients W starts from stay until W
            live += for_w[s]
        peak = max(peak, live)
    return peak


def stage_memory(costs: Sequence[LayerCost], bounds: Sequence[int], schedule: Schedule, *, optimizer_states: float = 2,
                 shards: int = 1, recompute: int | None | Sequence[int | None] = None, input_bytes: float = 0.0,
                 runtime: float | Sequence[float] = 0.0, early_receives: bool = False) -> list[MemoryParts]:
    """Each position's predicted peak by part (see [Note: the twin]); ``shards``: dp under ZeRO-1 (else 1),
    ``recompute``: layers per region (None: none, 0: the whole stage; or one per stage), ``input_bytes``: the
    model's input per microbatch, ``runtime``: bytes a process holds beyond the model (one for all, or one per
    position), ``early_receives``: the wire posts receives a comm step early (one boundary tensor more)."""
    grads = [c.trainable_bytes for c in costs]
    beyond = [float(runtime)] * schedule.pp if isinstance(runtime, (int, float)) else [float(r) for r in runtime]
    regions = per_stage(recompute, schedule.num_stages)
    # a "selective" stage runs its whole backward in B (recompute.py)
    split = schedule.split_backwards(whole={s for s, r in enumerate(regions) if r == SELECTIVE})
    peaks = stage_peaks(schedule, split)
    out = []
    for p in range(schedule.pp):
        stages = [schedule.stage(p, c) for c in range(schedule.chunks)]
        params = sum(costs[i].param_bytes for s in stages for i in range(bounds[s], bounds[s + 1]))
        g = sum(grads[i] for s in stages for i in range(bounds[s], bounds[s + 1]))
        keep, for_w, transient, boundary = {}, {}, 0.0, 0.0
        for s in stages:
            layers = costs[bounds[s]:bounds[s + 1]]
            into = input_bytes if s == 0 else float(costs[bounds[s] - 1].output_bytes)
            keep[s], extra = microbatch_activations(layers, regions[s], into)
            # from a split B until W: the gradients W starts from, less what B freed (not under recompute)
            for_w[s] = sum(float(c.held_for_w or c.output_bytes) - (c.freed_at_b if regions[s] is None else 0)
                           for c in layers)
            # B's working set beside the kept activations: a gradient per saved tensor of the layer it is in
            transient = max(transient, extra + BACKWARD_SET * max(_kept(c) for c in layers))
            boundary = max(boundary, into, float(layers[-1].output_bytes))
        # the optimizer's step, once the activations are gone, makes temporaries of about a layer's parameters
        transient = max(transient, *(float(c.param_bytes) for s in stages for c in costs[bounds[s]:bounds[s + 1]]))
        held = max((peaks[s] for s in stages), default=0)
        acts = held_activations(schedule, p, keep, for_w, split)
        wire = boundary * (2 * (held + 1) + (early_receives and schedule.pp > 1))
        out.append(MemoryParts(params, g, optimizer_states * g / max(1, shards), acts, transient + wire + beyond[p]))
    return out


def _posts(schedule: Schedule, position: int, costs: Sequence[LayerCost], bounds: Sequence[int], host: Host) -> float:
    """Seconds ``position`` spends posting its transfers in a step: per batch a fixed part, per tensor its bytes
    (the output of the stage boundary it crosses, or that output's gradient) over the host's post bandwidth."""
    lowered = schedule if schedule.lowered else lower(schedule, Costs())
    total = 0.0
    for step in lowered.programs[position]:
        moves = [a for a in step if not a.kind.is_compute and a.kind not in (Kind.SEND_H, Kind.RECV_H)]
        if not moves:
            continue
        total += host.per_post
        for a in moves:
            stage = schedule.stage(position, a.chunk)
            # sendF and recvB carry the stage's output (or its gradient); recvF and sendB its input
            last = bounds[stage + 1] - 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else bounds[stage] - 1
            total += (costs[last].output_bytes if last >= 0 else 0) / host.post_bandwidth
    return total


def stage_costs(costs: Sequence[LayerCost], bounds: Sequence[int], schedule: Schedule, host: Host = HOST,
                recompute: int | None | Sequence[int | None] = None) -> list[tuple[float, float, float]]:
    """Per stage its (F, B, W) seconds as a run takes them: its layers' measured phases with the engine's own cost
    counted once (the profile timed it around every layer), posting the position's transfers spread over its F
    and B, and under recompute B running the forward again first."""
    split = schedule.split_backward
    regions = per_stage(recompute, schedule.num_stages)
    out = []
    for s in range(schedule.num_stages):
        layers = costs[bounds[s]:bounds[s + 1]]
        # the engine's own cost: once per stage, but once per layer where a split backward runs the stage a layer
        # at a time ([Note: segments] in stage.py; not under recompute, nor past the first stage where every
        # layer's W needs no autograd call)
        once = not split or not segmented(s == 0, len(layers), regions[s] is not None, False,
                                          all(c.direct_w for c in layers))   # (ties: not seen here)
        apart = split and regions[s] != SELECTIVE   # a selective stage runs the fused backward (recompute.py)
        own = [c.own_phases(apart) if once else c.phases(apart) for c in layers]
        phases = [sum(o[k] for o in own) + once * max(c.host_phases(apart)[k] for c in layers) for k in range(3)]
        p = schedule.placement(s)[0]
        actions = sum(1 for a in schedule.compute_actions(p) if a.kind is not Kind.W)
        post = _posts(schedule, p, costs, bounds, host) / max(1, actions)
        f, b, w = phases[0] + post, phases[1] + post, phases[2]
        if regions[s] is None:
            out.append((f, b, w))
        elif regions[s] == SELECTIVE:   # the recompute in B; under a split, the whole backward in B (stage.py)
            out.append((f, b + w + sum(c.selective_s for c in layers), 0.0) if split else
                       (f, b + sum(c.selective_s for c in layers), w))
        elif split:   # W runs from the roots again, recomputing once ([Note: split backward] in backward.py)
            out.append((f, b + f, w + f + b))
        else:
            out.append((f, b + f, w))
    return out


@dataclass
class Twin:
    """The prediction (see [Note: the twin]): seconds of a step and its parts, and each position's peak memory."""

    step_s: float
    parts: dict[str, float]
    memory: list[MemoryParts]
    cores: str = ""

    def describe(self) -> str:
        parts = "  ".join(f"{k} {1e3 * v:.1f}" for k, v in self.parts.items() if v)
        lines = [f"twin: predicted step {1e3 * self.step_s:.1f} ms ({parts} ms){self.cores}"]
        for p, m in enumerate(self.memory):
            lines.append(f"  position {p}: predicted peak {m.total / 2**20:,.0f} MiB = " + "  ".join(
                f"{k} {v:,.0f}" for k, v in m.mib().items()) + " MiB")
        return "\n".join(lines)


def predict(costs: Sequence[LayerCost], bounds: Sequence[int], schedule: Schedule, *, dp: int = 1,
            links: Links | None = None, sizes: Sequence[float] | None = None,
            recompute: int | None | Sequence[int | None] = None,
            optimizer_states: float = 2, zero: bool = False, input_bytes: float = 0.0,
            runtime: float | Sequence[float] = 0.0,
            processes: int = 1, cores: float = 1.0, host: Host = HOST, optimizer_bandwidth: float = 5e9,
            dp_bandwidth: float | None = None, early_receives: bool = False, clip: bool = False) -> Twin:
    """The twin of a run of ``schedule`` on ``bounds`` (see [Note: the twin]). ``processes`` x their threads want
    ``cores``: the node's ranks and cores (above 1 their ratio has the positions share the cores);
    ``dp_bandwidth``: bytes/s of the data-parallel all-reduce (None: the pipeline links', else 1 GB/s); ``clip``: the
    gradients are clipped (one more pass over them, read and written, at the optimizer's speed)."""
    stage = stage_costs(costs, bounds, schedule, host, recompute)
    comm = []
    for s in range(schedule.num_stages - 1):
        p, q = schedule.placement(s)[0], schedule.placement(s + 1)[0]
        comm.append(links.seconds(p, q, costs[bounds[s + 1] - 1].output_bytes) if links is not None else 0.0)
    per_stage_costs, each = with_transfers(stage, comm), sized(sizes, schedule.microbatches)
    compute = simulate(schedule, per_stage_costs, sizes=each).makespan
    share = max(1.0, processes / max(cores, 1e-9))
    if share > 1:   # the node's processes run pipelines of pp ranks each: a pipeline's ranks share its cores
        flow = Dataflow(schedule)
        compute = max(compute, flow.shared_makespan(flow.durations(per_stage_costs), schedule.pp / share, comm, each))
    memory = stage_memory(costs, bounds, schedule, optimizer_states=optimizer_states, shards=dp if zero else 1,
                          recompute=recompute, input_bytes=input_bytes, runtime=runtime, early_receives=early_receives)
    grads = max(m.gradients for m in memory)
    bandwidth = dp_bandwidth or (min(links.bandwidth) if links is not None and links.bandwidth else 1e9)
    sync = 2 * (dp - 1) / dp * grads / bandwidth if dp > 1 else 0.0
    # the optimizer passes over parameters, gradients and state of its share (1 / dp of them under ZeRO-1)
    opt = ((2 + 2 * optimizer_states) / (dp if zero else 1) + 2 * clip) * grads / optimizer_bandwidth
    parts = {"compute": compute, "host": host.per_step * share, "dp sync": sync,
             "optimizer": opt * share}
    where = f"; {processes} processes share {cores:g} cores" if share > 1 else ""
    return Twin(sum(parts.values()), parts, memory, where)
