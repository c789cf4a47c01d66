"""Schedule builders from integers (GPipe, 1F1B, interleaved 1F1B, zero-bubble H1, forward-only; the V ones in
vshape.py); the catalogue; compile; closed forms.

A builder returns, per position, the order of its compute actions; :func:`compile_schedule` lowers
it with paired communication (lower.py) and proves it (verify.py): the exact program the engine runs.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .actions import Action, Kind, Schedule, ScheduleError, Step, steps_of
from .costs import Costs, boundary_comm
from .lower import lower
from .simulate import Dataflow, simulate
from .synth import synthesise
from .vshape import dualpipev, zbv
from .verify import validate

__all__ = ["SCHEDULES", "CHUNKS", "build_schedule", "compile_schedule", "theoretical_bubble", "default_chunks",
           "schedule_bubble",
           "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "forward_only",
           "shortest_lowering"]

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


def forward_only(pp: int, microbatches: int, chunks: int = 1, placement: str = "loop") -> list[Program]:
    """Forwards only (evaluation): every chunk of every microbatch, in microbatch order; in V placement every
    microbatch down the V (chunk 0), then every one back up (chunk 1)."""
    if placement == "v":
        return [[_F(k, c) for c in range(chunks) for k in range(microbatches)] for _ in range(pp)]
    return [[_F(k, c) for k in range(microbatches) for c in range(chunks)] for _ in range(pp)]


def one_f_one_b(pp: int, microbatches: int) -> list[Program]:
    """PipeDream-flush 1F1B: position r warms up with min(pp-r-1, m) forwards, then alternates F and B.

    Position r therefore never holds more than min(pp-r, m) microbatches' activations, against m for GPipe.
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

    - ``lag_w=True`` (the paper's H1): position r lets its W's lag its B's by r microbatches, so
      its in-flight activations peak at min(pp-r-1, m) + 1 + r <= pp, 1F1B's peak at position 0. With
      uniform costs (f = b = w) the makespan is m(f+b+w) + (p-1)(f+b-w).
    - ``lag_w=False``: W right after B in the steady phase, cooldown alternates B and W. Peak
      per position equals 1F1B's; strictly faster than 1F1B for every cost with w > 0, but it
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
    """Megatron's interleaved 1F1B: each position holds ``chunks`` stages (chunk c of position r is stage c*pp + r).

    Microbatches go through in groups of pp: each group runs chunk 0 on all its microbatches,
    then chunk 1, ...; backward visits chunks in reverse. Position r warms up with
    2*(pp-r-1) + (chunks-1)*pp forwards (capped at m*chunks), then alternates F and B. With
    stage costs 1/chunks of a position's share, the bubble time shrinks by the factor ``chunks``.
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
    order_f, order_b = _groups_of_pp(pp, microbatches, chunks)
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


def _groups_of_pp(pp: int, microbatches: int, chunks: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (microbatch, chunk) order of forwards and of backwards of the interleaved schedules: microbatches in
    groups of pp, each group through chunk 0, then chunk 1, ...; backwards through the chunks in reverse."""
    order_f: list[tuple[int, int]] = []
    order_b: list[tuple[int, int]] = []
    for g in range(0, microbatches, pp):
        group = range(g, min(g + pp, microbatches))
        order_f += [(mb, c) for c in range(chunks) for mb in group]
        order_b += [(mb, c) for c in reversed(range(chunks)) for mb in group]
    return order_f, order_b


def interleaved_zb(pp: int, microbatches: int, chunks: int) -> list[Program]:
    """Interleaved 1F1B with the backward split (zero-bubble H1 over ``chunks`` looping stages per position).

    The forwards and backwards go in the order of :func:`interleaved_1f1b`, but position r warms up with only
    (chunks-1)*pp + pp-r-1 forwards (B's are short, so the first gradient comes back sooner), and lets its W's
    lag its B's by r: it holds at most chunks*pp chunk activations (pp microbatches of its share, 1F1B's first
    position), the W's filling what the drain leaves idle.
    """
    order_f, order_b = _groups_of_pp(pp, microbatches, chunks)
    total = len(order_f)
    progs = []
    for r in range(pp):
        warm = min(total, (chunks - 1) * pp + pp - r - 1)
        prog = [_F(*order_f[k]) for k in range(warm)]
        next_w = 0
        for k in range(total):
            if warm + k < total:
                prog.append(_F(*order_f[warm + k]))
            prog.append(_B(*order_b[k]))
            if k >= r or warm + k >= total:
                prog.append(_W(*order_b[next_w]))
                next_w += 1
        prog += [_W(*order_b[k]) for k in range(next_w, total)]
        progs.append(prog)
    return progs


SCHEDULES: dict[str, str] = {
    "gpipe": "all forwards then all backwards (GPipe); holds m microbatches",
    "1f1b": "one-forward-one-backward (PipeDream-flush); holds at most pp-r at position r",
    "interleaved-1f1b": "Megatron interleaved 1F1B over --chunks stages per position",
    "zb-h1": "zero-bubble H1: backward split into B and W, same peak memory as 1F1B",
    "zbv": "zero-bubble V: two stages per position in V placement (loss on position 0), B and W split",
    "dualpipev": "DualPipeV: V placement, F of one stage paired with the full B of the other; split B/W at the ends",
    "zb-h2": "zero-bubble H2: warm-up runs ahead (up to 2pp-1 microbatches held) so the drain has no bubble",
    "interleaved-zb": "interleaved zero bubble: --chunks stages per position (loop), B and W split, W's fill the gaps",
    "v-half": "V placement, B and W split, at most (pp+2)//2 microbatches held per position (half of 1F1B's first)",
    "v-min": "V placement, B and W split, at most (pp+4)//3 microbatches held per position (a third)",
    "forward": "forward only (evaluation)",
}


CHUNKS = {"interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2, "v-half": 2, "v-min": 2}   # else 1
PLACEMENT = {"zbv": "v", "dualpipev": "v", "v-half": "v", "v-min": "v"}   # schedules not named here loop
ANY_CHUNKS = ("interleaved-1f1b", "interleaved-zb", "forward")


def synthesis_caps(name: str, pp: int, microbatches: int, chunks: int) -> list[int]:
    """The memory cap per position (chunk activations) a synthesised schedule is built under (synth.py)."""
    if name == "zb-h2":
        return [2 * pp - 1] * pp
    if name == "v-half":
        return [2 * ((pp + 2) // 2)] * pp
    if name == "v-min":
        return [2 * ((pp + 4) // 3)] * pp
    return [chunks * pp] * pp   # interleaved-zb: pp microbatches of the position's share, as interleaved_zb holds


def default_chunks(name: str) -> int:
    """The stages per position a schedule runs when none are asked for (interleaved-1f1b takes any >= 2,
    forward any; the others exactly this)."""
    return CHUNKS.get(name, 1)


SYNTHESISED = ("zb-h2", "interleaved-zb", "v-half", "v-min")


def build_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None, *, lag_w: bool = True,
                   placement: str = "loop", costs: Costs | Sequence[Costs] | None = None) -> Schedule:
    """A compute-only schedule by name (see ``SCHEDULES``); ValueError says what would work.

    ``chunks`` None takes the schedule's own (2 for the interleaved and V ones, else 1); ``placement``
    is for "forward" only (the evaluation program of a training schedule runs on its placement).
    zb-h2, v-half and v-min are synthesised (synth.py) for ``costs`` (per stage: one Costs or one per stage;
    default f = b = w = 1) under their memory caps; interleaved-zb is :func:`interleaved_zb` when pp divides the
    microbatches, else synthesised under that order's memory cap.
    """
    if chunks is None:
        chunks = default_chunks(name)
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an integer >= 1 (got {pp!r})")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1 (got {microbatches!r})")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1 (got {chunks!r})")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name not in ANY_CHUNKS and chunks != default_chunks(name):
        n = default_chunks(name)
        raise ValueError(f"schedule {name!r} runs {'one stage' if n == 1 else f'{n} stages'} per position (got "
                         f"chunks={chunks}); use interleaved-1f1b for several chunks per position")
    if name != "forward":
        placement = PLACEMENT.get(name, "loop")
    if name == "interleaved-zb" and chunks < 2:
        raise ValueError(f"interleaved-zb needs chunks >= 2 (got {chunks}); use zb-h1 or zb-h2 for one stage "
                         f"per position")
    if name in SYNTHESISED and not (name == "interleaved-zb" and microbatches % pp == 0):
        return synthesise(name, pp, microbatches, chunks, placement, Costs() if costs is None else costs,
                          synthesis_caps(name, pp, microbatches, chunks))
    builders: dict[str, Callable[[], list[Program]]] = {
        "gpipe": lambda: gpipe(pp, microbatches),
        "1f1b": lambda: one_f_one_b(pp, microbatches),
        "interleaved-1f1b": lambda: interleaved_1f1b(pp, microbatches, chunks),
        "interleaved-zb": lambda: interleaved_zb(pp, microbatches, chunks),
        "zb-h1": lambda: zb_h1(pp, microbatches, lag_w),
        "zbv": lambda: zbv(pp, microbatches),
        "dualpipev": lambda: dualpipev(pp, microbatches),
        "forward": lambda: forward_only(pp, microbatches, chunks, placement),
    }
    programs = [steps_of(p) for p in builders[name]()]
    return Schedule(name, pp, microbatches, chunks, programs, forward_only=name == "forward", placement_kind=placement)


def compile_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None,
                     costs: Costs | None = None, placement: str = "loop") -> Schedule:
    """Build, lower and validate: the exact program the engine runs.

    ``costs`` (per stage; default uniform f = b = w) order the communication: the schedule is
    lowered with them (see :func:`lower`). Where variants differ they are simulated with those costs and the
    fastest valid one kept, ties going to the usual one: batches of one witness time besides the usual batches
    (lower.py, [Note: batches by time]); for zb-h1 also the W ordering that is not the paper's H1, for
    interleaved-zb also the greedy order under the same memory cap.
    """
    builds = [build_schedule(name, pp, microbatches, chunks, placement=placement, costs=costs)]
    if name == "zb-h1":
        builds.append(build_schedule(name, pp, microbatches, chunks, lag_w=False))
    if name == "interleaved-zb" and microbatches % pp == 0:   # the greedy order under its cap, when shorter
        v = builds[0].chunks
        builds.append(synthesise(name, pp, microbatches, v, "loop", Costs() if costs is None else costs,
                                 synthesis_caps(name, pp, microbatches, v)))
    return shortest_lowering(builds, costs)


def shortest_lowering(orders: Sequence[Schedule], costs: Costs | Sequence[Costs] | None = None) -> Schedule:
    """Of compute-only ``orders``, each lowered with the usual batches and with batches of one witness time
    (lower.py, [Note: batches by time]), and where transfers cost time also from a witness that counts them, the
    one shortest in simulation with ``costs`` that the validator proves;
    ties go to the earlier order and to the usual batches (fewer steps). Raises the validator's error if none is
    proven. The variants are made and simulated in that order, and the first that runs at the orders' data-dependency
    bound (``Dataflow``: no lowering is shorter) is taken at once."""
    c = costs or Costs()
    comm = boundary_comm(c, orders[0]) if orders else []
    bound: float | None = None
    timed: list[tuple[float, Schedule]] = []
    for v in _lowerings(orders, costs, any(comm)):
        if bound is None:   # (after the first lowering: it checked the orders are complete)
            bound = min(flow.makespan(flow.durations(c), comm) for flow in map(Dataflow, orders))
        try:
            makespan = simulate(v, c).makespan
        except ScheduleError:   # deadlocks: left for validate to explain if it is the only one
            makespan = float("inf")
        if makespan <= bound * (1 + 1e-12) + 1e-12:
            try:
                validate(v)
                return v
            except ScheduleError:
                pass
        timed.append((makespan, v))
    timed.sort(key=lambda mv: mv[0])   # stable: ties keep the order above
    for _, v in timed[:-1]:
        try:
            validate(v)
            return v
        except ScheduleError:   # a split batch can close a cycle the usual batch does not: try the next
            continue
    validate(timed[-1][1])
    return timed[-1][1]


def _lowerings(orders: Sequence[Schedule], costs: Costs | Sequence[Costs] | None, comm: bool) -> Iterator[Schedule]:
    """Each order lowered the usual way and by witness time, from a witness without and (``comm``) with transfers,
    in that order, each distinct program once."""
    seen: list[list[list[Step]]] = []
    for order in orders:
        for with_comm in (False, True) if comm else (False,):
            for by_time in (False, True):
                v = lower(order, costs, by_time=by_time, with_comm=with_comm)
                if all(v.programs != programs for programs in seen):
                    seen.append(v.programs)
                    yield v


def theoretical_bubble(name: str, pp: int, microbatches: int, chunks: int | None = None,
                       costs: Costs | None = None) -> float:
    """Idle fraction for uniform stages and free communication: a closed form where one is known.

    gpipe / 1f1b / forward: (p-1)/(m+p-1). interleaved-1f1b: (p-1)/(v*m+p-1) (bubble time
    divided by v). zb-h1: idle (p-1)*(f+b-w) per position over makespan m*(f+b+w) + (p-1)*(f+b-w),
    valid while w <= f + b (the zero-bubble paper's H1 figure). Others (zbv): the simulated bubble
    of the schedule with these uniform costs.
    """
    p, m, v = pp, microbatches, default_chunks(name) if chunks is None else chunks
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        c = costs or Costs()
        idle = (p - 1) * (c.f + c.b - c.w)
        return float(idle / (m * (c.f + c.b + c.w) + idle))
    if name in ("gpipe", "1f1b", "forward"):
        return (p - 1) / (m + p - 1)
    c = (costs or Costs()).per_chunk(v)
    return simulate(compile_schedule(name, p, m, v, c), c).mean_bubble


def schedule_bubble(schedule: Schedule) -> float:
    """:func:`theoretical_bubble` of a compiled schedule: its closed form where its name has one, else (auto's
    synthesised order) its simulated bubble with uniform stages and free communication."""
    if schedule.name in SCHEDULES:
        return theoretical_bubble(schedule.name, schedule.pp, schedule.microbatches, schedule.chunks)
    return simulate(schedule, Costs().per_chunk(schedule.chunks)).mean_bubble
