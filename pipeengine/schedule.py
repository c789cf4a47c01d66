"""Pipeline schedules as verified data: builders, compile (lower + validate), closed forms, CLI.

Stdlib only (no torch): schedules are built, checked and simulated before any process starts.
Run ``python -m pipeengine.schedule --help`` for the timeline tool.

A schedule is, per rank, an ordered list of steps; a step is one compute action (``F3``,
``B3``, ``W3``, with ``.c`` for chunk c) or a batch of comm actions (``sendF3>1+recvB1<1``).
Builders return compute-only schedules; :func:`lower` adds paired communication;
:func:`validate` proves the result complete, paired and deadlock-free; the engine executes
exactly that list, so the picture the CLI prints is the program the ranks run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .actions import (Action, Kind, Schedule, ScheduleError, Step, format_schedule,
                      parse_schedule, steps_of)
from .simulate import Costs, DeadlockError, SimResult, lower, render_timeline, simulate, validate

__all__ = [
    "Action", "Kind", "Schedule", "ScheduleError", "DeadlockError", "Step", "Costs", "SimResult",
    "SCHEDULES", "build_schedule", "compile_schedule", "theoretical_bubble",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "forward_only",
    "lower", "validate", "simulate", "render_timeline", "parse_schedule", "format_schedule",
    "summary", "main",
]

Program = list[Action]


def _F(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.F, mb, chunk)


def _B(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.B, mb, chunk)


def _W(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.W, mb, chunk)


def gpipe(pp: int, microbatches: int) -> list[Program]:
    """All forwards, then all backwards: holds every microbatch's activations (m) at once."""
    return [[_F(k) for k in range(microbatches)] + [_B(k) for k in range(microbatches)] for _ in range(pp)]


def forward_only(pp: int, microbatches: int, chunks: int = 1) -> list[Program]:
    """Forwards only (evaluation): every chunk of every microbatch, in microbatch order."""
    return [[_F(k, c) for k in range(microbatches) for c in range(chunks)] for _ in range(pp)]


def one_f_one_b(pp: int, microbatches: int) -> list[Program]:
    """PipeDream-flush 1F1B: rank r warms up with min(pp-r-1, m) forwards, then alternates F and B.

    Rank r therefore never holds more than min(pp-r, m) microbatches' activations, against m for GPipe.
    """
    progs = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        prog = [_F(k) for k in range(warm)]
        for k in range(microbatches - warm):
            prog += [_F(warm + k), _B(k)]
        prog += [_B(k) for k in range(microbatches - warm, microbatches)]
        progs.append(prog)
    return progs


def zb_h1(pp: int, microbatches: int, lag_w: bool = True) -> list[Program]:
    """Zero-bubble H1: 1F1B with backward split into B (input grad) and W (weight grad).

    Only B is on the critical path back through the pipeline, so gradients reach earlier stages
    sooner; each W is deferred to fill time that 1F1B leaves idle in the cooldown. Two orderings:

    - ``lag_w=True`` (the paper's H1): rank r lets its W's lag its B's by r microbatches, so its
      in-flight activations peak at min(pp-r-1, m) + 1 + r <= pp, 1F1B's peak on rank 0. With
      uniform costs (f = b = w) the makespan is m(f+b+w) + (p-1)(f+b-w).
    - ``lag_w=False``: W right after B in the steady phase, cooldown alternates B and W. Peak
      per rank equals 1F1B's; strictly faster than 1F1B for every cost with w > 0, but it
      saves less than H1 when costs are near uniform.

    :func:`compile_schedule` simulates both under the given costs and keeps the faster.
    """
    progs = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        lag = r if lag_w else 0
        prog = [_F(k) for k in range(warm)]
        next_w = 0
        for k in range(microbatches - warm):
            prog += [_F(warm + k), _B(k)]
            if k - lag >= 0:
                prog.append(_W(next_w))
                next_w += 1
        for k in range(microbatches - warm, microbatches):
            prog.append(_B(k))
            if next_w <= k:
                prog.append(_W(next_w))
                next_w += 1
        prog += [_W(k) for k in range(next_w, microbatches)]
        progs.append(prog)
    return progs


def interleaved_1f1b(pp: int, microbatches: int, chunks: int) -> list[Program]:
    """Megatron's interleaved 1F1B: each rank holds ``chunks`` model chunks (stage c*pp + r).

    Microbatches go through in groups of pp: each group runs chunk 0 on all its microbatches,
    then chunk 1, ...; backward visits chunks in reverse. Rank r warms up with
    2*(pp-r-1) + (chunks-1)*pp forwards (capped at m*chunks), then alternates F and B. With
    chunk costs 1/chunks of a rank's share, the bubble time shrinks by the factor ``chunks``.
    """
    if chunks < 2:
        raise ValueError(f"interleaved-1f1b needs chunks >= 2 (got {chunks}); use 1f1b for one chunk")
    if pp > 1 and microbatches % pp:
        below = microbatches - microbatches % pp   # nearest multiples of pp; 0 (below pp) is no choice
        nearby = " or ".join(str(n) for n in (below, below + pp) if n >= pp)
        raise ValueError(
            f"interleaved-1f1b needs microbatches to be a multiple of pp (got microbatches={microbatches}, "
            f"pp={pp}): microbatches go through in groups of pp; use microbatches={nearby}, "
            f"or the 1f1b schedule")
    order_f: list[tuple[int, int]] = []
    order_b: list[tuple[int, int]] = []
    for g in range(0, microbatches, pp):
        group = range(g, min(g + pp, microbatches))
        order_f += [(mb, c) for c in range(chunks) for mb in group]
        order_b += [(mb, c) for c in reversed(range(chunks)) for mb in group]
    total = len(order_f)
    progs = []
    for r in range(pp):
        warm = min(total, 2 * (pp - r - 1) + (chunks - 1) * pp)
        prog = [_F(*order_f[k]) for k in range(warm)]
        for k in range(total - warm):
            prog += [_F(*order_f[warm + k]), _B(*order_b[k])]
        prog += [_B(*order_b[k]) for k in range(total - warm, total)]
        progs.append(prog)
    return progs


SCHEDULES: dict[str, str] = {
    "gpipe": "all forwards then all backwards (GPipe); holds m microbatches",
    "1f1b": "one-forward-one-backward (PipeDream-flush); holds at most pp-r on rank r",
    "interleaved-1f1b": "Megatron interleaved 1F1B over --chunks model chunks per rank",
    "zb-h1": "zero-bubble H1: backward split into B and W, same peak memory as 1F1B",
    "forward": "forward only (evaluation)",
}


def build_schedule(name: str, pp: int, microbatches: int, chunks: int = 1, *, lag_w: bool = True) -> Schedule:
    """A compute-only schedule by name (see ``SCHEDULES``); ValueError says what would work."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an integer >= 1 (got {pp!r})")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1 (got {microbatches!r})")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1 (got {chunks!r})")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if chunks != 1 and name not in ("interleaved-1f1b", "forward"):
        raise ValueError(f"schedule {name!r} runs one chunk per rank (got chunks={chunks}); "
                         f"use interleaved-1f1b for several chunks per rank")
    builders: dict[str, Callable[[], list[Program]]] = {
        "gpipe": lambda: gpipe(pp, microbatches),
        "1f1b": lambda: one_f_one_b(pp, microbatches),
        "interleaved-1f1b": lambda: interleaved_1f1b(pp, microbatches, chunks),
        "zb-h1": lambda: zb_h1(pp, microbatches, lag_w),
        "forward": lambda: forward_only(pp, microbatches, chunks),
    }
    programs = [steps_of(p) for p in builders[name]()]
    return Schedule(name, pp, microbatches, chunks, programs, forward_only=name == "forward")


def compile_schedule(name: str, pp: int, microbatches: int, chunks: int = 1,
                     costs: Costs | None = None) -> Schedule:
    """Build, lower and validate: the exact program the engine runs.

    ``costs`` (per chunk; default uniform f = b = w) order the communication: the schedule is
    lowered with them (see :func:`lower`). For zb-h1 both W orderings are lowered and simulated
    with them and the faster one kept (ties go to the paper's H1).
    """
    lowered = lower(build_schedule(name, pp, microbatches, chunks), costs)
    validate(lowered)
    if name == "zb-h1":
        alt = lower(build_schedule(name, pp, microbatches, chunks, lag_w=False), costs)
        validate(alt)
        c = costs or Costs()
        if simulate(alt, c).makespan < simulate(lowered, c).makespan:
            return alt
    return lowered


def theoretical_bubble(name: str, pp: int, microbatches: int, chunks: int = 1,
                       costs: Costs | None = None) -> float:
    """Closed-form idle fraction for uniform stages and free communication.

    gpipe / 1f1b / forward: (p-1)/(m+p-1). interleaved-1f1b: (p-1)/(v*m+p-1) (bubble time
    divided by v). zb-h1: idle (p-1)*(f+b-w) per rank over makespan m*(f+b+w) + (p-1)*(f+b-w),
    valid while w <= f + b (the zero-bubble paper's H1 figure).
    """
    p, m, v = pp, microbatches, chunks
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        c = costs or Costs()
        idle = (p - 1) * (c.f + c.b - c.w)
        return float(idle / (m * (c.f + c.b + c.w) + idle))
    return (p - 1) / (m + p - 1)


def summary(schedule: Schedule, result: SimResult, costs: Costs) -> str:
    """The figures the CLI prints under the timeline."""
    lines = [
        f"schedule {schedule.name}: pp={schedule.pp} microbatches={schedule.microbatches} "
        f"chunks={schedule.chunks}  costs f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}"
        + (" (per chunk: 1/chunks of these)" if schedule.chunks > 1 else ""),
        f"makespan            {result.makespan:g}",
        f"bubble (simulated)  {result.mean_bubble:.3f}   per rank: "
        + " ".join(f"{b:.3f}" for b in result.bubble),
    ]
    if schedule.name in SCHEDULES:
        tb = theoretical_bubble(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks, costs)
        why = ("zero-bubble paper's H1 figure, exact when f = b = w" if schedule.name == "zb-h1"
               else "closed form, uniform stages, free comm")
        lines.append(f"bubble (theory)     {tb:.3f}   ({why})")
    lines.append("peak in flight      " + " ".join(str(x) for x in result.peak_in_flight)
                 + "   (microbatch-chunk activations held, per rank)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeengine.schedule",
        description="Build, validate and simulate a pipeline schedule; print its timeline (one row per "
                    "rank) and its makespan, bubble and peak activations. Costs are in arbitrary units "
                    "for one microbatch through one rank's whole share of the model.")
    parser.add_argument("--schedule", "-s", default="1f1b", choices=list(SCHEDULES),
                        help="schedule to build (default 1f1b): "
                        + "; ".join(f"{k}: {v}" for k, v in SCHEDULES.items()))
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--chunks", "-v", type=int, default=1,
                        help="model chunks per rank, for interleaved-1f1b (default 1)")
    parser.add_argument("--tf", type=float, default=1.0, help="forward cost (default 1)")
    parser.add_argument("--tb", type=float, default=1.0,
                        help="backward input-gradient cost (default 1); schedules without W run b+w in B")
    parser.add_argument("--tw", type=float, default=1.0, help="backward weight-gradient cost (default 1)")
    parser.add_argument("--comm", type=float, default=0.0, help="cost of one matched transfer (default 0)")
    parser.add_argument("--file", metavar="PATH",
                        help="check a schedule written one line per rank (F3 B3 W3, F3.1 for chunk 1, "
                             "optionally lowered with sendF3>1 / recvB3<1, '+' joins a batch) instead of "
                             "building one; prints the deadlock or pairing report if it fails")
    parser.add_argument("--show-program", action="store_true",
                        help="also print each rank's lowered program (compute and comm steps)")
    parser.add_argument("--width", type=int, default=200, help="maximum timeline width in columns")
    prof = parser.add_argument_group(
        "profile a model", "with --profile MODEL: time every layer of an example model on this machine (one "
        "process), then print the measured costs and, for every schedule, the bounds the profile partition "
        "picks, the simulated step and the peak memory, to choose a schedule before launching")
    prof.add_argument("--profile", metavar="MODEL", choices=("gpt", "resnet", "mlp"), help="gpt, resnet or mlp")
    prof.add_argument("--preset", default="tiny", help="the model's named size (default tiny)")
    prof.add_argument("--micro-batch-size", type=int, default=4, help="examples per microbatch (default 4)")
    prof.add_argument("--memory-cap", type=float, metavar="GiB", help="per-rank memory the split must fit")
    args = parser.parse_args(argv)
    if args.profile:
        return _profile_main(args)
    costs = Costs(args.tf, args.tb, args.tw, args.comm)
    try:
        if args.file:
            with open(args.file, encoding="utf-8") as fh:
                sched = parse_schedule(fh.read(), name=args.file)
            sched = lower(sched, costs.per_chunk(sched.chunks))
            validate(sched)
        else:
            sched = compile_schedule(args.schedule, args.pp, args.microbatches, args.chunks,
                                     costs.per_chunk(args.chunks))
    except OSError as exc:
        print(f"error: cannot read schedule file: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"error: schedule file {args.file!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
              f"{exc.start}); a schedule file has one line per rank, e.g. F0 F1 B0 B1", file=sys.stderr)
        return 2
    except ValueError as exc:  # ScheduleError / DeadlockError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result = simulate(sched, costs.per_chunk(sched.chunks))
    print(render_timeline(result, args.width))
    print()
    if args.show_program:
        print(format_schedule(sched))
    print(summary(sched, result, costs))
    return 0


def _profile_main(args: argparse.Namespace) -> int:
    """``--profile``: measured layer costs, and every schedule's best split for them (imports torch)."""
    import importlib

    import torch

    from .partition import PartitionError, choose_bounds, profile_layers, rank_costs
    from .stage import LayerError

    mod = importlib.import_module(f"pipeengine.models.{args.profile}")
    presets = mod.presets()
    if args.preset not in presets:
        print(f"error: --preset {args.preset!r} is not a {args.profile} preset; choose {', '.join(presets)}",
              file=sys.stderr)
        return 2
    if args.pp < 2 or args.microbatches < 1 or args.micro_batch_size < 1:
        print("error: --pp must be >= 2 and --microbatches, --micro-batch-size >= 1", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cfg = presets[args.preset]()
    layers = mod.build(cfg)
    batches = importlib.import_module("pipeengine.models.data").batches
    x, y = next(iter(batches(mod.make_source(cfg, None), "train", 0, 0, 0, 1, 1, args.micro_batch_size)))
    try:
        costs = profile_layers(layers, 0, len(layers), x, loss_fn=mod.loss_fn, target=y, device=torch.device("cpu"))
    except LayerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.profile}/{args.preset}: {len(layers)} layers, microbatch of {args.micro_batch_size} on cpu, "
          f"{torch.get_num_threads()} threads; ms per microbatch (the last layer includes the loss)")
    print(f"{'layer':>5} {'F':>8} {'B':>8} {'W':>8} {'B+W fused':>10} {'act MiB':>8} {'param MiB':>9}")
    for i, c in enumerate(costs):
        print(f"{i:>5} {1e3 * c.f:8.2f} {1e3 * c.b:8.2f} {1e3 * c.w:8.2f} {1e3 * c.fused:10.2f} "
              f"{c.activation_bytes / 2**20:8.2f} {c.param_bytes / 2**20:9.2f}")
    print(f"\n{'schedule':<28} {'bounds':<28} {'step ms':>8} {'bubble':>7} {'peak in flight':>15} "
          f"{'GiB per rank (est.)':>20}")
    cap = args.memory_cap * 2**30 if args.memory_cap else None
    for name in [n for n in SCHEDULES if n != "forward"]:
        chunks = 2 if name == "interleaved-1f1b" else 1
        label = name + (" (chunks 2)" if chunks > 1 else "")
        try:
            sched = compile_schedule(name, args.pp, args.microbatches, chunks)
            choice = choose_bounds(costs, sched, cap)
        except (ValueError, PartitionError) as exc:
            print(f"{label:<28} {str(exc).splitlines()[0]}")
            continue
        sched = compile_schedule(name, args.pp, args.microbatches, chunks, choice.mean_costs())
        result = simulate(sched, rank_costs(choice.stage_costs, sched))
        print(f"{label:<28} {str(choice.bounds):<28} {1e3 * result.makespan:8.1f} {result.mean_bubble:7.3f} "
              f"{' '.join(map(str, result.peak_in_flight)):>15} "
              f"{' '.join(f'{m / 2**30:.2f}' for m in choice.memory):>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
