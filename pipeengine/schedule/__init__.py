"""The schedule compiler, pure Python (no torch): actions, builders, lowering, the validator, the simulator.

A schedule is, per pipeline position, an ordered list of steps; a step is one compute action
(``F3``, ``B3``, ``W3``, with ``.c`` for chunk c) or a batch of comm actions (``sendF3>1+recvB1<1``).
Builders return compute-only schedules; :func:`lower` adds paired communication; :func:`validate`
proves the result complete, paired and deadlock-free; the engine executes exactly that list, so the
picture ``python -m pipeengine.schedule`` prints is the program the ranks run.
"""

from .actions import Action, Kind, Schedule, ScheduleError, Step, format_grid, format_schedule, parse_schedule
from .builders import (SCHEDULES, build_schedule, compile_schedule, forward_only, gpipe, interleaved_1f1b,
                       one_f_one_b, theoretical_bubble, zb_h1)
from .costs import Costs
from .dataflow import DeadlockError
from .lower import lower
from .simulate import SimResult, simulate
from .timeline import render_timeline
from .verify import validate

__all__ = [
    "Action", "Kind", "Schedule", "ScheduleError", "DeadlockError", "Step", "Costs", "SimResult",
    "SCHEDULES", "build_schedule", "compile_schedule", "theoretical_bubble",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "forward_only",
    "lower", "validate", "simulate", "render_timeline", "parse_schedule", "format_schedule", "format_grid",
]
