"""Measuring layers: every layer's F, B, W and fused-backward time and its memory on a real microbatch.

:func:`profile_layers` times layers in this process; :func:`profile_shares` splits the work over
the ranks (each times a contiguous share, in parallel where the machine allows) and gives every
rank every layer's costs.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .agree import gathered
from .device import synchronize
from .direct import covers, read_bytes
from .hangs import ranks_text
from .layers import LayerSpec, build_layer
from .logs import log
from .microbatches import loss_pieces
from .planner import LayerCost, partition
from .chain import LayerChain
from .stage import DTYPES, Stage
from .tensors import detach, flat, to_device, to_float

__all__ = ["profile_layers", "profile_shares", "shared_costs", "layer_kind"]


class _LayerTimer:
    """One layer run as a one-layer stage of the engine (the model's first layer as a first stage, its
    last with the loss), timed phase by phase; counts the bytes its forward keeps for backward."""

    def __init__(self, layer: nn.Module, index: int, num_layers: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 target: Any, device: torch.device, precision: str, recompute: str = "none") -> None:
        self.kind = 0 if index == 0 else 2 if index == num_layers - 1 else 1   # first, middle or last stage
        self.stage = Stage(LayerChain([layer], index), self.kind, 3, loss_fn, 1, recompute, precision=precision)
        self.target = target if self.kind == 2 else None
        self.device = device
        self.params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self.saved: dict[int, int] = {}   # storage -> bytes kept for backward by the last counted forward
        self.out: Any = None               # the output of the last forward
        self.held_for_w = 0                # bytes a split backward's B kept for W (the last split run)
        self.read_by_w: int | None = None  # bytes of saved tensors W reads after a B that freed the graph (else None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved[storage.data_ptr()] = storage.nbytes()
        return t.detach()   # not ``t``: the stage frees its output's storage in place after F

    def run(self, x: Any, split_backward: bool, count: bool = False) -> tuple[float, float, float]:
        """One microbatch: seconds of F, of B (the fused backward if not split) and of W; with ``count`` also the
        bytes F keeps for backward (``saved``). Only an uncounted run is timed as the engine runs: a saved-tensor
        hook costs F time and sends W through autograd ([Note: W without the engine] in direct.py)."""
        if count:
            self.saved.clear()
        self.stage.reset()
        synchronize(self.device)
        t0 = time.perf_counter()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if count else contextlib.nullcontext()
        with hooks:
            self.out = self.stage.forward(0, detach(x), self.target, True)
        synchronize(self.device)
        t1 = time.perf_counter()
        grads = None if self.kind == 2 else tuple(torch.ones_like(t) for t in flat(self.out) if t.is_floating_point())
        self.stage.backward(0, grads, split=split_backward)
        synchronize(self.device)
        t2 = time.perf_counter()
        if split_backward:
            self.held_for_w = _held_for_w(self.stage)
            self.read_by_w = _read_by_w(self.stage)
            self.stage.backward_weight(0)
            synchronize(self.device)
        return t1 - t0, t2 - t1, time.perf_counter() - t2


def _held_for_w(stage: Stage) -> int:
    """Bytes B kept for W on microbatch 0 of ``stage`` (the gradients at the branch nodes, or at the roots)."""
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for part in stage.saved.get(0, []) for t in (
                *(g for group in part.groups for grads in group.grads.values() for g in grads if g is not None),
                *(g for g in part.grads if isinstance(g, torch.Tensor)))}
    return sum(kept.values())


def _read_by_w(stage: Stage) -> int | None:
    """Bytes of the saved tensors W reads on microbatch 0 of ``stage`` after a B that freed its graph, parameters
    aside; None where B kept the graph ([Note: B frees what W does not read] in backward.py)."""
    parts = stage.saved.get(0, [])
    if not parts or any(part.rest or any(g.bound is None for g in part.groups) for part in parts):
        return None
    return read_bytes((g.bound for part in parts for g in part.groups if g.bound is not None),
                      stage.module.parameters())


STABLE = 0.05   # the median is stable when the last runs move it by no more than this (relative)


def _measure(timer: _LayerTimer, x: Any, split: bool | None, repeats: int, min_time: float,
             max_repeats: int) -> tuple[float, float, float, float, float]:
    """Median (f, b, w, fused) of at least ``repeats`` timed runs after one warm-up, more until ``min_time``
    seconds were timed and the median is stable (the last two runs moved it by at most ``STABLE``), at most
    ``max_repeats`` runs; and the runs' spread (interquartile range / median of F + B + W)."""
    times: list[tuple[float, float, float, float]] = []
    rep, timed = 0, 0.0
    while rep <= repeats or ((timed < min_time or not _stable([sum(t[:3]) for t in times]))
                             and rep <= max_repeats):
        fused_run = timer.run(x, False, count=not rep) if split is not True else None   # (the warm-up counts)
        split_run = timer.run(x, True, count=not rep) if split is not False else None
        if rep:   # the first run warms up
            if fused_run and split_run:
                times.append(((fused_run[0] + split_run[0]) / 2, *split_run[1:], fused_run[1]))
            elif split_run:
                times.append((*split_run, split_run[1] + split_run[2]))
            elif fused_run:
                times.append((fused_run[0], fused_run[1], 0.0, fused_run[1]))
            timed += sum(sum(r) for r in (fused_run, split_run) if r)
        rep += 1
    f, b, w, fused = (statistics.median(t[k] for t in times) for k in range(4))
    totals = sorted(sum(t[:3]) for t in times)
    q1, q3 = totals[len(totals) // 4], totals[(3 * len(totals)) // 4]
    return f, b, w, fused, (q3 - q1) / max(statistics.median(totals), 1e-12)


def _stable(totals: list[float]) -> bool:
    """Whether the last two runs moved the median by at most ``STABLE``."""
    if len(totals) < 5:
        return False
    now, before = statistics.median(totals), statistics.median(totals[:-2])
    return abs(now - before) <= STABLE * max(before, 1e-12)


def layer_kind(layer: nn.Module, x: Any, role: int = 1) -> str:
    """What makes two layers cost the same, as a digest: each module's class and settings (its plain attributes:
    numbers, strings, flags, a custom layer's own settings among them), its parameters' and buffers' shapes and
    dtypes, the input's shapes and dtypes, and its place (``role``: 0 the model's first layer, 2 its last, timed
    with the loss, 1 any other)."""
    def plain(v: Any) -> bool:
        return isinstance(v, (int, float, str, bool, type(None))) or (
            isinstance(v, tuple) and all(isinstance(e, (int, float, str, bool)) for e in v))
    parts = [f"{name}:{type(m).__qualname__}:{sorted((k, v) for k, v in vars(m).items() if plain(v))}"
             for name, m in layer.named_modules()]
    tensors = [(name, tuple(t.shape), str(t.dtype)) for name, t in (*layer.named_parameters(), *layer.named_buffers())]
    inputs = [(tuple(t.shape), str(t.dtype)) for t in flat(x)]
    return hashlib.sha1(f"{role}|{parts}|{tensors}|{inputs}".encode()).hexdigest()   # small: gathered by every rank


def shared_costs(costs: Sequence[LayerCost]) -> tuple[list[LayerCost], list[str]]:
    """Layers of one kind (:func:`layer_kind`) take one cost, each phase the median of theirs; a line for each
    kind whose layers measured further apart than the profile's noise allows (a busy machine, most likely)."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(costs):
        if c.kind:
            groups.setdefault(c.kind, []).append(i)
    out, lines = list(costs), []
    for members in (m for m in groups.values() if len(m) > 1):
        mine = [costs[i] for i in members]
        f, b, w, fused = (statistics.median(getattr(c, k) for c in mine) for k in ("f", "b", "w", "fused"))
        one = replace(mine[0], f=f, b=b, w=w, fused=fused, noise=statistics.median(c.noise for c in mine))
        totals = [c.total for c in mine]
        apart = max(totals) / max(min(totals), 1e-12) - 1
        if apart > max(0.25, 3 * one.noise):
            lines.append(f"layers {ranks_text(members)} are alike but measured {1e3 * min(totals):.2f} to "
                         f"{1e3 * max(totals):.2f} ms per microbatch ({100 * apart:.0f}% apart, beyond the "
                         f"{100 * one.noise:.0f}% spread of their runs: a busy machine?); each is planned with "
                         f"their median F, B and W ({1e3 * one.total:.2f} ms in all)")
        for i in members:
            out[i] = one
    return out, lines


class _Nothing(nn.Module):
    """A layer that computes (almost) nothing: one scalar weight times a one-element input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _host_cost(device: torch.device, loss_fn: Callable[[Any, Any], torch.Tensor], precision: str,
               split: bool | None) -> tuple[float, float, float, float]:
    """The engine's own seconds of F, B, W and the fused backward around a layer, timed on one that computes
    nothing (a middle stage)."""
    timer = _LayerTimer(_Nothing().to(device), 1, 3, loss_fn, None, device, precision)
    f, b, w, fused, _ = _measure(timer, torch.ones(1, device=device), split, 5, 0.0, 5)
    return f, b, w, fused


def profile_layers(layers: Sequence[nn.Module], first: int, num_layers: int, x: Any, *,
                   loss_fn: Callable[[Any, Any], torch.Tensor], target: Any, device: torch.device,
                   precision: str = "fp32", split: bool | None = None, repeats: int = 3,
                   min_time: float = 0.1, max_repeats: int = 25, selective: bool = False) -> list[LayerCost]:
    """Measure ``layers`` (model layers ``first``, ``first + 1``, ...) on one microbatch ``x``, the input of
    ``layers[0]``: each layer runs F, B and W as a one-layer stage of the engine (the model's first layer
    as a first stage, its last with ``loss_fn`` on ``target``). Median of at least ``repeats`` runs after
    one warm-up, more until ``min_time`` seconds were timed and the median is stable (at most ``max_repeats``
    runs), so that a short slow spell of a shared machine does not decide; each cost carries its runs' spread
    and its layer's kind (:func:`shared_costs` gives alike layers one cost). ``split``: time the split
    backward (True), the fused one (False) or both (None); ``selective``: also what recompute "selective" keeps
    of each layer and the time it adds (:func:`_selective`).

    The layers are used as given: pass copies (profiling runs them in train mode, so BatchNorm
    statistics move, and leaves gradients behind).
    """
    costs: list[LayerCost] = []
    host = _host_cost(device, loss_fn, precision, split)
    for i, layer in enumerate(layers):
        timer = _LayerTimer(layer, first + i, num_layers, loss_fn, target, device, precision)
        f, b, w, fused, spread = _measure(timer, x, split, repeats, min_time, max_repeats)
        for p in layer.parameters():
            p.grad = None
        out_bytes = sum(t.numel() * t.element_size() for t in flat(timer.out)) if timer.out is not None else 0
        costs.append(LayerCost(f, b, w, fused, activation_bytes=sum(timer.saved.values()) + out_bytes,
                               param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                               noise=spread, kind=layer_kind(layer, x, timer.kind), output_bytes=out_bytes,
                               host=host, held_for_w=timer.held_for_w, freed_at_b=_freed_at_b(timer),
                               grad_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()
                                              if p.requires_grad), direct_w=covers(layer)))
        if selective:
            selective_timer = _LayerTimer(layer, first + i, num_layers, loss_fn, target, device, precision,
                                          recompute="selective")
            costs[-1] = _selective(costs[-1], selective_timer, x, (repeats, min_time, max_repeats))
        x = timer.out
    return costs


def _freed_at_b(timer: _LayerTimer) -> int:
    """Bytes of what the layer's forward saved that a split B frees (all but what W reads), 0 where it keeps the
    graph."""
    return 0 if timer.read_by_w is None else max(0, sum(timer.saved.values()) - timer.read_by_w)


def _selective(cost: LayerCost, timer: _LayerTimer, x: Any, limits: tuple[int, float, int]) -> LayerCost:
    """``cost`` with what recompute "selective" keeps of the layer (``timer``'s, its warm-up run counted) and the
    seconds it adds to F + the fused backward (timed as :func:`_measure` times, ``limits``: its repeats, min_time
    and max_repeats)."""
    try:
        f, _, _, fused, _ = _measure(timer, x, False, *limits)
    except (RuntimeError, ValueError) as exc:   # (e.g. an output it keeps changed in place: recompute.mutated)
        log.warning(f"partition profile: layer {timer.stage.module.first} cannot run recompute 'selective' "
                    f"({str(exc).splitlines()[0]}); a memory budget will not choose it there")
        return cost
    finally:
        for p in timer.stage.params:
            p.grad = None
    return replace(cost, selective_bytes=sum(timer.saved.values()),
                   selective_s=max(0.0, f + fused - (cost.f + cost.fused)))


def profile_shares(specs: Sequence[LayerSpec], seed: int, sample: tuple[Any, Any] | None,
                   loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device, precision: str,
                   split: bool | None, selective: bool = False) -> list[LayerCost]:
    """Every layer's measured costs, on every rank. Rank r profiles a contiguous share of the layers
    (copies, or built from the factories) on its own device: it receives its share's input from rank
    r - 1, passes its share's output on at once (one forward, no grad), then times its share while
    the later ranks do theirs; on CPU with more processes x threads than cores it passes the
    output on only after timing (the shares are timed one after the other). A failure on any
    rank is raised on every rank. The share's layers are freed on return."""
    if sample is None or not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError("partition='profile' needs sample=(inputs, target): one microbatch, on every rank, "
                         "to time the layers on (or choose partition='parameters')")
    n, rank, world = len(specs), dist.get_rank(), dist.get_world_size()
    owners = min(n, world)
    # the chain passes Python objects between CPU processes: a Gloo group of its own, gone afterwards (on
    # NCCL the default group would make a communicator per pair of ranks just for this)
    group = dist.new_group(backend="gloo")
    try:
        result: list[LayerCost] | str = []
        if rank < owners:
            shares = partition(list(range(n)), owners, "uniform")   # type: ignore[arg-type]
            result = _profile_share(specs, shares[rank], shares[rank + 1], seed, sample, loss_fn, device,
                                    precision, split, rank, owners, group, selective)
        everyone = gathered(result if isinstance(result, list) else None, result if isinstance(result, str) else None,
                            group=group)
    finally:
        dist.destroy_process_group(group)
    measured = [c for costs in everyone if costs for c in costs]
    costs, lines = shared_costs(measured)
    if measured and measured[-1].loss_pieces:   # (the last layer's own, whatever kind it shares)
        costs[-1] = replace(costs[-1], loss_pieces=measured[-1].loss_pieces)
    if rank == 0:
        for line in lines:
            log.warning(f"partition profile: {line}")
    return costs


def _profile_share(specs: Sequence[LayerSpec], lo: int, hi: int, seed: int, sample: tuple[Any, Any],
                   loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device, precision: str,
                   split: bool | None, rank: int, owners: int, group: Any,
                   selective: bool) -> list[LayerCost] | str:
    """This rank's share of :func:`profile_shares`: its layers' costs, or the error as text."""
    x: Any = to_device(sample[0], device)
    if rank > 0:
        got: list[Any] = [None]
        dist.recv_object_list(got, src=rank - 1, group=group)
        x = to_device(got[0], device)
    passed = rank + 1 == owners   # the next share's input (or the error) went on
    # more processes than cores: time the shares one after the other (passing the input on after
    # timing), or a share timed while others run would look slower than it is
    one_at_a_time = device.type != "cuda" and dist.get_world_size() * torch.get_num_threads() > (os.cpu_count() or 1)
    try:
        if isinstance(x, str):
            raise ValueError(x)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            layers = [build_layer(copy.deepcopy(specs[i]) if isinstance(specs[i], nn.Module) else specs[i],
                                  i, seed).to(device) for i in range(lo, hi)]
            with torch.no_grad(), torch.autocast(device.type, enabled=precision != "fp32",
                                                 dtype=DTYPES[precision] or torch.float32):
                out = LayerChain(layers, lo)(x)
            if not passed and not one_at_a_time:
                dist.send_object_list([to_device(out, torch.device("cpu"))], dst=rank + 1, group=group)
                passed = True
            target = to_device(sample[1], device)
            result = profile_layers(layers, lo, len(specs), x, loss_fn=loss_fn, target=target,
                                    device=device, precision=precision, split=split, selective=selective)
            if selective and hi == len(specs) and result:   # a budget may cut microbatches: how the loss adds up
                how = loss_pieces(loss_fn, to_float(out), target)
                result[-1] = replace(result[-1], loss_pieces=tuple(sorted(how.items())))
            if not passed:
                dist.send_object_list([to_device(out, torch.device("cpu"))], dst=rank + 1, group=group)
        return result
    except (ValueError, TypeError, RuntimeError) as exc:
        message = f"profiling layers {lo}..{hi - 1} on rank {rank} failed: {exc}"
        if not passed:
            dist.send_object_list([message], dst=rank + 1, group=group)
        return message
