"""The dry run's output: the projection as text (labelled, never mistaken for a measurement) and as JSON."""

from __future__ import annotations

from typing import Any

from ..runtime.twin import BACKWARD_SET, PARTS
from .hardware import GIB, World
from .projection import Candidate, Projection, Settings, plural

__all__ = ["describe", "as_json", "ASSUMPTIONS", "RUNNER_UPS"]

RUNNER_UPS = 4       # the runner-ups shown (of the candidates simulated)
ASSUMPTIONS = ("every layer's kernels at --mfu of the GPU's dense bf16 peak (FLOPs counted on the meta device); bf16 "
               "autocast with fp32 parameters, gradients and AdamW state; the tied embedding and head weight held "
               "twice, one copy per end, also on one rank, as the engine holds it (runtime/ties.py); no tensor or "
               "sequence parallelism; the split by layer FLOPs, not the planner's measured search; backward's "
               f"working set {BACKWARD_SET:g}x the largest layer's kept activations, a factor fitted on CPU "
               "(runtime/twin.py BACKWARD_SET), not on a GPU; ranks placed position-major as the engine places "
               "them (rank = position x dp + replica, --gpus-per-node consecutive ranks a node); transfers at the "
               "links' bandwidth with no latency; the gradient all-reduce (ring) after the backward, not overlapped; "
               "the CUDA context, NCCL's buffers and fragmentation left to the reserve")


def _schedule(c: Candidate) -> str:
    if c.pp == 1:
        return "none (one position: gradient accumulation)"
    return c.schedule + (f" ({c.chunks} stages per position)" if c.chunks > 1 else "")


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{1e3 * x:.1f} ms"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _memory_lines(c: Candidate, usable: float, world: World) -> list[str]:
    full = c.fullest
    where = c.memory.index(full)
    parts = ", ".join(f"{k} {_gib(getattr(full, k))}" for k in PARTS)
    lines = [f"  memory per rank   {_gib(full.total)} GiB at its fullest (position {where}) of {_gib(usable)} GiB "
             f"usable ({world.gpu.memory_gib:g} GiB less the reserve)",
             f"                    {parts} GiB (buffers: as runtime/twin.py counts them, plus the bf16 weight copies)"]
    if c.pp > 1:
        totals = [m.total for m in c.memory]
        lines.append(f"                    positions from {_gib(min(totals))} to {_gib(max(totals))} GiB")
    return lines


def _runner_ups(p: Projection, count: int) -> list[str]:
    rows = p.ranked[1:count + 1]
    if not rows:
        return []
    lines = ["", "  runner-ups        pp x dp    schedule           recompute   m      batch   step s  bubble  "
                 "tokens/s     peak GiB"]
    for c in rows:
        lines.append(f"                    {f'{c.pp} x {c.dp}':<10} {c.schedule if c.pp > 1 else 'none':<18} "
                     f"{c.recompute_text:<11} {c.microbatches:<6} {c.global_batch:<7} {c.step_s:<7.3f} "
                     f"{100 * c.bubble:5.1f}%  {c.tokens_per_s:<12,.0f} {_gib(c.peak)}")
    return lines


def describe(p: Projection, model: str, world: World, settings: Settings, runner_ups: int = RUNNER_UPS) -> str:
    """The projection as the command line prints it."""
    c, gpu = p.best, world.gpu
    tokens = c.global_batch * settings.context
    parts = ", ".join(f"{k} {_seconds(v)}" for k, v in sorted(c.parts.items(), key=lambda kv: -kv[1]) if v)
    lines = [
        "projection (not measured): what the twin predicts for this run; measure before you trust it",
        f"  model             {model}, {_count(p.parameters)} parameters",
        f"  world             {world.size} x {gpu.describe()} ({world.nodes} node{'s' * (world.nodes > 1)} x "
        f"{world.gpus_per_node})",
        f"  batch             {c.global_batch:,} sequences of {settings.context:,} tokens a step "
        f"({tokens:,} tokens), micro batch {settings.micro_batch}; kernels at {100 * settings.mfu:g}% of peak (--mfu)"
        + (", ZeRO-1" if settings.zero else ""),
        "",
        f"  chosen            pp {c.pp} x dp {c.dp}, schedule {_schedule(c)}, recompute {c.recompute_text}",
        f"  microbatches      {c.microbatches} per replica a step, of {settings.micro_batch} sequence"
        f"{'s' * (settings.micro_batch > 1)} each",
        f"  predicted step    {_seconds(c.step_s)} ({parts})",
        f"  bubble            {100 * c.bubble:.1f}% (1 - busy / makespan of the simulated schedule, mean over "
        f"positions: fill, drain and stages of unequal work)",
        f"  tokens/s          {c.tokens_per_s:,.0f} ({c.tokens_per_s / world.size:,.0f} per GPU)",
        f"  model TFLOP/s     {c.tflops_per_gpu:.0f} per GPU, MFU {100 * c.mfu:.1f}% (recompute not counted)",
        *_memory_lines(c, p.usable_bytes, world),
        *_runner_ups(p, runner_ups),
        "",
        f"  searched          {plural(p.scored, 'simulation')} in {p.seconds:.1f} s; "
        f"{plural(len(p.ranked), 'candidate')} {'fits' if len(p.ranked) == 1 else 'fit'}",
        *(f"  note              {n}" for n in p.notes),
        f"  assumes           {ASSUMPTIONS}",
    ]
    return "\n".join(lines)


def _candidate(c: Candidate) -> dict[str, Any]:
    return {"pp": c.pp, "dp": c.dp, "schedule": c.schedule if c.pp > 1 else "none", "chunks": c.chunks,
            "recompute": c.recompute_text, "microbatches": c.microbatches, "global_batch": c.global_batch,
            "step_s": c.step_s,
            "step_parts_s": dict(c.parts), "bubble": c.bubble, "tokens_per_s": c.tokens_per_s,
            "tflops_per_gpu": c.tflops_per_gpu, "mfu": c.mfu, "peak_memory_gib": c.peak / GIB,
            "memory_gib": [{k: getattr(m, k) / GIB for k in PARTS} | {"total": m.total / GIB} for m in c.memory],
            "bounds": c.bounds, "simulated_microbatches": list(c.simulated)}


def as_json(p: Projection, model: str, world: World, settings: Settings,
            runner_ups: int = RUNNER_UPS) -> dict[str, Any]:
    """What ``--json`` writes: the same as the text, every position's memory included."""
    gpu = world.gpu
    return {"projection": "not measured", "model": model, "parameters": p.parameters,
            "world": {"nodes": world.nodes, "gpus_per_node": world.gpus_per_node, "gpus": world.size},
            "gpu": {"name": gpu.name, "tflops_bf16": gpu.tflops, "memory_gib": gpu.memory_gib,
                    "memory_gbs": gpu.memory_gbs, "intra_node_gbs": gpu.intra_gbs, "inter_node_gbs": gpu.inter_gbs},
            "settings": {"global_batch": p.best.global_batch, "global_batch_aimed": settings.global_batch,
                         "global_batch_rounded": settings.round_batch, "micro_batch": settings.micro_batch,
                         "context": settings.context, "mfu": settings.mfu, "reserve": settings.reserve,
                         "zero": int(settings.zero), "usable_memory_gib": p.usable_bytes / GIB},
            "chosen": _candidate(p.best), "runner_ups": [_candidate(c) for c in p.ranked[1:runner_ups + 1]],
            "candidates_fitting": len(p.ranked), "simulations": p.scored, "seconds": p.seconds, "notes": p.notes,
            "assumes": ASSUMPTIONS}
