"""The plan: what every rank agrees on before the first step, as one frozen object the engine interprets.

:func:`make_plan` is collective over the default group. It checks that every rank was given the
same model (and the same ``agree`` settings), takes the schedule (compiled by name or given),
finds the stage bounds (by parameters, by layer count, explicit, or by measuring every layer and
simulating candidate splits: ``partition="profile"``), and, when it measured, lowers the schedule
with the measured costs. Rank 0 decides the bounds; a failure on any rank is raised on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Costs, Schedule, compile_schedule, simulate, validate
from .agree import decided_by_rank0, gathered, settings_mismatch
from .layers import LayerSpec, fingerprint, model_mismatch, sizing_layers
from . import planner
from .auto import AutoChoice, auto_schedule
from .budget import SHAPES, BudgetChoice, fit_budget
from .links import Links
from .measured import Choice, LayerCost, sized
from .microbatches import per_piece, pieces_of, rows
from .profile import profile_shares

__all__ = ["Plan", "make_plan", "replica_counts"]


@dataclass(frozen=True)
class Plan:
    """Everything about a run's pipeline that does not change while it trains.

    ``schedule`` is the validated training program of every position, ``eval_schedule`` the
    forward-only one; ``bounds[s]..bounds[s+1]-1`` are stage s's layers; ``costs`` are the per-stage
    costs the schedule was lowered with (None: unit costs); ``choice`` is what the profile partition
    measured and predicted (None for the other methods).
    """

    schedule: Schedule
    eval_schedule: Schedule
    bounds: tuple[int, ...]
    num_layers: int
    costs: Costs | None = None
    choice: Choice | None = field(default=None, compare=False)
    param_counts: tuple[int, ...] = ()   # parameter tensors per layer (the norm's fixed order, numerics.py)
    auto: AutoChoice | None = field(default=None, compare=False)   # what schedule "auto" chose, and from what
    # [Note: uneven replicas] microbatches per replica when they differ (() : every replica runs ``schedule``), and
    # the (training, evaluation) schedules of the other counts: the same kind, placement, chunks and split
    counts: tuple[int, ...] = ()
    others: Mapping[int, tuple[Schedule, Schedule]] = field(default_factory=dict, compare=False)
    links: Links | None = field(default=None, compare=False)   # what the planner took a transfer to cost
    measured: tuple[LayerCost, ...] = field(default=(), compare=False)   # each layer's profile (partition "profile")
    recompute: tuple[str, ...] = ()   # per stage, when a memory budget chose it (() : the engine's one for all)
    budget: BudgetChoice | None = field(default=None, compare=False)   # what the memory budget chose, and why
    pieces: int = 1   # each microbatch the user gives runs as this many ([Note: microbatch pieces], microbatches.py)
    piece_losses: str = "mean"   # how the loss adds up over the pieces: "mean" or "sum"

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    def layers_of(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def param_slot(self, layer: int) -> int:
        """Index of layer ``layer``'s first parameter in the model's parameter order (see numerics.py)."""
        return sum(self.param_counts[:layer])

    def stage_of_layer(self, layer: int) -> int:
        return next(s for s in range(self.num_stages) if self.bounds[s] <= layer < self.bounds[s + 1])

    def position_of_layer(self, layer: int) -> int:
        return self.schedule.placement(self.stage_of_layer(layer))[0]

    def schedules_of(self, replica: int) -> tuple[Schedule, Schedule]:
        """Replica ``replica``'s training and evaluation schedules (its own microbatch count)."""
        if not self.counts or self.counts[replica] == self.schedule.microbatches:
            return self.schedule, self.eval_schedule
        return self.others[self.counts[replica]]

    def stages_at(self, position: int) -> list[int]:
        """The stages ``position`` runs, by chunk."""
        return [self.schedule.stage(position, c) for c in range(self.schedule.chunks)]


def make_plan(layers: Sequence[LayerSpec], pp: int, *, schedule: str | Schedule = "1f1b",
              microbatches: int | Sequence[int] = 4, chunks: int | None = None,
              partition: str | Sequence[int] = "parameters", costs: Costs | None = None,
              sample: tuple[Any, Any] | None = None, memory_cap: float | None = None, seed: int = 0,
              precision: str = "fp32", loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
              device: torch.device | None = None, validate_schedule: bool = True,
              agree: Mapping[str, Any] | None = None, links: Links | Callable[[], Links] | None = None,
              sizes: Sequence[float] | None = None, memory_budget: float | None = None,
              facts: Mapping[str, Any] | None = None, selective: bool = False, cut: bool = True) -> Plan:
    """The plan every rank uses (collective; see the module docstring).

    Args:
        layers: the model's layer list (modules or factories, see layers.py); ``pp``: positions.
        schedule: a name (see ``SCHEDULES``), "auto" (the schedule and the split chosen together from the measured
            costs, auto.py; needs ``partition="profile"``), or a compiled :class:`Schedule` (proven first unless
            ``validate_schedule`` is False: only to test faults).
        microbatches: per step and replica, or one per replica ([Note: uneven replicas]: planned for the largest, the
            others get the same kind of schedule and split); ``chunks``: stages per position (None: the schedule's).
        partition: "profile" (measure every layer's F, B and W on ``sample``, in parallel over the ranks, and take
            the bounds whose simulated step is shortest), "parameters", "uniform", or bounds ``[0, ..., len(layers)]``.
        costs: per-stage costs to lower the schedule with (default: unit costs, or the measured ones); ``sample``:
            one microbatch ``(inputs, target)`` for ``partition="profile"`` (every rank passes it).
        memory_cap: bytes per position the profile partition may plan for (None: no limit); ``seed, precision,
            loss_fn, device``: as the engine builds and runs the layers (for profiling).
        agree: more settings that must be equal on every rank (compared with the model, in one collective).
        links: with ``partition="profile"``, what a neighbour transfer costs (links.py: stated, or a collective that
            measures them, called once the ranks agree); the split, auto and the predicted step count it. None: free.
        sizes: each microbatch's size relative to ``sample`` (their own lengths), for the split, auto, the step.
        memory_budget, facts: bytes per rank, and what the twin takes of the run beyond the plan (:func:`_budget_plan`;
            ``cut``: it may run microbatches as pieces); ``selective``: the profile measures recompute "selective"."""
    auto = schedule == "auto" and pp > 1
    counts = _counts(microbatches, schedule)
    microbatches, uneven = max(counts), len(set(counts)) > 1
    compiled = _compiled(schedule, pp, microbatches, chunks, costs, validate_schedule, partition, uneven)
    sizing = sizing_layers(layers)
    params = tuple(len(list(m.parameters())) for m in sizing)   # parameter tensors per layer
    _check_same_everywhere(seed, sizing, dict(agree or {}))
    measured, linked = _measured(layers, pp, partition, seed, sample, loss_fn, device, precision, compiled, links,
                                 selective or memory_budget is not None)
    if memory_budget is not None:
        return _budget_plan(len(layers), params, measured, schedule, pp, counts, memory_budget, linked, sizes, facts,
                            lambda k: _measured(layers, pp, partition, seed, pieces_of(sample, k)[0], loss_fn,
                                                device, precision, compiled, None, True)[0],
                            _cuttable(measured, sizing, sample, cut))
    decided = decided_by_rank0(
        lambda: _decide(measured, sizing, compiled, partition, auto, memory_cap, linked, sizes))
    choice = decided if isinstance(decided, Choice) else None
    chosen = decided if isinstance(decided, AutoChoice) else None
    bounds = tuple(decided if isinstance(decided, list) else decided.bounds)
    if chosen is not None:   # lowered with the measured per-stage costs already
        compiled = chosen.schedule
    elif choice is not None and isinstance(schedule, str) and costs is None:
        costs, compiled, choice = _relowered(choice, schedule, pp, microbatches, chunks, uneven, sizes)
    kind = chosen.library if chosen is not None else compiled.name   # what the other counts run
    schedules = {c: (compiled if c == microbatches else _by_count(kind, pp, c, compiled.chunks, costs, True),
                     compile_schedule("forward", pp, c, compiled.chunks, placement=compiled.placement_kind))
                 for c in set(counts)}
    return Plan(compiled, schedules[microbatches][1], bounds, len(layers), costs, choice, params, chosen,
                tuple(counts) if uneven else (), {c: s for c, s in schedules.items() if c != microbatches}, linked,
                tuple(measured))


def _measured(layers: Sequence[LayerSpec], pp: int, partition: str | Sequence[int], seed: int,
              sample: tuple[Any, Any] | None, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
              device: torch.device | None, precision: str, compiled: Schedule,
              links: Links | Callable[[], Links] | None, selective: bool) -> tuple[list[LayerCost], Links | None]:
    """With the profile partition: every layer's measured costs (at pp 1 too: the twin predicts the run from them,
    twin.py; ``selective``: with what recompute "selective" keeps and costs) and the links (measured first, when
    there are any); else nothing."""
    if partition != "profile":
        return [], None
    if loss_fn is None:
        raise ValueError("partition='profile' times the loss too: pass loss_fn")
    linked = (links() if callable(links) else links) if pp > 1 else None
    return profile_shares(layers, seed, sample, loss_fn, device or torch.device("cpu"), precision,
                          compiled.split_backward, selective), linked


def _budget_plan(num_layers: int, params: tuple[int, ...], measured: Sequence[LayerCost], schedule: str | Schedule,
                 pp: int, counts: Sequence[int], budget: float, links: Links | None, sizes: Sequence[float] | None,
                 facts: Mapping[str, Any] | None, profile_pieces: Callable[[int], list[LayerCost]],
                 cuttable: Mapping[int, str]) -> Plan:
    """The plan a memory budget of ``budget`` bytes per rank chose (the twin's parts, twin.py): the schedule's shape
    (with "auto"; else the one named), recompute per stage and the split, together ([Note: memory budget],
    budget.py; needs the profile), decided by rank 0; where the best plan so far needs recompute or nothing fits,
    also with each microbatch run as 2, then 4 pieces (of ``cuttable``: [Note: microbatch pieces]), each profiled
    on a piece of the sample, the fastest plan of all kept. ``facts``: what the twin takes of the run beyond the plan
    (dp, optimizer_states, zero, input_bytes, host...); ``runtime`` may be a function every rank calls now, after
    the profile: what its process holds beyond the model (the fullest one's is counted)."""
    if not measured:
        raise ValueError("a memory budget plans from measured layer costs: use partition='profile'")
    if len(set(counts)) > 1:
        raise ValueError(f"a memory budget plans one microbatch count for every replica (got {sorted(set(counts))}): "
                         f"make the global batch a multiple of dp x the microbatch size, or give no budget")
    kinds = SHAPES if schedule == "auto" else (schedule.name if isinstance(schedule, Schedule) else schedule,)
    given = dict(facts or {})
    if callable(given.get("runtime")):   # what each process holds beyond the model now: the fullest one's
        given["runtime"] = max(gathered(given["runtime"](), None))

    def attempt(costs: Sequence[LayerCost], k: int) -> tuple[BudgetChoice | str, int | None]:
        """Rank 0: the best plan with microbatches in ``k`` pieces (or why none fits), and the next ``k`` to try."""
        piece, each = per_piece(given, sizes, k)
        try:
            found: BudgetChoice | str = fit_budget(costs, pp, counts[0] * k, budget, schedules=kinds, links=links,
                                                   sizes=each, pieces=k, **piece)
        except planner.PartitionError as exc:
            found = str(exc)
        wanted = isinstance(found, str) or any(r != "none" for r in found.recompute)
        return found, next((p for p in sorted(cuttable) if p > k), None) if wanted else None

    found: list[BudgetChoice | str] = []
    costs, k = list(measured), 1
    while True:
        result, after = decided_by_rank0(lambda: attempt(costs, k))
        found.append(result)
        if after is None:
            break
        costs, k = profile_pieces(after), after
    fits = [c for c in found if isinstance(c, BudgetChoice)]
    if not fits:
        raise ValueError(str(found[-1]))   # (the most pieces: the least memory)
    chosen = min(fits, key=lambda c: c.twin.step_s)
    chosen.tried, chosen.piece_losses = [t for c in fits for t in c.tried], cuttable.get(chosen.pieces, "")
    sched = chosen.schedule
    evaluation = compile_schedule("forward", pp, sched.microbatches, sched.chunks, placement=sched.placement_kind)
    return Plan(sched, evaluation, tuple(chosen.bounds), num_layers, None, None,
                params, links=links, measured=tuple(chosen.costs), recompute=tuple(chosen.recompute), budget=chosen,
                pieces=chosen.pieces, piece_losses=chosen.piece_losses or "mean")


def _cuttable(measured: Sequence[LayerCost], sizing: Sequence[nn.Module], sample: Any, cut: bool) -> dict[int, str]:
    """Into how many equal pieces a memory budget may cut each microbatch, and how the loss adds up over them
    ([Note: microbatch pieces]): what the profile found on the sample's output, where the sample's rows divide too,
    unless a layer normalises over the batch (batch norm: its statistics would change), or not ``cut``."""
    n = rows(sample)
    if not cut or not measured or not n or any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                               for layer in sizing for m in layer.modules()):
        return {}
    return {k: how for k, how in measured[-1].loss_pieces if n % k == 0}


def _relowered(choice: Choice, schedule: str, pp: int, microbatches: int, chunks: int | None,
               uneven: bool, sizes: Sequence[float] | None = None) -> tuple[Costs, Schedule, Choice]:
    """The schedule lowered with the measured costs (the communication order, zb-h1's variant), and the choice with
    the predicted step of that program (the planner simulated the one lowered with unit costs), its microbatches of
    ``sizes`` when there is one per microbatch."""
    costs = choice.mean_costs()
    compiled = _by_count(schedule, pp, microbatches, chunks, costs, uneven)
    sizes = sized(sizes, microbatches)
    return costs, compiled, replace(choice, makespan=simulate(compiled, choice.costs(), sizes=sizes).makespan)


def _decide(measured: Sequence[Any], sizing: Sequence[Any], compiled: Schedule, partition: str | Sequence[int],
            auto: bool, memory_cap: float | None, links: Links | None, sizes: Sequence[float] | None
            ) -> list[int] | Choice | AutoChoice:
    """Rank 0's choice of the bounds (and, for auto, of the schedule), for microbatches of ``sizes``."""
    if measured and auto:
        return auto_schedule(measured, compiled.pp, compiled.microbatches, memory_cap, links, sizes=sizes)
    if measured:
        return planner.choose_bounds(measured, compiled, memory_cap, links=links, sizes=sizes)
    if partition == "profile":
        return [0, len(sizing)]
    if isinstance(partition, str):
        return planner.partition(sizing, compiled.num_stages, partition)
    return planner.partition(sizing, compiled.num_stages, boundaries=list(partition))


def _by_count(kind: str, pp: int, microbatches: int, chunks: int | None, costs: Costs | None,
              uneven: bool) -> Schedule:
    """Schedule ``kind`` for ``microbatches``; with uneven replicas ([Note: uneven replicas]) interleaved-1f1b,
    which needs a multiple of pp, gives way to interleaved-zb for a count that is not (same placement, stages)."""
    try:
        return compile_schedule(kind, pp, microbatches, chunks, costs)
    except ValueError:
        if kind != "interleaved-1f1b" or not uneven:
            raise
        return compile_schedule("interleaved-zb", pp, microbatches, chunks, costs)


def _counts(microbatches: int | Sequence[int], schedule: str | Schedule) -> list[int]:
    """The microbatch count of every replica (one, for all, if ``microbatches`` is a number)."""
    counts = [microbatches] if isinstance(microbatches, int) else list(microbatches)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"microbatches must be a whole number >= 1, or one per replica (got {microbatches!r})")
    if isinstance(schedule, Schedule) and set(counts) != {schedule.microbatches}:
        raise ValueError(f"the compiled schedule given runs {schedule.microbatches} microbatches, but the replicas "
                         f"take {sorted(set(counts))}: give a schedule name, or the same count to every replica")
    return counts


def _compiled(schedule: str | Schedule, pp: int, microbatches: int, chunks: int | None, costs: Costs | None,
              validate_schedule: bool, partition: str | Sequence[int], uneven: bool) -> Schedule:
    """The schedule by name, or the one given (proven); for auto a stand-in until the costs are measured (zb-h1:
    backward split, so W is timed; 1f1b at pp 1)."""
    if schedule == "auto" and pp > 1 and partition != "profile":
        raise ValueError(f"schedule 'auto' chooses the schedule and the split together from measured layer costs: "
                         f"use partition='profile' (got {partition!r}), or name a schedule")
    if isinstance(schedule, Schedule):
        if schedule.pp != pp:
            raise ValueError(f"schedule is for pp={schedule.pp} but the topology has pp={pp}")
        if validate_schedule:
            validate(schedule)
        return schedule
    if schedule == "auto":
        return compile_schedule("zb-h1" if pp > 1 else "1f1b", pp, microbatches)
    return _by_count(schedule, pp, microbatches, chunks, costs, uneven)


def _check_same_everywhere(seed: int, sizing: Sequence[Any], agree: dict[str, Any]) -> None:
    """One all-gather: every rank's layer fingerprints, seed and ``agree`` settings; a difference raises
    on every rank, naming what differs and where."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ((seed, [fingerprint(m) for m in sizing]), agree))
    mismatch = settings_mismatch([settings for _, settings in everyone]) or model_mismatch([m for m, _ in everyone])
    if mismatch:
        raise ValueError(mismatch)


def replica_counts(microbatches: int | Sequence[int], dp: int) -> list[int]:
    """Every replica's microbatch count: ``microbatches`` for each, or the list given (one per replica)."""
    if isinstance(microbatches, int) and not isinstance(microbatches, bool):
        return [microbatches] * dp
    counts = list(microbatches) if isinstance(microbatches, Sequence) else []
    if len(counts) != dp:
        raise ValueError(f"microbatches must be a number, or a count per replica ({dp} of them); got {microbatches!r}")
    return counts
