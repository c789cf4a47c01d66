"""Lowering: paired, batched comm inserted in the order a witness execution with the run's costs gives."""

from __future__ import annotations

import itertools

import pytest

from pipeengine.schedule import (Action, Costs, DeadlockError, Kind, build_schedule, compile_schedule, format_schedule,
                                 lower, parse_schedule, simulate, validate)
from pipeengine.schedule.dataflow import transfers
from pipeengine.schedule.lower import witness_times
from pipeengine.schedule.simulate import Dataflow
from tests.schedule.test_builders import SWEEP


def test_lowered_1f1b_pp2_m2_is_paired_and_batched() -> None:
    s = compile_schedule("1f1b", 2, 2)
    assert format_schedule(s).splitlines()[1:] == [
        "F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1 B0 recvB1<1 B1",
        "recvH0<0 recvF0<0 F0 recvF1<0 B0 sendB0>0 F1 B1 sendB1>0",
    ]


def test_compute_order_deadlock_is_reported_as_cycle() -> None:
    s = parse_schedule("F0 B0 F1 B1\nF1 F0 B0 B1")
    with pytest.raises(DeadlockError, match="deadlock: 0 -> 1 -> 0") as exc:
        lower(s)
    assert "position 0 waits at B0 for B0 on position 1" in str(exc.value)
    assert "position 1 waits at F1 for F1 on position 0" in str(exc.value)


def test_zb_h1_with_free_w_lowers_to_1f1b_makespan() -> None:
    # w = 0: zb-h1 is 1F1B with free W's, so (m + p - 1)(f + b) = 11 * 3 = 33. Lowered with unit
    # costs the H1 ordering posted its transfers in the wrong order for these costs and took 37.
    c = Costs(f=1, b=2, w=0)
    assert simulate(compile_schedule("zb-h1", 4, 8, costs=c), c).makespan == 33
    assert simulate(build_schedule("zb-h1", 4, 8), c).makespan == 33  # simulate lowers with c
    for lag_w in (True, False):
        s = lower(build_schedule("zb-h1", 4, 8, lag_w=lag_w), c)
        validate(s)
        assert simulate(s, c).makespan == 33, lag_w
        assert simulate(s, c, mode="rendezvous").makespan == 33, lag_w


ZERO_COSTS = [Costs(0, 0, 0), Costs(1, 0, 0), Costs(0, 1, 0), Costs(0, 0, 1), Costs(0, 1, 1), Costs(1, 2, 0)]


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_lower_with_zero_costs_is_valid_and_deterministic(pp: int) -> None:
    for (name, v), m, c in itertools.product(SWEEP, (1, 2, pp, 2 * pp), ZERO_COSTS):
        if name == "interleaved-1f1b" and m % pp:
            continue
        s = lower(build_schedule(name, pp, m, v), c)
        validate(s)  # every send after its producer, every recv before its consumer, paired, no deadlock
        assert s.programs == lower(build_schedule(name, pp, m, v), c).programs
        assert simulate(s, c).makespan == simulate(build_schedule(name, pp, m, v), c).makespan
    assert format_schedule(lower(build_schedule("1f1b", 2, 2), Costs(0, 0, 0))).splitlines()[1:] == [
        "F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1 B0 recvB1<1 B1",
        "recvH0<0 recvF0<0 F0 recvF1<0 B0 sendB0>0 F1 B1 sendB1>0",
    ]


def test_lower_default_is_unit_costs_and_ignores_float_rounding() -> None:
    for (name, v), pp in itertools.product(SWEEP, (2, 3, 4)):
        s = build_schedule(name, pp, 2 * pp, v)
        assert lower(s).programs == lower(s, Costs()).programs == lower(s, Costs(2, 2, 2)).programs
    # per-chunk costs 1/3 are unit costs scaled: same order (float sums of 1/3 must not break ties)
    s = build_schedule("interleaved-1f1b", 6, 18, 3)
    c = Costs(1, 1, 1, comm=0.5).per_chunk(3)
    assert lower(s, c).programs == lower(s).programs
    # 122.0: every transfer 0.5, a stream's shape header nothing (130.5 when headers cost a transfer each)
    assert simulate(compile_schedule("interleaved-1f1b", 6, 18, 3, c), c).makespan == pytest.approx(122.0)
    z = build_schedule("zb-h1", 4, 8)
    assert lower(z, Costs(0.1, 0.2, 0.3)).programs == lower(z, Costs(1, 2, 3)).programs


def test_lower_accepts_per_position_costs() -> None:
    slow = [Costs(), Costs(f=3, b=1, w=1), Costs(), Costs()]
    s = build_schedule("zb-h1", 4, 8)
    lowered = lower(s, slow)
    validate(lowered)
    assert simulate(s, slow).makespan == simulate(lowered, slow).makespan
    assert lowered.programs != lower(s).programs
    with pytest.raises(ValueError, match="got 2 per-position costs for pp=4"):
        lower(s, [Costs(), Costs()])


def test_batches_by_time_hold_one_witness_time_and_compile_keeps_the_shorter() -> None:
    """[Note: batches by time]: dualpipev's usual batches join a B's gradient with a later forward input."""
    c = Costs().per_chunk(2)   # f = b = w = 1 per position's share, as in the figures
    built = build_schedule("dualpipev", 4, 8)
    usual, by_time = lower(built, c), lower(built, c, by_time=True)
    validate(by_time)
    made = {}   # comm action on its position -> the witness end of the compute that made the transfer
    for p, (acts, times) in enumerate(zip([built.compute_actions(p) for p in range(4)], witness_times(built, c))):
        for a, (_, end) in zip(acts, times):
            for send, q, recv in transfers(built, p, a):
                made[(p, send)] = made[(q, recv)] = end
    comm = [[{made[(p, a)] for a in step if a.kind not in (Kind.SEND_H, Kind.RECV_H)} for step in prog
             if not step[0].kind.is_compute] for p, prog in enumerate(by_time.programs)]
    assert all(len(times) <= 1 for row in comm for times in row)
    assert any(len({made[(p, a)] for a in step if a.kind not in (Kind.SEND_H, Kind.RECV_H)}) > 1
               for p, prog in enumerate(usual.programs) for step in prog if not step[0].kind.is_compute)
    assert (simulate(usual, c).makespan, simulate(by_time, c).makespan) == (27.5, 25.5)
    assert compile_schedule("dualpipev", 4, 8).programs == by_time.programs
    for name in ("1f1b", "zb-h1", "zbv"):   # equal makespans: the usual batches, fewer steps
        assert compile_schedule(name, 4, 8).programs == lower(build_schedule(name, 4, 8), None).programs


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16), (4, 32), (8, 16), (8, 32)])
def test_dualpipev_lowered_reaches_its_data_dependency_bound(pp: int, m: int) -> None:
    """Batches of one time, the ones with a free peer first ([Note: batches by time]): no transfer waits in a comm
    queue behind one whose peer is still computing, so the lowered program runs as fast as its compute order
    allows (torch 2.14.1's DualPipeV order, replayed with our earlier lowerings: 54.5 / 110.5 / 110.5 at
    pp 4 m 16 / pp 4 m 32 / pp 8 m 32)."""
    c = Costs().per_chunk(2)
    built = build_schedule("dualpipev", pp, m)
    flow = Dataflow(built)
    bound = flow.makespan(flow.durations(c))
    s = compile_schedule("dualpipev", pp, m)
    validate(s)
    expected = {(4, 8): 25.5, (4, 16): 49.5, (4, 32): 97.5, (8, 16): 51.5, (8, 32): 99.5}[(pp, m)]
    assert simulate(s, c).makespan == bound == expected


def test_at_one_time_a_position_posts_first_what_a_free_peer_can_match() -> None:
    """dualpipev pp 4 m 16, position 2 at 8.5: its F4.1 output goes to position 1 (computing until 9.0), the
    gradient for its B0 comes from position 3 (free): the gradient is posted first, in a batch of its own."""
    c = Costs().per_chunk(2)
    s = lower(build_schedule("dualpipev", 4, 16), c, by_time=True)
    prog = [step for step in s.programs[2] if not step[0].kind.is_compute]
    gradient = next(i for i, st in enumerate(prog) if Action.parse("recvB0<3") in st)
    output = next(i for i, st in enumerate(prog) if Action.parse("sendF4.1>1") in st)
    assert gradient < output and prog[gradient] == (Action.parse("recvB0<3"),)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_positions_sharing_processors_run_as_their_share_allows(name: str) -> None:
    """Processor sharing (CPU ranks on fewer cores): with a processor each it is the dependency-only makespan;
    on one processor for all, the total work (some action can always run); in between, neither bound is exact."""
    pp, m = 4, 8
    s = build_schedule(name, pp, m)
    c = Costs(1.0, 1.5, 0.5).per_chunk(s.chunks) if s.chunks > 1 else Costs(1.0, 1.5, 0.5)
    flow = Dataflow(s)
    table = flow.durations(c)
    alone, work = flow.makespan(table), sum(flow.work(table))
    assert flow.shared_makespan(table, pp) == pytest.approx(alone)
    assert flow.shared_makespan(table, 1) == pytest.approx(work)
    half = flow.shared_makespan(table, pp / 2)
    assert max(alone, work / (pp / 2)) < half < 2 * alone   # the fill runs faster than the steady state
    sizes = [2.0] * m   # microbatches twice the size: twice as long
    assert flow.shared_makespan(table, pp / 2, sizes=sizes) == pytest.approx(2 * half)
    assert flow.shared_makespan(table, pp, comm=0.25) == pytest.approx(flow.makespan(table, 0.25))
