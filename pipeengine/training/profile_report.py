"""``python -m pipeengine.schedule --profile MODEL``: measured layer costs and, for every schedule, the split
the profile partition picks, its simulated step and its memory (one process, before launching)."""

from __future__ import annotations

import sys

import torch

from ..runtime.layers import build_layers
from ..runtime.auto import auto_schedule
from ..runtime.planner import PartitionError, choose_bounds
from ..runtime.profile import profile_layers
from ..runtime.chain import LayerError
from ..schedule import SCHEDULES, Costs, compile_schedule, simulate
from ..schedule.builders import default_chunks
from ..schedule.simulate import in_flight_peaks
from .data import batches
from .models import load_model

__all__ = ["profile_report"]


def profile_report(model: str, preset: str | None, pp: int, microbatches: int, micro_batch_size: int,
                   memory_cap_gib: float | None) -> int:
    """Print the report; 0 done, 1 a layer failed, 2 bad input."""
    if pp < 2:
        print("error: --pp must be >= 2 to compare splits", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    try:
        spec = load_model(model, preset, None)
        if spec.data is None:
            raise ValueError(f"--model {model!r} gives no data (Model.data is None): the profile needs an example")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layers = build_layers(spec.layers, 0)
    x, y = batches(spec.data, "train", 0, 0, 0, 1, 1, micro_batch_size)[0]
    try:
        costs = profile_layers(layers, 0, len(layers), x, loss_fn=spec.loss_fn, target=y, device=torch.device("cpu"))
    except LayerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{model}/{spec.preset or preset}: {len(layers)} layers, microbatch of {micro_batch_size} on cpu, "
          f"{torch.get_num_threads()} threads; ms per microbatch (the last layer includes the loss)")
    print(f"{'layer':>5} {'F':>8} {'B':>8} {'W':>8} {'B+W fused':>10} {'act MiB':>8} {'param MiB':>9}")
    for i, c in enumerate(costs):
        print(f"{i:>5} {1e3 * c.f:8.2f} {1e3 * c.b:8.2f} {1e3 * c.w:8.2f} {1e3 * c.fused:10.2f} "
              f"{c.activation_bytes / 2**20:8.2f} {c.param_bytes / 2**20:9.2f}")
    print(f"\n{'schedule':<28} {'bounds':<28} {'step ms':>8} {'bubble':>7} {'peak in flight':>15} "
          f"{'GiB per position (est.)':>24}")
    cap = memory_cap_gib * 2**30 if memory_cap_gib else None
    for name in [n for n in SCHEDULES if n != "forward"]:
        chunks = default_chunks(name)
        label = name + (f" (chunks {chunks})" if chunks > 1 else "")
        try:
            sched = compile_schedule(name, pp, microbatches, chunks)
            choice = choose_bounds(costs, sched, cap)
        except (ValueError, PartitionError) as exc:
            print(f"{label:<28} {str(exc).splitlines()[0]}")
            continue
        sched = compile_schedule(name, pp, microbatches, chunks, choice.mean_costs())
        result = simulate(sched, [Costs(*c) for c in choice.stage_costs])
        print(f"{label:<28} {str(choice.bounds):<28} {1e3 * result.makespan:8.1f} {result.mean_bubble:7.3f} "
              f"{' '.join(map(str, result.peak_in_flight)):>15} "
              f"{' '.join(f'{m / 2**30:.2f}' for m in choice.memory):>24}")
    try:
        auto = auto_schedule(costs, pp, microbatches, cap)
    except (ValueError, PartitionError) as exc:
        print(f"{'auto':<28} {str(exc).splitlines()[0]}")
        return 0
    peaks = " ".join(map(str, in_flight_peaks(auto.schedule)))
    print(f"{'auto: ' + auto.schedule.name:<28} {str(auto.bounds):<28} {1e3 * auto.makespan:8.1f} "
          f"{simulate(auto.schedule, [Costs(*c) for c in auto.stage_costs]).mean_bubble:7.3f} {peaks:>15} "
          f"{' '.join(f'{m / 2**30:.2f}' for m in auto.memory):>24}")
    print(f"\nauto: lower bound {1e3 * auto.bound:.1f} ms (the busiest position's work or one microbatch's critical "
          f"path), gap {auto.gap:.3f}x; with the fill {1e3 * auto.fill:.1f} ms, gap {auto.fill_gap:.3f}x")
    return 0
