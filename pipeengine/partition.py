"""Split an ordered layer list into pipeline stages: uniform, by parameters, by cost, or explicit bounds."""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from .actions import Schedule
    from .simulate import Costs

__all__ = ["PartitionError", "balance_min_max", "partition", "split", "describe", "LayerCost",
           "profile_layers", "choose_bounds", "rank_costs", "Choice", "agree_bounds"]

METHODS = ("profile", "parameters", "uniform", "cost")


class PartitionError(ValueError):
    """Layers that cannot be split as asked (too few layers, bad bounds, unknown method)."""


def _feasible(weights: Sequence[float], parts: int, cap: float) -> bool:
    count, acc = 1, 0.0
    for w in weights:
        if w > cap:
            return False
        if acc + w > cap:
            count, acc = count + 1, w
        else:
            acc += w
    return count <= parts


def balance_min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``num_parts`` non-empty parts minimising the largest part sum.

    Exact (dynamic programming over prefix sums, O(parts * n^2)), not greedy. Returns bounds of
    length ``num_parts + 1``. Ties are broken deterministically: every prefix keeps its earliest
    optimal cut, so the earlier stages are balanced too and, with equal weights, the later stages
    take the extra layers (the last stage also computes the loss).
    """
    n = len(weights)
    if num_parts < 1:
        raise PartitionError(f"need at least one part (got {num_parts})")
    if n < num_parts:
        raise PartitionError(f"{n} layers cannot fill {num_parts} stages (each stage needs >= 1 layer); "
                             f"use at most {n} stages or split the model into more layers")
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must be >= 0 (got {min(weights)})")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-part over splitting the first i weights into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:  # strict: keeps the earliest j among ties
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in layer.parameters()}.values())


def partition(layers: Sequence[nn.Module], num_stages: int, method: str = "parameters", *,
              boundaries: Sequence[int] | None = None, costs: Sequence[float] | None = None) -> list[int]:
    """Stage bounds ``[0, b1, ..., len(layers)]``: stage s holds ``layers[bounds[s]:bounds[s+1]]``.

    ``boundaries`` (full bounds, num_stages + 1 entries) overrides ``method``. "uniform" balances
    layer counts (extra layers go to the later stages); "parameters" balances parameter counts
    (parameter-free layers weigh a little, so they still spread); "cost" balances ``costs``
    (e.g. each layer's total from :func:`profile_layers`).
    """
    n = len(layers)
    if boundaries is not None:
        b = list(boundaries)
        if len(b) != num_stages + 1 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in zip(b, b[1:])):
            example = partition(layers, num_stages, "uniform") if n >= num_stages else "(too few layers)"
            raise PartitionError(f"boundaries {b} must be {num_stages + 1} strictly increasing indices from 0 to "
                                 f"{n} (stage s holds layers[b[s]:b[s+1]]), e.g. {example}")
        return b
    if n < num_stages:
        raise PartitionError(f"{n} layers cannot fill {num_stages} stages (each stage needs >= 1 layer); "
                             f"use at most {n} stages or split the model into more layers")
    if method == "uniform":
        base, extra = divmod(n, num_stages)
        sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return bounds
    if method == "parameters":
        counts = [float(_param_count(layer)) for layer in layers]
        eps = max(1.0, sum(counts) / max(1, n) * 1e-3)
        return balance_min_max([c if c > 0 else eps for c in counts], num_stages)
    if method == "cost":
        if costs is None or len(costs) != n:
            raise PartitionError(f"method 'cost' needs one cost per layer ({n}), got "
                                 f"{'none' if costs is None else len(costs)}; see profile_layers()")
        return balance_min_max(list(costs), num_stages)
    if method == "profile":
        raise PartitionError("partition 'profile' measures the layers on the ranks: the engine does it "
                             "(PipelineEngine(..., partition='profile', sample=one microbatch))")
    raise PartitionError(f"unknown partition method {method!r}; choose one of {', '.join(METHODS)} "
                         f"or pass boundaries=")


def split(layers: Sequence[nn.Module], bounds: Sequence[int]) -> list[list[nn.Module]]:
    return [list(layers[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def describe(layers: Sequence[nn.Module], bounds: Sequence[int]) -> str:
    """One line per stage: its layer range, parameter count and share of the total."""
    counts = [_param_count(layer) for layer in layers]
    total = max(1, sum(counts))
    lines = []
    for s in range(len(bounds) - 1):
        n = sum(counts[bounds[s]:bounds[s + 1]])
        lines.append(f"stage {s}: layers {bounds[s]}..{bounds[s + 1] - 1}  {n:,} params ({100 * n / total:.1f}%)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- partition by measured cost

@dataclass
class LayerCost:
    """One layer on one microbatch, as the engine runs it: seconds of F, of B and W (split backward, see
    stage.py) and of the fused backward, the bytes it keeps for backward (its output included) and the
    bytes of its parameters."""

    f: float
    b: float
    w: float
    fused: float
    activation_bytes: int
    param_bytes: int

    @property
    def total(self) -> float:
        return self.f + self.b + self.w

    def phases(self, split: bool) -> tuple[float, float, float]:
        """(f, b, w) as the simulator takes them: without a split, B runs b + w = the fused backward."""
        return (self.f, self.b, self.w) if split else (self.f, max(0.0, self.fused - self.w), self.w)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(layers: Sequence[nn.Module], first: int, num_layers: int, x: Any, *,
                   loss_fn: Callable[[Any, Any], torch.Tensor], target: Any, device: torch.device,
                   precision: str = "fp32", split: bool | None = None, repeats: int = 3,
                   min_time: float = 0.1, max_repeats: int = 25) -> list[LayerCost]:
    """Measure ``layers`` (model layers ``first``, ``first + 1``, ...) on one microbatch ``x``, the input of
    ``layers[0]``: each layer runs F, B and W as a one-layer chunk of the engine (the model's first layer
    as a first stage, its last with ``loss_fn`` on ``target``). Median of at least ``repeats`` runs after
    one warm-up, more for a fast layer (until ``min_time`` seconds were timed, at most ``max_repeats``
    runs), so that a short slow spell of a shared machine does not decide.

    The layers are used as given: pass copies (profiling runs them in train mode, so BatchNorm
    statistics move, and leaves gradients behind).
    """
    from .stage import StageChunk, LayerChain, _detach, _flat   # stage imports nothing from here

    costs: list[LayerCost] = []
    for i, layer in enumerate(layers):
        index = first + i
        stage = 0 if index == 0 else 2 if index == num_layers - 1 else 1
        chunk = StageChunk(LayerChain([layer], index), stage, 3, loss_fn, 1, precision=precision)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t.detach()   # not ``t``: the chunk frees its output's storage in place after F

        last: list[Any] = [None]   # the output of the latest run

        def run(split_backward: bool) -> tuple[float, float, float]:
            """One microbatch: seconds of F, of B (the fused backward if not split) and of W."""
            saved.clear()   # the bytes of the last forward are kept
            chunk.reset()
            _sync(device)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = chunk.forward(0, _detach(x), target if stage == 2 else None, True)
            last[0] = out
            _sync(device)
            t1 = time.perf_counter()
            grads = None if stage == 2 else tuple(torch.ones_like(t) for t in _flat(out) if t.is_floating_point())
            chunk.backward(0, grads, split=split_backward)
            _sync(device)
            t2 = time.perf_counter()
            if split_backward:
                chunk.backward_weight(0)
                _sync(device)
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        times: list[tuple[float, float, float, float]] = []   # (f, b, w, fused)
        rep, timed = 0, 0.0
        while rep <= repeats or (timed < min_time and rep <= max_repeats):
            fused_run = run(False) if split is not True else None
            split_run = run(True) if split is not False else None
            if rep:   # the first run warms up
                if fused_run and split_run:
                    times.append(((fused_run[0] + split_run[0]) / 2, *split_run[1:], fused_run[1]))
                elif split_run:
                    times.append((*split_run, split_run[1] + split_run[2]))
                elif fused_run:
                    times.append((fused_run[0], fused_run[1], 0.0, fused_run[1]))
                timed += sum(sum(r) for r in (fused_run, split_run) if r)
            rep += 1
        out = last[0]
        for p in layer.parameters():
            p.grad = None
        out_bytes = sum(t.numel() * t.element_size() for t in _flat(out)) if out is not None else 0
        f, b, w, fused = (statistics.median(t[k] for t in times) for k in range(4))
        costs.append(LayerCost(f, b, w, fused, activation_bytes=sum(saved.values()) + out_bytes,
                               param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters())))
        x = out
    return costs


@dataclass
class Choice:
    """What the profile partition chose: bounds, the per-stage costs (seconds per microbatch) and the
    simulated step (seconds, compute only) and peak memory estimate per rank (bytes)."""

    bounds: list[int]
    stage_costs: list[tuple[float, float, float]]
    makespan: float
    memory: list[float]
    candidates: int
    split: bool = False   # the schedule splits backward into B and W

    def mean_costs(self) -> "Costs":
        """One stage's average F, B and W: what the schedule is lowered with."""
        from .simulate import Costs
        n = len(self.stage_costs)
        return Costs(*(sum(c[k] for c in self.stage_costs) / n for k in range(3)))

    def describe(self, schedule_name: str) -> str:
        lines = [f"partition profile: bounds {self.bounds} (best of {self.candidates} simulated splits), "
                 f"predicted compute per step {1e3 * self.makespan:.1f} ms with {schedule_name}"]
        for s, (f, b, w) in enumerate(self.stage_costs):
            back = f"B {1e3 * b:.2f} ms  W {1e3 * w:.2f} ms" if self.split else f"backward {1e3 * (b + w):.2f} ms"
            lines.append(f"  stage {s}: layers {self.bounds[s]}..{self.bounds[s + 1] - 1}  per microbatch "
                         f"F {1e3 * f:.2f} ms  {back}")
        lines.append("  peak memory estimate per rank: " + ", ".join(f"{m / 2**30:.2f} GiB" for m in self.memory))
        return "\n".join(lines)


def rank_costs(stage_costs: Sequence[tuple[float, float, float]], schedule: "Schedule") -> list["Costs"]:
    """Per rank, the simulator's costs of one of its chunks: the mean of its stages' (f, b, w)."""
    from .simulate import Costs
    out = []
    for r in range(schedule.pp):
        mine = [c for s, c in enumerate(stage_costs) if schedule.placement(s)[0] == r]
        out.append(Costs(*(sum(x[k] for x in mine) / len(mine) for k in range(3))))
    return out


def choose_bounds(costs: Sequence[LayerCost], schedule: "Schedule", memory_cap: float | None = None,
                  state_factor: float = 4.0, max_candidates: int = 300) -> Choice:
    """Contiguous stage bounds minimising the simulated makespan of ``schedule`` with these layer costs.

    Candidates: every split whose slowest stage is within 1.5x of the best possible slowest stage
    (the ``max_candidates`` most balanced if there are more), each simulated (the first and last
    stage carry their data and loss work, which the layer costs include). A rank's memory is
    estimated as ``state_factor`` x its parameter bytes (parameter, gradient, two Adam moments) plus
    its schedule's peak of microbatches in flight x the activation bytes of a microbatch; with
    ``memory_cap`` (bytes) splits above it are left out.
    """
    from .simulate import Costs, simulate

    n, stages, pp = len(costs), schedule.num_stages, schedule.pp
    if n < stages:
        raise PartitionError(f"{n} layers cannot fill {stages} stages (each stage needs >= 1 layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c.total)
    placement = [schedule.placement(s) for s in range(stages)]
    split = schedule.split_backward
    peaks = simulate(schedule, Costs()).peak_in_flight

    def memory(bounds: list[int]) -> list[float]:
        mem = [0.0] * pp
        act = [0.0] * pp
        for s in range(stages):
            r = placement[s][0]
            layer = costs[bounds[s]:bounds[s + 1]]
            mem[r] += state_factor * sum(c.param_bytes for c in layer)
            act[r] = max(act[r], float(sum(c.activation_bytes for c in layer)))
        return [m + peaks[r] * act[r] for r, m in enumerate(mem)]

    def enumerate_splits(limit: float) -> list[list[int]]:   # at most 100,000
        found: list[list[int]] = []

        def rec(start: int, s: int, acc: list[int]) -> None:
            if len(found) >= 100_000:
                return
            if s == stages - 1:
                if prefix[n] - prefix[start] <= limit:
                    found.append(acc + [n])
                return
            for end in range(start + 1, n - (stages - 1 - s) + 1):
                if prefix[end] - prefix[start] > limit:
                    break
                rec(end, s + 1, acc + [end])
        rec(0, 0, [0])
        return found

    def widest(bounds: list[int]) -> float:
        return max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))

    candidates = enumerate_splits(1.5 * widest(balance_min_max([c.total for c in costs], stages)) + 1e-12)
    if memory_cap is not None:
        candidates = [b for b in candidates if max(memory(b)) <= memory_cap]
        if not candidates:   # the cap may need an unbalanced split
            every = enumerate_splits(float("inf"))
            candidates = [b for b in every if max(memory(b)) <= memory_cap]
        if not candidates:
            least = min(every, key=lambda b: max(memory(b)))
            raise PartitionError(f"no split of the {n} layers into {stages} stages fits the memory cap of "
                                 f"{memory_cap / 2**30:.2f} GiB per rank; the least is "
                                 f"{max(memory(least)) / 2**30:.2f} GiB (bounds {least}). Raise the cap, use "
                                 f"more pipeline ranks, or activation checkpointing")
    candidates = sorted(candidates, key=lambda b: (widest(b), b))[:max_candidates]
    scored = []
    for bounds in candidates:
        per_stage = []
        for s in range(stages):
            phases = [c.phases(split) for c in costs[bounds[s]:bounds[s + 1]]]
            per_stage.append((sum(x[0] for x in phases), sum(x[1] for x in phases), sum(x[2] for x in phases)))
        scored.append((simulate(schedule, rank_costs(per_stage, schedule)).makespan, widest(bounds), bounds,
                       per_stage))
    makespan, _, bounds, per_stage = min(scored, key=lambda x: (x[0], x[1], x[2]))
    return Choice(list(bounds), per_stage, makespan, memory(bounds), len(scored), split)


# ------------------------------------------------------------------ agreeing on the bounds (collective)

def agree_bounds(specs: Sequence[Any], schedule: "Schedule", method: str | Sequence[int], *, seed: int,
                 sample: tuple[Any, Any] | None, memory_cap: float | None, precision: str,
                 loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device) -> tuple[list[int], Choice | None]:
    """The stage bounds every rank uses, and the profile's :class:`Choice` (None for other methods).

    Collective over the default group. One all-gather of layer fingerprints first checks that every
    rank was given the same model; rank 0 computes the bounds once and broadcasts them (an error in
    them is raised on every rank). ``specs`` are modules or factories (layers.py): sizing needs no
    weights, and "profile" builds only a share of the layers per rank (:func:`_profile_shares`).
    """
    from .layers import fingerprint, model_mismatch, sizing_layers
    sizing = sizing_layers(specs)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seed, [fingerprint(m) for m in sizing]))
    mismatch = model_mismatch(everyone)
    if mismatch:
        raise ValueError(mismatch)
    profiled: list[LayerCost] = []
    if method == "profile" and schedule.num_stages > 1:
        profiled = _profile_shares(specs, seed, sample, loss_fn, device, precision, schedule.split_backward)
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            if profiled:
                answer[0] = choose_bounds(profiled, schedule, memory_cap)
            elif method == "profile":
                answer[0] = [0, len(specs)]
            elif isinstance(method, str):
                answer[0] = partition(sizing, schedule.num_stages, method)
            else:
                answer[0] = partition(sizing, schedule.num_stages, boundaries=list(method))
        except ValueError as exc:
            answer[0] = str(exc)
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ValueError(answer[0])
    if isinstance(answer[0], Choice):
        return list(answer[0].bounds), answer[0]
    return list(answer[0]), None


def _profile_shares(specs: Sequence[Any], seed: int, sample: tuple[Any, Any] | None,
                    loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device, precision: str,
                    split: bool | None) -> list[LayerCost]:
    """Every layer's measured costs, on every rank. Rank r profiles a contiguous share of the layers
    (copies, or built from the factories) on its own device: it receives its share's input from rank
    r - 1, passes its share's output on at once (one forward, no grad), then times its share while
    the later ranks do theirs; on CPU with more processes x threads than cores it passes the
    output on only after timing (the shares are timed one after the other). A failure on any
    rank is raised on every rank. The share's layers are freed on return."""
    from .layers import build_layer
    from .stage import PRECISIONS, LayerChain
    from .stage import to_device as _to
    if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError("partition='profile' needs sample=(inputs, target): one microbatch, on every rank, "
                         "to time the layers on (or choose partition='parameters')")
    n, rank, world = len(specs), dist.get_rank(), dist.get_world_size()
    owners = min(n, world)
    shares = partition(list(range(n)), owners, "uniform")   # type: ignore[arg-type]
    result: Any = []
    if rank < owners:
        lo, hi = shares[rank], shares[rank + 1]
        x: Any = _to(sample[0], device)
        if rank > 0:
            got: list[Any] = [None]
            dist.recv_object_list(got, src=rank - 1)
            x = _to(got[0], device)
        passed = rank + 1 == owners   # the next share's input (or the error) went on
        # more processes than cores: time the shares one after the other (passing the input on
        # after timing), or a share timed while others run would look slower than it is
        one_at_a_time = device.type != "cuda" and world * torch.get_num_threads() > (os.cpu_count() or 1)
        try:
            if isinstance(x, str):
                raise ValueError(x)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                layers = [build_layer(copy.deepcopy(specs[i]) if isinstance(specs[i], nn.Module) else specs[i],
                                      i, seed).to(device) for i in range(lo, hi)]
                with torch.no_grad(), torch.autocast(device.type, enabled=precision != "fp32",
                                                     dtype=PRECISIONS[precision] or torch.float32):
                    out = LayerChain(layers, lo)(x)
                if not passed and not one_at_a_time:
                    dist.send_object_list([_to(out, torch.device("cpu"))], dst=rank + 1)
                    passed = True
                result = profile_layers(layers, lo, n, x, loss_fn=loss_fn, target=_to(sample[1], device),
                                        device=device, precision=precision, split=split)
                if not passed:
                    dist.send_object_list([_to(out, torch.device("cpu"))], dst=rank + 1)
                    passed = True
        except (ValueError, TypeError, RuntimeError) as exc:
            result = f"profiling layers {lo}..{hi - 1} on rank {rank} failed: {exc}"
            if not passed:
                dist.send_object_list([result], dst=rank + 1)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, result)
    failed = next((r for r in everyone if isinstance(r, str)), None)
    if failed:
        raise ValueError(failed)
    return [c for r in everyone for c in r]
