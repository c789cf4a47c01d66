"""What rank 0 tells the user while a run goes: the wall clock of every step, the timed steps' bubble and time
split, peak memory per position, model FLOP/s and MFU; the progress line, TensorBoard and the summary's figures.

Throughput is the user's stopwatch: a step's wall time runs from the end of the previous step to the end of
this one, so it holds the wait for data, the pipeline step, evaluation, saves and logging. steps/s,
samples/s, tokens/s and model TFLOP/s are all computed from the same wall time (of the steps after the
warm-up), so every line and the summary agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from ..runtime.clock import ActionRecord
from ..runtime.engine import PipelineEngine, StepResult
from ..runtime.topology import Topology
from ..runtime.twin import Twin
from .breakdown import PARTS, decompose, pipeline_bubble, simulated_bubble
from .report import mean
from .resources import peak_memory, process_age
from .tensorboard import MetricsWriter
from .timeline import chrome_trace, side_by_side

__all__ = ["TimedStep", "StepTimes", "Reporter", "STEP_PARTS"]
T = TypeVar("T")

STEP_PARTS = ("data", *PARTS, "other")   # a step's wall time, split (sums to 1 in the summary)


@dataclass
class TimedStep:
    """A step whose every position's timings were gathered: its bubble, measured and simulated, and time split."""

    step: int
    measured_bubble: float
    simulated_bubble: float
    parts: dict[str, float]   # share of the pipeline step per part (breakdown.PARTS), mean over positions


@dataclass
class StepTimes:
    """Rank 0's clock of this run's steps (seconds): wall time, the wait for the batch, the pipeline step."""

    warm: int                                        # the first ``warm`` steps are left out of the rates
    walls: list[float] = field(default_factory=list)
    data: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    tokens: list[tuple[int, int, int]] = field(default_factory=list)   # per step: real tokens, positions, Σ len²
    # running sums (wall, real, positions, Σ len²) over every step and over the warm-up: rates in O(1) a step
    _sums: list[float] = field(default_factory=lambda: [0.0] * 4)
    _warm_sums: list[float] = field(default_factory=lambda: [0.0] * 4)

    def add(self, wall: float, data: float, step: float, tokens: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.walls.append(wall)
        self.data.append(data)
        self.steps.append(step)
        self.tokens.append(tokens)
        for k, x in enumerate((wall, *tokens)):
            self._sums[k] += x
            if len(self.walls) <= self.warm:
                self._warm_sums[k] += x

    def steady(self, xs: list[T]) -> list[T]:
        """The values after the warm-up (all of them while the run is still warming up)."""
        return xs[self.warm:] if len(xs) > self.warm else xs

    def _steady_sums(self) -> list[float]:
        if len(self.walls) > self.warm:
            return [x - w for x, w in zip(self._sums, self._warm_sums)]
        return list(self._sums)

    def steady_tokens(self) -> tuple[int, int, int]:
        """Real tokens, positions computed and Σ len² over the steps after the warm-up."""
        _, real, positions, squares = (round(x) for x in self._steady_sums())
        return real, positions, squares

    @property
    def steady_steps(self) -> int:
        return len(self.walls) - self.warm if len(self.walls) > self.warm else len(self.walls)

    @property
    def steady_wall(self) -> float:
        return self._steady_sums()[0]

    @property
    def steps_per_s(self) -> float:
        wall = self.steady_wall
        return self.steady_steps / wall if self.steady_steps and wall > 0 else 0.0

    def shares(self, pipeline_parts: Mapping[str, float]) -> dict[str, float]:
        """The steady wall time split into :data:`STEP_PARTS` (the pipeline step's share split as measured)."""
        wall = mean(self.steady(self.walls)) or 0.0
        if wall <= 0:
            return {k: 0.0 for k in STEP_PARTS}
        data, step = mean(self.steady(self.data)) or 0.0, mean(self.steady(self.steps)) or 0.0
        out = {"data": data / wall, **{k: pipeline_parts.get(k, 0.0) * step / wall for k in PARTS}}
        out["other"] = max(0.0, 1.0 - sum(out.values()))
        return out


def gather_timings(res: StepResult, memory: dict[str, float], group: Any
                   ) -> dict[int, tuple[list[ActionRecord], dict[str, float], float]] | None:
    """Every rank's records, peak memory and step start (the host's wall clock) on the group's first rank (None
    elsewhere); collective on ``group``."""
    size = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list[Any] | None = [None] * size if dist.get_rank() == first else None
    dist.gather_object(([tuple(r) for r in res.records], memory, res.started_at), gathered, dst=first, group=group)
    if gathered is None:
        return None
    senders = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    return {src: ([ActionRecord(*t) for t in rs], mem, at) for src, (rs, mem, at) in zip(senders, gathered)}


class Reporter:
    """Rank 0's account of the run (every rank keeps one; only rank 0's writer writes)."""

    def __init__(self, engine: PipelineEngine, topo: Topology, device: torch.device, run_dir: str, *,
                 global_batch: int, tokens_per_example: int | None, flops_per_example: float | None,
                 peak_tflops: float | None, warm: int, writer: MetricsWriter, twin: Twin | None = None,
                 flops_per_length: tuple[float, float] | None = None) -> None:
        self.engine, self.topo, self.device, self.run_dir = engine, topo, device, run_dir
        self.global_batch, self.tokens = global_batch, tokens_per_example
        self.flops, self.peak = flops_per_example, peak_tflops
        self.per_length = flops_per_length   # sequences of their own lengths: (a, b) of a n + b n² (resources.py)
        self.times = StepTimes(warm)
        self.timed: list[TimedStep] = []
        self.memory: dict[int, dict[str, float]] = {}   # position -> its peak memory (replica 0), MiB
        self.writer = writer
        self.startup_s: float | None = None   # the process's age when the first step began
        self.twin = twin   # the prediction made before the first step (None: no layer profile)
        if twin is not None:
            writer.log_text("twin", "".join(f"    {line}\n" for line in twin.describe().splitlines()))

    # ------------------------------------------------------------------ figures

    def rates(self) -> dict[str, float | None]:
        """steps/s, samples/s, tokens/s and model TFLOP/s per rank, all from the same wall time; with sequences of
        their own lengths tokens/s counts real tokens only, and ``padding_fraction`` is the positions computed for
        padding (the same steps)."""
        steps = self.times.steps_per_s
        samples = steps * self.global_batch
        world = self.topo.pp * self.topo.dp
        flops = self.flops_per_sample()
        tflops = samples * flops / 1e12 / world if flops else None
        tokens = samples * self.tokens if self.tokens else None
        real, positions, _ = self.times.steady_tokens()
        if positions:
            tokens = real / self.times.steady_wall
        return {"steps_per_s": steps, "samples_per_s": samples, "tokens_per_s": tokens,
                "padding_fraction": 1 - real / positions if positions else None,
                "tflops_per_rank": tflops, "mfu": tflops / self.peak if tflops and self.peak else None}

    def flops_per_sample(self) -> float | None:
        """Model FLOPs per sample: the counted figure, or with sequences of their own lengths the mean over the steps
        after the warm-up of their real work (a n + b n² per sequence)."""
        real, _, squares = self.times.steady_tokens()
        if self.per_length is None or not real:
            return self.flops
        a, b = self.per_length
        return (a * real + b * squares) / (self.times.steady_steps * self.global_batch)

    def peak_memory(self) -> dict[str, float]:
        """The largest peak over the positions gathered so far (this rank's own before the first gather)."""
        if not self.memory:
            return peak_memory(self.device)
        return max(self.memory.values(), key=lambda m: max(m.values()))

    # ------------------------------------------------------------------ per step

    def timings(self, step: int, res: StepResult, lr: float, trace: bool, timeline: bool) -> None:
        """Gather replica 0's records and peak memory (its ranks; collective) and log them on rank 0."""
        got = gather_timings(res, peak_memory(self.device), self.engine.groups.pp_group)
        if got is None:
            return
        records = {rank: recs for rank, (recs, _, _) in got.items()}
        self.memory = {self.topo.position_of(rank): mem for rank, (_, mem, _) in got.items()}
        topo, engine = self.topo, self.engine
        step_time = max(r.end for rs in records.values() for r in rs)
        parts = decompose(records, step_time)   # replica 0's ranks, one per position
        measured = pipeline_bubble(parts)
        theory = simulated_bubble(engine.schedule, [records.get(topo.rank(p, 0), []) for p in range(topo.pp)])
        share = {k: sum(p[k] for p in parts.values()) / len(parts) / step_time for k in PARTS}
        self.timed.append(TimedStep(step, measured, theory, share))
        self.writer.log_step(step, loss=res.loss, lr=lr, grad_norm=res.grad_norm, step_time=step_time,
                             samples_per_s=None, tokens_per_s=None,
                             parts_by_position={topo.position_of(rk): p for rk, p in parts.items()},
                             measured_bubble=measured, theoretical_bubble=theory)
        self.writer.log_scalars(step, {f"memory/position{p}/{kind}_mib": v for p, mem in self.memory.items()
                                       for kind, v in mem.items()})
        if self.twin is not None:   # beside the measured figures: the step's and each position's peak
            self.writer.log_scalars(step, {"time/predicted_step_s": self.twin.step_s, **{
                f"memory/position{p}/predicted_mib": m.total / 2**20 for p, m in enumerate(self.twin.memory)}})
        if timeline or trace:
            drawn = side_by_side(records, {rank: at for rank, (_, _, at) in got.items()})   # one time axis
            if timeline:
                self.writer.log_timeline(step, drawn)
            if trace:
                chrome_trace(drawn, os.path.join(self.run_dir, f"trace_step{step}.json"), step)

    def step_done(self, step: int, wall: float, data: float, pipeline: float,
                  tokens: Callable[[int], tuple[int, int, int]]) -> None:
        """The step's wall time is known: log it with the rates it gives (the progress line's figures); ``tokens``:
        a step's real tokens, positions computed and Σ len² (zeros: not counted), asked where the figures are
        shown."""
        self.times.add(wall, data, pipeline, tokens(step) if self.writer.enabled else (0, 0, 0))
        rates = self.rates()
        scalars = {"time/wall_s": wall, "time/data_s": data,
                   **{f"throughput/{k}": v for k, v in rates.items() if k != "mfu" and v is not None}}
        if rates["mfu"] is not None:
            scalars["throughput/mfu"] = rates["mfu"]
        self.writer.log_scalars(step, scalars)

    # ------------------------------------------------------------------ the summary's figures

    def figures(self, start: int) -> dict[str, Any]:
        """Throughput, time split, bubble, memory and FLOPs for the summary (the timed steps after warm-up)."""
        warm = self.times.warm
        timed = [t for t in self.timed if t.step >= start + warm] or self.timed
        pipeline_parts = {k: mean([t.parts[k] for t in timed]) or 0.0 for k in PARTS}
        steady = self.times.steady(self.times.steps) or [float("nan")]
        return {**self.rates(), "global_batch": self.global_batch, "warmup_steps": warm,
                "elapsed_s": process_age(), "startup_s": self.startup_s, "steps_s": sum(self.times.walls),
                "wall_s_per_step": mean(self.times.steady(self.times.walls)),
                "data_s_per_step": mean(self.times.steady(self.times.data)),
                "median_step_s": sorted(steady)[len(steady) // 2],
                "flops_per_sample": self.flops_per_sample(), "peak_tflops": self.peak,
                "timed_steps": [t.step for t in timed],
                "measured_bubble": mean([t.measured_bubble for t in timed]),
                "theoretical_bubble": mean([t.simulated_bubble for t in timed]),
                "step_parts": self.times.shares(pipeline_parts) if timed else {},
                "peak_memory_mib": {str(p): m for p, m in sorted(self.memory.items())}, **self.predicted()}

    def predicted(self) -> dict[str, Any]:
        """The twin's figures for the summary: the step (seconds) and each position's peak (MiB) and its parts."""
        twin = self.twin
        if twin is None:
            return {"predicted_step_s": None, "predicted_peak_memory_mib": {}}
        return {"predicted_step_s": twin.step_s, "predicted_step_parts_s": twin.parts,
                "predicted_peak_memory_mib": {str(p): m.total / 2**20 for p, m in enumerate(twin.memory)},
                "predicted_memory_parts_mib": {str(p): m.mib() for p, m in enumerate(twin.memory)}}
