"""The schedule tool, ``python -m pipeengine.schedule``: build or read a schedule, prove it, print its timeline.

An entry point: ``--profile`` times a real model, so only that mode imports torch and the
training layer (lazily); everything else is the torch-free schedule compiler.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .actions import Schedule, format_schedule, parse_schedule
from .builders import SCHEDULES, compile_schedule, default_chunks, theoretical_bubble
from .costs import Costs
from .lower import lower
from .simulate import SimResult, simulate
from .timeline import render_timeline
from .verify import validate

__all__ = ["main", "summary"]


def summary(schedule: Schedule, result: SimResult, costs: Costs) -> str:
    """The figures the tool prints under the timeline."""
    lines = [
        f"schedule {schedule.name}: pp={schedule.pp} microbatches={schedule.microbatches} "
        f"chunks={schedule.chunks}  costs f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}"
        + (" (per chunk: 1/chunks of these)" if schedule.chunks > 1 else ""),
        f"makespan            {result.makespan:g}",
        f"bubble (simulated)  {result.mean_bubble:.3f}   per position: "
        + " ".join(f"{b:.3f}" for b in result.bubble),
    ]
    if schedule.name in SCHEDULES:
        tb = theoretical_bubble(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks, costs)
        closed = ("gpipe", "1f1b", "interleaved-1f1b", "forward")
        why = ("zero-bubble paper's H1 figure, exact when f = b = w" if schedule.name == "zb-h1"
               else "closed form, uniform stages, free comm" if schedule.name in closed
               else "simulated with uniform stages, free comm: no closed form")
        lines.append(f"bubble (theory)     {tb:.3f}   ({why})")
    lines.append("peak in flight      " + " ".join(str(x) for x in result.peak_in_flight)
                 + "   (microbatch activations held per stage, per position)")
    if schedule.chunks > 1:
        lines.append("  in microbatches   " + " ".join(f"{x / schedule.chunks:g}" for x in result.peak_in_flight)
                     + f"   (the same over {schedule.chunks} chunks: a position's whole share per microbatch)")
    return "\n".join(lines)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def _costs(text: str) -> list[float]:
    """One cost, or one per layer (comma-separated: for --schedule auto)."""
    return [_cost(part) for part in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeengine.schedule",
        description="Build, validate and simulate a pipeline schedule; print its timeline (one row per "
                    "position) and its makespan, bubble and peak activations. Costs are in arbitrary units "
                    "for one microbatch through one position's whole share of the model.")
    parser.add_argument("--schedule", "-s", default="1f1b", choices=[*SCHEDULES, "auto"],
                        help="schedule to build (default 1f1b): "
                        + "; ".join(f"{k}: {v}" for k, v in SCHEDULES.items())
                        + "; auto: the schedule and the split chosen together from per-layer costs (--tf/--tb/--tw "
                          "as comma lists, --costs FILE, or --profile), as the trainer's --schedule auto does")
    parser.add_argument("--pp", type=_count, default=4, help="pipeline positions (default 4)")
    parser.add_argument("--microbatches", "-m", type=_count, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--chunks", "-v", type=_count, default=None,
                        help="stages per position (default: the schedule's own, 2 for the interleaved and V ones, "
                             "else 1)")
    parser.add_argument("--tf", type=_costs, default=[1.0], help="forward cost (default 1); with --schedule auto, "
                        "one per layer: 1,1,2,1 (or one for each of --layers)")
    parser.add_argument("--tb", type=_costs, default=[1.0],
                        help="backward input-gradient cost (default 1); schedules without W run b+w in B")
    parser.add_argument("--tw", type=_costs, default=[1.0], help="backward weight-gradient cost (default 1)")
    parser.add_argument("--layers", type=_count, default=None,
                        help="--schedule auto: layers, when --tf/--tb/--tw give one cost each (default 4 x pp)")
    parser.add_argument("--costs", metavar="FILE",
                        help="--schedule auto: per-layer costs, one line per layer: 'f b w' (# comments allowed)")
    parser.add_argument("--comm", type=_cost, default=0.0, help="cost of one matched transfer (default 0)")
    parser.add_argument("--file", metavar="PATH",
                        help="check a schedule written one line per position (F3 B3 W3, F3.1 for chunk 1, "
                             "optionally lowered with sendF3>1 / recvB3<1, '+' joins a batch) instead of "
                             "building one; prints the deadlock or pairing report if it fails")
    parser.add_argument("--show-program", action="store_true",
                        help="also print each position's lowered program (compute and comm steps)")
    parser.add_argument("--width", type=_count, default=200, help="maximum timeline width in columns")
    prof = parser.add_argument_group(
        "profile a model", "with --profile MODEL: time every layer of an example model on this machine (one "
        "process), then print the measured costs and, for every schedule, the bounds the profile partition "
        "picks, the simulated step and the peak memory, to choose a schedule before launching")
    prof.add_argument("--profile", metavar="MODEL", help="gpt, resnet, mlp or package.module:function (as the "
                      "trainer's --model)")
    prof.add_argument("--preset", default=None, help="the model's named size (default: the model's, tiny for the "
                      "built-ins)")
    prof.add_argument("--micro-batch-size", type=_count, default=4, help="examples per microbatch (default 4)")
    prof.add_argument("--memory-cap", type=_cost, metavar="GiB", help="per-position memory the split must fit")
    return parser


def _load(args: argparse.Namespace, costs: Costs) -> Schedule:
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            sched = parse_schedule(fh.read(), name=args.file)
        sched = lower(sched, costs.per_chunk(sched.chunks))
        validate(sched)
        return sched
    chunks = default_chunks(args.schedule) if args.chunks is None else args.chunks
    return compile_schedule(args.schedule, args.pp, args.microbatches, chunks, costs.per_chunk(chunks))


def main(argv: Sequence[str] | None = None) -> int:
    """The tool: 0 printed, 1 the schedule is invalid (the report says why), 2 bad input."""
    args = _parser().parse_args(argv)
    if args.profile:
        from ..training.profile_report import profile_report   # the one mode that needs torch
        return profile_report(args.profile, args.preset, args.pp, args.microbatches, args.micro_batch_size,
                              args.memory_cap)
    if args.schedule == "auto":
        return _auto(args)
    if max(len(args.tf), len(args.tb), len(args.tw)) > 1:
        print("error: costs per layer (--tf 1,2,...) are for --schedule auto; a library schedule takes one cost "
              "each", file=sys.stderr)
        return 2
    costs = Costs(args.tf[0], args.tb[0], args.tw[0], args.comm)
    try:
        sched = _load(args, costs)
    except OSError as exc:
        print(f"error: cannot read schedule file: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"error: schedule file {args.file!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
              f"{exc.start}); a schedule file has one line per position, e.g. F0 F1 B0 B1", file=sys.stderr)
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


def _layer_costs(args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """Per-layer (f, b, w) for --schedule auto, from --costs FILE or the --tf/--tb/--tw lists (ValueError: why not)."""
    if args.costs:
        with open(args.costs, encoding="utf-8") as fh:
            rows = [line.split("#")[0].split() for line in fh]
        rows = [r for r in rows if r]
        if not rows or any(len(r) != 3 for r in rows):
            raise ValueError(f"--costs {args.costs!r}: one line 'f b w' per layer (three numbers) is needed")
        return [(_cost(f), _cost(b), _cost(w)) for f, b, w in rows]
    n = max(len(args.tf), len(args.tb), len(args.tw))
    n = args.layers or (n if n > 1 else 4 * args.pp)
    lists = [c * n if len(c) == 1 else c for c in (args.tf, args.tb, args.tw)]
    if any(len(c) != n for c in lists):
        raise ValueError(f"--tf, --tb and --tw give {[len(c) for c in (args.tf, args.tb, args.tw)]} costs: give one "
                         f"each, or one per layer ({n}) each")
    return list(zip(*lists))


def _auto(args: argparse.Namespace) -> int:
    """--schedule auto from given per-layer costs: what the trainer's auto would choose, and its timeline."""
    from ..runtime.auto import auto_schedule   # an entry point may plan with the runtime's planner (torch-free)
    from ..runtime.links import fixed_links
    from ..runtime.measured import with_transfers
    from ..runtime.planner import LayerCost, PartitionError
    try:
        layers = _layer_costs(args)
        choice = auto_schedule([LayerCost(f, b, w, b + w, 0, 0) for f, b, w in layers], args.pp, args.microbatches,
                               links=fixed_links(args.pp, args.comm) if args.comm else None)
    except OSError as exc:
        print(f"error: cannot read --costs: {exc}", file=sys.stderr)
        return 2
    except (ValueError, PartitionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = simulate(choice.schedule, with_transfers(choice.stage_costs, choice.comm))
    print(render_timeline(result, args.width))
    print()
    print(choice.describe(unit="units"))
    return 0
