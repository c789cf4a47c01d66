"""The twin in a run (runtime/twin.py): what it is told of this run and this host, and memory measured comparably.

The twin predicts the step and each position's peak before the first step. Measured memory is made
comparable with it: on CPU the peak resident set above the process's baseline, taken when the trainer
starts (after torch is imported, before the model is built), so that torch's own libraries are not
counted; on CUDA the allocator's peak. What the process holds beyond the model (its data, the
communication library, the interpreter's objects) is measured just before the first step: the resident
set then, less the baseline and the model's parameters and gradients already allocated.
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..runtime.device import synchronize
from ..runtime.engine import PipelineEngine
from ..runtime.options import parse_recompute
from ..runtime.tensors import flat
from ..runtime.layers import sizing_layers
from ..runtime.twin import HOST, HOST_CUDA, Twin, predict
from .checks import partition_arg
from .report import write_json

__all__ = ["resident_bytes", "optimizer_states", "optimizer_cost", "run_facts", "run_twin",
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


def optimizer_cost(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device,
                   states: float, numels: Sequence[int]) -> tuple[float, float]:
    """The end of a step over parameter tensors of these sizes (the rank's own), as (seconds a step, bytes per
    second it passes over parameters, gradients and optimizer state): the optimizer's step, the gradients' norms
    and zeroing, timed on as many tensors as the rank has, at a quarter and at half of their elements (at most
    2**22 in all), and fitted as a fixed part (a step over many small tensors is Python per tensor: torch's CPU
    optimizers loop over them) plus bytes over a bandwidth. Half, at most: the probe's parameters, gradients, state
    and temporaries are half of what the run's step allocates beside the parameters it holds anyway, so it never
    sets the process's peak. Each size: median of 5 runs, after one warm-up."""
    numels = [n for n in numels if n > 0] or [1024]
    f = min(0.5, 2**22 / sum(numels))
    timed = []
    for scale in (f / 2, f):
        params = [torch.nn.Parameter(torch.zeros(max(1, round(n * scale)), device=device)) for n in numels]
        grads = []
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
            grads.append(p.grad)
        opt, runs = build(params), []
        for _ in range(6):
            synchronize(device)
            t = time.perf_counter()
            opt.step()
            torch.stack([n.double() for n in torch._foreach_norm(grads)])
            torch._foreach_zero_(grads)
            synchronize(device)
            runs.append(time.perf_counter() - t)
            torch._foreach_add_(grads, 1e-3)
        timed.append(((2 + 2 * states) * 4 * sum(p.numel() for p in params), statistics.median(runs[1:])))
    (b1, t1), (b2, t2) = timed
    per_byte = (t2 - t1) / (b2 - b1) if b2 > b1 and t2 > t1 else t2 / b2   # noise: all of it per byte
    return max(0.0, t2 - per_byte * b2), 1 / max(per_byte, 1e-15)


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
              zero: bool, sample_inputs: Any, numels: Sequence[int]) -> dict[str, Any]:
    """What the twin takes of the run beyond the plan (twin.predict's arguments): data parallelism, the optimizer's
    state per parameter and cost (timed on tensors of sizes ``numels``, the rank's), the input's bytes, the cores,
    the host."""
    probe = torch.nn.Parameter(torch.zeros(1, device=device))
    states = optimizer_states(build([probe]))
    processes, cores = node_cores(device)
    fixed, bandwidth = optimizer_cost(build, device, states, numels)
    return {"dp": dp, "zero": zero, "optimizer_states": states, "processes": processes, "cores": cores,
            "input_bytes": sum(t.numel() * t.element_size() for t in flat(sample_inputs)),
            "host": HOST_CUDA if device.type == "cuda" else HOST, "optimizer_fixed": fixed,
            "optimizer_bandwidth": bandwidth}


def run_twin(engine: PipelineEngine, *, recompute: str, sample_inputs: Any, baseline: float,
             build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], sizes: Any = None) -> Twin | None:
    """The twin of this run (None without a layer profile: a partition other than "profile"); collective over
    the pipeline's ranks (what each holds beyond the model)."""
    plan, device = engine.plan, engine.device
    group = engine.groups.pp_group
    beyond = 0.0 if device.type == "cuda" else max(0.0, resident_bytes(trim=True) - baseline - _model_bytes(engine))
    numels = [p.numel() for p in engine.parameters]
    facts = (run_facts(build, device, engine.topology.dp, engine.zero is not None, sample_inputs, numels)
             if plan.measured else {})
    cost = (facts["optimizer_fixed"], facts["optimizer_bandwidth"]) if facts else None
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (beyond, sum(numels) * 4, cost), group=group)
    if not plan.measured:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
    runtime = {engine.topology.position_of(r): b for r, (b, _, _) in zip(ranks, everyone)}
    # the step waits for the slowest rank's end of step, by its own probe (a small rank's probe fits in caches)
    passes = 2 + 2 * facts["optimizer_states"]
    slowest = max(everyone, key=lambda e: e[2][0] + passes * e[1] / e[2][1])
    facts["optimizer_fixed"], facts["optimizer_bandwidth"] = slowest[2]
    stages = plan.recompute or [recompute] * plan.num_stages
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
        # before the split is known: a rank's share, every pp-th parameter tensor of the model
        numels = [p.numel() for m in sizing_layers(model.layers) for p in m.parameters()][::topo.pp]
        facts = {**run_facts(cfg.optimizer.build, device, topo.dp, cfg.parallel.zero == 1, sample[0], numels),
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
            memory_budget=budget * 2**30 if budget is not None else None, facts=facts)
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
              "bounds": list(plan.bounds), "recompute": stages, **trainer.reporter.predicted()}
    trainer.writer.close()
    if trainer.rank == 0:
        write_json(os.path.join(trainer.run_dir, "summary.json"), result)
        print(f"dry run: planned and predicted, no step taken (the prediction is in {trainer.run_dir}/summary.json)")
    if trainer.owned:
        dist.destroy_process_group()
    return result
