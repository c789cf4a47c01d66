"""The twin in a run (runtime/twin.py): what it is told of this run and this host, and memory measured comparably.

The twin predicts the step and each position's peak before the first step. Measured memory is made
comparable with it: on CPU the peak resident set above the process's baseline, taken when the trainer
starts (after torch is imported, before the model is built), so that torch's own libraries are not
counted; on CUDA the allocator's peak. What the process holds beyond the model (its data, the
communication library, the interpreter's objects) is measured just before the first step: the resident
set then, less the baseline and the model's parameters and gradients already allocated.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..runtime.device import nccl, synchronize
from ..runtime.engine import PipelineEngine
from ..runtime.options import parse_recompute
from ..runtime.tensors import flat
from ..runtime.layers import sizing_layers
from ..runtime.measured import position_sizes
from ..runtime.microbatches import per_piece
from ..runtime.twin import HOST, HOST_CUDA, Twin, predict
from ..runtime.transfer import posts_early
from .checks import partition_arg
from .report import write_json
from .resources import outside_peak, rank_memory

__all__ = ["resident_bytes", "optimizer_states", "optimizer_bandwidth", "run_facts", "run_twin",
           "node_cores", "build_engine", "dry_run"]


def resident_bytes(trim: bool = False) -> float:
    """This process's resident set now (bytes; its peak where /proc is missing); ``trim``: after giving the memory
    freed so far back to the system (glibc's malloc_trim: memory the allocator keeps is not the process's)."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


def optimizer_states(optimizer: torch.optim.Optimizer) -> float:
    """State tensors per parameter: Adam's kind 2, SGD 1 with momentum (else 0), the others counted once stepped
    (2 until then)."""
    name = type(optimizer).__name__
    if name == "SGD":
        return 1.0 if optimizer.defaults.get("momentum") else 0.0
    if name in ("Adagrad", "RMSprop"):
        return 1.0 + bool(optimizer.defaults.get("momentum"))
    return 2.0


def optimizer_bandwidth(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device,
                        states: float, elements: int) -> float:
    """Bytes per second the end of a step passes over (parameters, gradients and optimizer state): the optimizer's
    step, the gradients' norm and zeroing, timed on one parameter of ``elements`` floats (the largest position's, in
    a run: its end of step is the step's), median of the runs after one warm-up.

    [Note: the optimizer's probe]
    The pass's speed depends on how much it passes over: on this 2-core machine fused AdamW with the norm and the
    zeroing costs 1.0 ns an element up to 6 M elements (96 MB with its gradient and state) and 1.55 ns at 23.5 M
    (ResNet-50's), so a probe on a quarter of the rank predicted ResNet-50's end of step at half what it took. On
    CPU it runs on the whole size, outside the run's peak (resources.outside_peak: the resident high-water
    mark starts again after it; its memory is given back first) unless that is more than an eighth of what a rank
    may use. On a GPU (whose passes over HBM do not slow with size beyond its cache), and past that eighth, on a
    quarter of the rank (at most 4 M elements), which stays below the optimizer state the run will hold."""
    whole = device.type == "cpu" and 16 * elements <= rank_memory(device) / 8
    with outside_peak(lambda: resident_bytes(trim=True)) if whole else contextlib.nullcontext(False) as apart:
        n = max(1024, elements if apart else min(elements // 4, 2**22))
        p = torch.nn.Parameter(torch.zeros(n, device=device))
        p.grad = torch.full_like(p, 1e-3)
        opt = build([p])
        times = []
        for _ in range(6 if n <= 2**24 else 3):
            synchronize(device)
            t = time.perf_counter()
            opt.step()
            torch.linalg.vector_norm(p.grad)
            p.grad.zero_()
            synchronize(device)
            times.append(time.perf_counter() - t)
            p.grad.fill_(1e-3)
        del p, opt
    return (2 + 2 * states) * 4 * n / max(statistics.median(times[1:]), 1e-9)


def node_cores(device: torch.device) -> tuple[int, float]:
    """(processes x threads on this node, cores it has): CPU ranks share the cores; a GPU rank has its own."""
    if device.type != "cpu":
        return 1, 1.0
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return procs * torch.get_num_threads(), float(cores)


def _model_bytes(engine: PipelineEngine) -> float:
    """Bytes of this rank's parameters and of the gradients allocated so far."""
    return float(sum(p.numel() * p.element_size() * (1 + (p.grad is not None)) for p in engine.parameters))


def run_facts(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device, dp: int,
              zero: bool, sample_inputs: Any, elements: int, early_receives: bool, clip: bool) -> dict[str, Any]:
    """What the twin takes of the run beyond the plan (twin.predict's arguments): data parallelism, the optimizer's
    state per parameter and speed (timed on ``elements`` floats), the input's bytes, the cores, the host, whether the
    wire posts receives early (transfer.posts_early), whether the gradients are clipped."""
    probe = torch.nn.Parameter(torch.zeros(1, device=device))
    states = optimizer_states(build([probe]))
    processes, cores = node_cores(device)
    return {"dp": dp, "zero": zero, "optimizer_states": states, "processes": processes, "cores": cores,
            "input_bytes": sum(t.numel() * t.element_size() for t in flat(sample_inputs)),
            "host": HOST_CUDA if device.type == "cuda" else HOST,
            "early_receives": early_receives, "clip": clip,
            "optimizer_bandwidth": optimizer_bandwidth(build, device, states, elements)}


def run_twin(engine: PipelineEngine, *, recompute: str, sample_inputs: Any, baseline: float,
             build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], sizes: Any = None) -> Twin | None:
    """The twin of this run (None without a layer profile: a partition other than "profile"); collective over
    the pipeline's ranks (what each holds beyond the model)."""
    plan, device = engine.plan, engine.device
    group = engine.groups.pp_group
    beyond = 0.0 if device.type == "cuda" else max(0.0, resident_bytes(trim=True) - baseline - _model_bytes(engine))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, beyond, group=group)
    if not plan.measured:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
    runtime = {engine.topology.position_of(r): b for r, b in zip(ranks, everyone)}
    # the optimizer timed on the largest position's fp32 parameters ([Note: the optimizer's probe]): on its own size,
    # position 0 of ResNet-18 at pp 2 (2.8 M of 11.2 M) predicted the end of step at 13.8 ms where it took 17.5
    largest = int(max(params for params, _ in position_sizes(plan.measured, plan.bounds, plan.schedule)) // 4)
    facts = run_facts(build, device, engine.topology.dp, engine.zero is not None, sample_inputs,
                      largest or sum(p.numel() for p in engine.parameters), engine.wire.early,
                      engine.grad_clip is not None)
    stages = plan.recompute or [recompute] * plan.num_stages
    facts, sizes = per_piece(facts, sizes, plan.pieces)   # profiled on a piece ([Note: microbatch pieces])
    return predict(list(plan.measured), plan.bounds, plan.schedule, links=plan.links, sizes=sizes,
                   recompute=[parse_recompute(r) for r in stages],
                   runtime=[runtime[p] for p in range(plan.schedule.pp)], **facts)


def build_engine(cfg: Any, model: Any, topo: Any, feed: Any, device: torch.device, point: Any,
                 baseline: float) -> PipelineEngine:
    """The trainer's engine (``point``: the checkpoint it resumes from, or None); with ``--memory-budget`` the model
    gets what the process does not hold already (measured now, before the model is built)."""
    partition, costs = partition_arg(cfg.schedule.partition), None
    if (point is not None and cfg.schedule.partition == "profile" and point.bounds is not None
            and cfg.schedule.name != "auto" and cfg.schedule.memory_budget is None):
        # the checkpoint's measured bounds and schedule costs: the resumed run computes as the first did
        partition, costs = point.bounds, point.costs
    sample, sizes = (feed.sample(), feed.sizes()) if partition == "profile" else (None, None)
    cap, budget, facts = cfg.schedule.memory_cap, cfg.schedule.memory_budget, None
    if budget is not None and sample is not None:   # (a budget needs the profile: config.py)
        elements = sum(p.numel() for m in sizing_layers(model.layers) for p in m.parameters()) // topo.pp
        facts = {**run_facts(cfg.optimizer.build, device, topo.dp, cfg.parallel.zero == 1, sample[0], elements,
                             posts_early(cfg.parallel.wire, nccl()), cfg.optimizer.grad_clip is not None),
                 "runtime": lambda: (max(0.0, resident_bytes(trim=True) - baseline) if device.type != "cuda" else 0.0)}
    try:
        return PipelineEngine(
            model.layers, model.loss_fn, cfg.optimizer.build, topology=topo, schedule=cfg.schedule.name,
            microbatches=cfg.batch.counts(topo.dp), chunks=cfg.schedule.chunks, seed=cfg.model.seed,
            tied=[list(g) for g in model.tied], device=device, timeout=cfg.faults.timeout,
            grad_clip=cfg.optimizer.grad_clip, recompute=cfg.recompute.policy, precision=cfg.precision.mode,
            on_nonfinite=cfg.faults.on_nonfinite, partition=partition, sample=sample, wire=cfg.parallel.wire,
            boundary_dtype=cfg.precision.boundary, costs=costs, memory_cap=cap * 2**30 if cap else None,
            shard_optimizer=cfg.parallel.zero == 1, link_gbps=cfg.schedule.link_gbps, microbatch_sizes=sizes,
            memory_budget=budget * 2**30 if budget is not None else None, facts=facts,
            cut_microbatches=not cfg.schedule.whole_microbatches, static_shapes=cfg.parallel.static_shapes)
    except ValueError as exc:
        if budget is None or not str(exc).startswith("no plan fits the memory budget"):
            raise
        raise ValueError(f"--memory-budget {budget:g} GiB: {exc}") from None


def dry_run(trainer: Any) -> dict[str, Any]:
    """``--dry-run``: the trainer set up, profiled and planned (its log shows the plan and the twin); the prediction
    as the result and in summary.json, and no step taken."""
    plan, cfg = trainer.engine.plan, trainer.cfg
    stages = list(plan.recompute or [cfg.recompute.policy] * plan.num_stages)
    result = {"dry_run": True, "pp": trainer.topo.pp, "dp": trainer.topo.dp, "schedule_run": plan.schedule.name,
              "bounds": list(plan.bounds), "recompute": stages, "pieces_per_microbatch": plan.pieces,
              **trainer.reporter.predicted()}
    trainer.writer.close()
    if trainer.rank == 0:
        write_json(os.path.join(trainer.run_dir, "summary.json"), result)
        print(f"dry run: planned and predicted, no step taken (the prediction is in {trainer.run_dir}/summary.json)")
    if trainer.owned:
        dist.destroy_process_group()
    return result
