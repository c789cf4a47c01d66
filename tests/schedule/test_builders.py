"""Schedule builders: golden tables, closed forms, a sweep of every builder, errors that say what works."""

from __future__ import annotations


import pytest

from pipeengine.schedule import (Costs, Schedule, ScheduleError, build_schedule, compile_schedule, format_schedule,
                                 parse_schedule, simulate, theoretical_bubble, validate)
from pipeengine.schedule.builders import SYNTHESISED, synthesis_caps
from tests.schedule import background


def compute_rows(s: Schedule) -> list[str]:
    return [" ".join(str(a) for a in s.compute_actions(r)) for r in range(s.pp)]


def test_1f1b_golden_pp4_m8() -> None:
    assert compute_rows(build_schedule("1f1b", 4, 8)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_gpipe_golden_pp2_m3() -> None:
    assert compute_rows(build_schedule("gpipe", 2, 3)) == ["F0 F1 F2 B0 B1 B2"] * 2


def test_interleaved_golden_pp2_m2_v2() -> None:
    assert compute_rows(build_schedule("interleaved-1f1b", 2, 2, 2)) == [
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1",   # position 0 warms up 2(p-1) + (v-1)p = 4 = everything
        "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1",
    ]


GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 4, 7, 8, 16, 24)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tf,tb", [(1, 1), (1, 2), (3, 2)])
def test_gpipe_1f1b_makespan_and_bubble_closed_form(name: str, tf: int, tb: int) -> None:
    for p, m in GRID:
        r = simulate(compile_schedule(name, p, m), Costs(f=tf, b=tb, w=0))
        assert r.makespan == (m + p - 1) * (tf + tb), (p, m)
        for bubble in r.bubble:
            assert bubble == pytest.approx((p - 1) / (m + p - 1))
        assert r.mean_bubble == pytest.approx(theoretical_bubble(name, p, m))


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_time_shrinks_by_v(v: int) -> None:
    costs = Costs(f=1.0, b=2.0, w=0.0)
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            ref = simulate(compile_schedule("1f1b", p, m), costs)
            inter = simulate(compile_schedule("interleaved-1f1b", p, m, v), costs.per_chunk(v))
            ideal = m * (costs.f + costs.b)
            assert ref.makespan - ideal == pytest.approx((p - 1) * 3.0)
            assert inter.makespan - ideal == pytest.approx((ref.makespan - ideal) / v), (p, m)
            assert inter.mean_bubble == pytest.approx(theoretical_bubble("interleaved-1f1b", p, m, v))


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 2, 1), (2, 3, 1), (1, 2, 2), (3, 1, 2), (1, 1, 0.1), (2, 1, 1)])
def test_zb_h1_beats_1f1b_without_more_memory(f: float, b: float, w: float) -> None:
    costs = Costs(f, b, w)
    for p in range(2, 9):
        for m in (1, 2, p - 1, p, p + 1, 2 * p, 24):
            if m < 1:
                continue
            zb = simulate(compile_schedule("zb-h1", p, m, costs=costs), costs)
            ref = simulate(compile_schedule("1f1b", p, m), costs)
            assert zb.makespan < ref.makespan, (p, m)
            assert max(zb.peak_in_flight) <= max(ref.peak_in_flight), (p, m)


def test_zb_h1_reaches_paper_figure_for_uniform_costs() -> None:
    c = Costs(1, 1, 1)
    for p in range(1, 9):
        for m in range(p, 25):
            r = simulate(compile_schedule("zb-h1", p, m, costs=c), c)
            assert r.makespan == m * 3 + (p - 1) * 1, (p, m)
            assert r.mean_bubble == pytest.approx(theoretical_bubble("zb-h1", p, m, costs=c))


@pytest.mark.parametrize("f,b,w", [(1, 1, 0.5), (1, 1, 0.25), (1, 2, 0.5), (2, 1, 1), (3, 2, 1)])
def test_zb_h1_reaches_closed_form_for_non_uniform_costs(f: float, b: float, w: float) -> None:
    c = Costs(f, b, w)
    for p in range(2, 7):
        for m in (p, p + 1, 2 * p, 3 * p):
            r = simulate(compile_schedule("zb-h1", p, m, costs=c), c)
            assert r.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w)), (p, m)


SWEEP = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("forward", 1), ("forward", 2),
         ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2), ("zb-h2", 1), ("interleaved-zb", 2),
         ("v-half", 2), ("v-min", 2), ("dualpipev", 2)]
BUILT = ("gpipe", "1f1b", "zb-h1", "forward", "interleaved-1f1b")   # cheap to build: every m from 1 to 24


def _microbatches(name: str, pp: int) -> list[int]:
    """Every m from 1 to max(24, 4 pp) up to pp 5 (pp 3 for the synthesised and V schedules); beyond, the ones
    where warm-up, steady state and drain change shape (1, 2, 3, pp - 1 .. pp + 1, 2 pp - 1 .. 2 pp + 1, 3 pp,
    4 pp), to keep the suite's time."""
    if (name in BUILT and pp <= 5) or pp <= 3:
        return list(range(1, max(25, 4 * pp + 1)))
    return sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp, 4 * pp})


@pytest.mark.parametrize("pp", [pytest.param(pp, marks=[pytest.mark.slow] if pp >= 4 else []) for pp in range(1, 9)])
def test_every_builder_validates_and_simulates(pp: int) -> None:
    """Every built-in schedule at pp 1..8 over m up to 4 pp: complete, paired and deadlock-free (compile
    validates), simulated with uneven costs, and under the memory cap it was synthesised for. A background
    process started with the session checks them (tests/schedule/background.py); when it has not come to this pp
    within 60 s (a loaded machine), the test checks it in-process (about 5-10 s)."""
    found = background.result(pp, timeout=60)
    if found is False:
        background.check(pp)
    else:
        assert found is None, found


def _check_one(name: str, pp: int, m: int, v: int) -> None:
    if name == "interleaved-1f1b" and pp > 1 and m % pp:
        with pytest.raises(ValueError, match="multiple of pp"):
            build_schedule(name, pp, m, v)
        return
    s = compile_schedule(name, pp, m, v)
    if name in BUILT or m <= 2 * pp:
        validate(s)  # compile validated already; validating twice must be idempotent
    r = simulate(s, Costs(1.0, 2.0, 1.0, comm=0.5).per_chunk(v))
    n_compute = sum(1 for step in (x for prog in s.programs for x in prog) if step[0].kind.is_compute)
    split = len(s.split_backwards())   # backwards with a W; any other B is a full backward
    assert n_compute == pp * v * m * (1 if name == "forward" else 2) + split
    if name in ("gpipe", "1f1b", "interleaved-1f1b", "forward"):
        assert split == 0
    elif name != "dualpipev":
        assert split == pp * v * m   # zero-bubble schedules split every backward
    assert r.makespan > 0 and all(0.0 <= b < 1.0 for b in r.bubble)
    if name in SYNTHESISED:
        caps = synthesis_caps(name, pp, m, v)
        assert all(peak <= cap for peak, cap in zip(r.peak_in_flight, caps)), (name, pp, m, r.peak_in_flight)


@pytest.mark.parametrize("name,pp,m,v,match", [
    ("nope", 2, 2, 1, "unknown schedule 'nope'; choose one of gpipe"),
    ("1f1b", 0, 2, 1, "pp must be an integer >= 1"),
    ("1f1b", 2, 0, 1, "microbatches must be an integer >= 1"),
    ("1f1b", 2, 4, 2, "use interleaved-1f1b for several chunks"),
    ("interleaved-1f1b", 4, 6, 2, r"multiple of pp .*use microbatches=4 or 8"),
    ("interleaved-1f1b", 4, 8, 1, "needs chunks >= 2"),
])
def test_builder_errors_say_what_works(name: str, pp: int, m: int, v: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_schedule(name, pp, m, v)


@pytest.mark.parametrize("pp,m,suggestion", [
    (4, 2, "use microbatches=4, or the 1f1b"),      # 0 is no choice: only 4
    (3, 1, "use microbatches=3, or the 1f1b"),
    (3, 7, "use microbatches=6 or 9, or the 1f1b"),
    (4, 6, "use microbatches=4 or 8, or the 1f1b"),
    (4, 13, "use microbatches=12 or 16, or the 1f1b"),
])
def test_interleaved_suggests_distinct_valid_microbatches(pp: int, m: int, suggestion: str) -> None:
    with pytest.raises(ValueError, match="multiple of pp") as exc:
        build_schedule("interleaved-1f1b", pp, m, 2)
    assert suggestion in str(exc.value)
    build_schedule("interleaved-1f1b", 3, 9, 2)  # a multiple: no error


# (schedule, pp, m, makespan, peak microbatches per position or None): unit costs per position's share
# (f = b = w = 1, free comm). zbv, interleaved-zb and interleaved-1f1b are the figures of torch 2.14.1's own orders
# (ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, ScheduleInterleaved1F1B) replayed in this simulator:
# interleaved-zb holds torch's pp microbatches at its makespan (the greedy order under a larger cap held 7.5 / 15.5).
# DualPipeV's own order replayed gives 27.0 / 55.0 (pp 4 m 8 / pp 8 m 16), and 54.5 / 110.5 / 110.5 at pp 4 m 16 /
# pp 4 m 32 / pp 8 m 32 with our earlier lowerings; ours now reaches its data-dependency bound at all five (the
# batches of one witness time, ordered by when the peer is free: lower.py, [Note: batches by time]).
FIGURES = [("zbv", 4, 8, 25.5, 4.0), ("zbv", 8, 32, 99.5, 8.0), ("interleaved-zb", 8, 16, 51.5, 8.0),
           ("interleaved-zb", 4, 8, 25.5, 4.0), ("interleaved-zb", 4, 16, 49.5, 4.0),
           ("interleaved-1f1b", 8, 16, 58.5, 11.5), ("dualpipev", 4, 8, 25.5, 4.5), ("dualpipev", 8, 16, 51.5, 8.5),
           ("dualpipev", 4, 16, 49.5, 4.5), ("dualpipev", 4, 32, 97.5, 4.5), ("dualpipev", 8, 32, 99.5, 8.5),
           ("zb-h2", 8, 16, 55.0, None), ("zb-h2", 4, 8, 27.0, None),
           ("v-half", 4, 8, 28.0, 3.0), ("v-half", 8, 16, 62.5, 5.0), ("v-min", 4, 8, 35.0, 2.0),
           ("v-min", 8, 16, 66.5, 4.0)]


@pytest.mark.parametrize("name,pp,m,makespan,peak", FIGURES)
def test_makespans_and_peaks_with_unit_costs(name: str, pp: int, m: int, makespan: float, peak: float | None) -> None:
    """zb-h2 reaches the bound (pp - 1) f + m (f + b + w); v-half and v-min hold (pp + 2)//2 and (pp + 4)//3."""
    s = compile_schedule(name, pp, m)
    r = simulate(s, Costs().per_chunk(s.chunks))
    assert r.makespan == makespan
    if peak is not None:
        assert max(r.peak_in_flight) / s.chunks == peak
    if name == "v-half":
        assert peak == (pp + 2) // 2
    if name == "v-min":
        assert peak == (pp + 4) // 3


def test_v_placement_puts_the_loss_on_position_0_and_turns_locally() -> None:
    s = compile_schedule("zbv", 4, 8)
    assert [s.stage(p, c) for c in (0, 1) for p in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(s.placement(s.stage(p, c)) == (p, c) for p in range(4) for c in (0, 1))
    peers = [{a.peer for step in prog for a in step if not a.kind.is_compute} for prog in s.programs]
    assert peers == [{1}, {0, 2}, {1, 3}, {2}]   # stage 3 -> 4 never leaves position 3; 7 (the loss) is on 0
    again = parse_schedule(format_schedule(s))
    assert again.placement_kind == "v" and again.programs == s.programs
    validate(again)


def test_a_local_hand_off_in_the_wrong_order_is_refused() -> None:
    bad = parse_schedule("# placement=v\nF0 F0.1 B0.1 B0\nF0.1 F0 B0 B0.1\n")   # position 1 runs stage 2 before 1
    with pytest.raises(ScheduleError, match=r"F0.1 runs before F0, whose result it takes on this position"):
        validate(bad)


def test_a_b_without_its_w_is_the_full_backward() -> None:
    """W is optional per backward: B0 has none (full: b + w, frees its activation), B1 is split (b, then W1)."""
    s = parse_schedule("F0 B0 F1 B1 W1\n")
    assert s.split_backwards() == {(0, 1, 0)}
    r = simulate(s, Costs(1, 2, 3))
    assert [(a, b) for a, b, _ in r.intervals[0]] == [(0, 1), (1, 6), (6, 7), (7, 9), (9, 12)]
    assert r.peak_in_flight == [1]
    validate(compile_schedule("dualpipev", 2, 4))


def test_dualpipev_pairs_f_with_full_b_and_splits_at_the_ends() -> None:
    s = build_schedule("dualpipev", 4, 8)
    p0 = [str(a) for a in s.compute_actions(0)]
    # warm-up: 6 chunk-0 F's, a pair, 3 x (split B, W, F) on chunk 1; steady: F0.0 with full B1, F1 with full B0.0
    assert p0[:19] == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "F0.1", "B0.1", "W0.1", "F1.1", "B1.1", "W1.1",
                       "F2.1", "B2.1", "W2.1", "F3.1", "F7", "B3.1"]
    # drain: chunk-0 B's split from the middle of the last pairs on; every W after its B
    assert p0[-10:] == ["B3", "B7.1", "B4", "W4", "B5", "W5", "B6", "W6", "B7", "W7"]
    split = s.split_backwards()
    full = sum(1 for p in range(4) for a in s.compute_actions(p) if a.kind.value == "B"
               and (p, a.microbatch, a.chunk) not in split)
    assert (len(split), full) == (22, 42)   # of 64 backwards, most are full
