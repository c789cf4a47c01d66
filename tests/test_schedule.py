"""Schedules as data: golden tables, closed forms, sweeps, and broken schedules rejected."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pipeengine.schedule import (Action, Costs, DeadlockError, Schedule, ScheduleError,
                                 build_schedule, compile_schedule, format_schedule, lower, main,
                                 parse_schedule, simulate, theoretical_bubble, validate)

ASSETS = Path(__file__).parent / "assets"


def compute_rows(s: Schedule) -> list[str]:
    return [" ".join(str(a) for a in s.compute_actions(r)) for r in range(s.pp)]


# ------------------------------------------------------------------ golden tables

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
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1",   # rank 0 warms up 2(p-1) + (v-1)p = 4 = everything
        "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1",
    ]


def test_lowered_1f1b_pp2_m2_is_paired_and_batched() -> None:
    s = compile_schedule("1f1b", 2, 2)
    assert format_schedule(s).splitlines()[1:] == [
        "F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1 B0 recvB1<1 B1",
        "recvH0<0 recvF0<0 F0 recvF1<0 B0 sendB0>0 F1 B1 sendB1>0",
    ]


def test_text_fixture_matches_compiled_1f1b() -> None:
    text = (ASSETS / "1f1b_pp4_m8.txt").read_text()
    assert format_schedule(compile_schedule("1f1b", 4, 8)) == text
    parsed = parse_schedule(text)
    assert parsed.lowered and parsed.pp == 4 and parsed.microbatches == 8
    validate(parsed)
    assert parsed.programs == compile_schedule("1f1b", 4, 8).programs


@pytest.mark.parametrize("text", ["F0", "B12.3", "W7", "sendF3>1", "recvF3.2<0", "sendB0>4", "recvB1<2"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text,match", [
    ("X3", "cannot parse"), ("sendF3<1", "send points '>'"), ("F", "cannot parse")])
def test_action_parse_errors(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Action.parse(text)


# ------------------------------------------------------------------ closed forms

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


def test_peak_in_flight_1f1b_and_gpipe() -> None:
    for p, m in GRID:
        assert simulate(compile_schedule("1f1b", p, m), Costs()).peak_in_flight == [
            min(p - s, m) for s in range(p)]
        assert simulate(compile_schedule("gpipe", p, m), Costs()).peak_in_flight == [m] * p


# ------------------------------------------------------------------ sweep

SWEEP = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("forward", 1), ("forward", 2),
         ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)]


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_builder_validates_and_simulates(pp: int) -> None:
    for (name, v), m in itertools.product(SWEEP, range(1, 25)):
        if name == "interleaved-1f1b" and pp > 1 and m % pp:
            with pytest.raises(ValueError, match="multiple of pp"):
                build_schedule(name, pp, m, v)
            continue
        s = compile_schedule(name, pp, m, v)
        validate(s)  # compile validated already; validating twice must be idempotent
        r = simulate(s, Costs(1.0, 2.0, 1.0, comm=0.5).per_chunk(v))
        n_compute = sum(1 for step in (x for prog in s.programs for x in prog) if step[0].kind.is_compute)
        per_mb = 1 if name == "forward" else (3 if name == "zb-h1" else 2)
        assert n_compute == pp * v * m * per_mb
        assert r.makespan > 0 and all(0.0 <= b < 1.0 for b in r.bubble)


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


# ------------------------------------------------------------------ broken schedules

def test_backward_before_forward_is_rejected() -> None:
    s = parse_schedule("F0 B1 F1 B0\nF0 B0 F1 B1")
    with pytest.raises(ScheduleError, match=r"rank 0, step 1 \(B1\): B1 runs before F1") as exc:
        validate(s)
    assert ">>B1<<" in str(exc.value)


def test_missing_microbatch_is_rejected() -> None:
    s = parse_schedule("# pp=2 microbatches=2\nF0 F1 B0 B1\nF0 B0")
    with pytest.raises(ScheduleError, match="rank 1 never runs F1"):
        validate(s)


def test_link_order_mismatch_is_rejected() -> None:
    good = format_schedule(compile_schedule("1f1b", 2, 2)).splitlines()
    # rank 0 posts the send of microbatch 1 before that of microbatch 0 -> order differs on the link
    bad = good[1].replace("F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1", "F0 F1 sendH1>1 sendF1>1 sendF0>1+recvB0<1")
    s = parse_schedule("\n".join([bad, good[2]]))
    with pytest.raises(ScheduleError, match=r"link \(0, 1\) is not in paired order: op 0 is sendH1>1 on rank 0 "
                                            r"but recvH0<0 on rank 1"):
        validate(s)


def test_two_ranks_blocking_on_sends_is_a_deadlock_cycle() -> None:
    # rank 0 sends F1 before receiving B0, rank 1 sends B0 before receiving F1: each blocks on a
    # send to the other.
    dead = parse_schedule("F0 sendH0>1 sendF0>1 F1 sendF1>1 recvB0<1 B0 recvB1<1 B1\n"
                          "recvH0<0 recvF0<0 F0 B0 sendB0>0 recvF1<0 F1 B1 sendB1>0")
    with pytest.raises(ScheduleError, match=r"link \(0, 1\) is not in paired order: op 2 is sendF1>1"):
        validate(dead)  # the static pairing check sees it first
    with pytest.raises(DeadlockError) as exc:
        simulate(dead, Costs(), mode="rendezvous")
    assert exc.value.cycle == [0, 1]
    msg = str(exc.value)
    assert "deadlock: 0 -> 1 -> 0" in msg
    assert "rank 0 blocked at step 4 (sendF1>1) waiting for rank 1 to post recvF1<0" in msg
    assert "rank 1 blocked at step 4 (sendB0>0) waiting for rank 0 to post recvB0<1" in msg
    assert ">>sendF1>1<<" in msg and ">>sendB0>0<<" in msg
    with pytest.raises(DeadlockError) as exc2:  # one in-order comm queue per rank deadlocks too
        simulate(dead, Costs())
    assert exc2.value.cycle == [0, 1]
    assert "rank 0's comm queue is stuck at step 4 (sendF1>1)" in str(exc2.value)


def test_async_and_rendezvous_agree_without_waiting() -> None:
    # 1F1B with free comm: the async engine model and the strict model give the same makespan
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        s = compile_schedule("1f1b", p, m)
        assert simulate(s, Costs(1, 2, 0)).makespan == simulate(s, Costs(1, 2, 0), mode="rendezvous").makespan


def test_compute_order_deadlock_is_reported_as_cycle() -> None:
    s = parse_schedule("F0 B0 F1 B1\nF1 F0 B0 B1")
    with pytest.raises(DeadlockError, match="deadlock: 0 -> 1 -> 0") as exc:
        lower(s)
    assert "rank 0 waits at B0 for B0 on rank 1" in str(exc.value)
    assert "rank 1 waits at F1 for F1 on rank 0" in str(exc.value)


# ------------------------------------------------------------------ CLI

def test_cli_prints_timeline_and_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("rank 0 |F0 F1 F2 F3 ")
    assert "bubble (simulated)  0.273" in out and "bubble (theory)     0.273" in out
    assert "peak in flight      4 3 2 1" in out


@pytest.mark.parametrize("name,extra", [("gpipe", []), ("zb-h1", []), ("forward", []),
                                        ("interleaved-1f1b", ["--chunks", "2"])])
def test_cli_every_schedule(name: str, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schedule", name, *extra]) == 0
    assert "makespan" in capsys.readouterr().out


def test_cli_reports_deadlocked_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.txt"
    f.write_text("F0 B0 F1 B1\nF1 F0 B0 B1\n")
    assert main(["--file", str(f)]) == 1
    err = capsys.readouterr().err
    assert "deadlock: 0 -> 1 -> 0" in err
    assert main(["--file", str(tmp_path / "missing.txt")]) == 2


def test_cli_checks_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "ok.csv"
    f.write_text("F0,F1,B0,B1\nF0,B0,F1,B1\n")
    assert main(["--file", str(f), "--show-program"]) == 0
    assert "sendF0>1" in capsys.readouterr().out


def test_schedule_module_imports_no_torch() -> None:
    import subprocess
    import sys
    code = "import sys, pipeengine.schedule; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# ------------------------------------------------------------------ lowering with the run's costs

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


def test_cli_zb_h1_makespan_matches_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    # m(f+b+w) + (p-1)(f+b-w) = 8 * 2.5 + 3 * 1.5 = 24.5 (was 26 when lowered with unit costs)
    assert main(["--schedule", "zb-h1", "--pp", "4", "-m", "8", "--tw", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "makespan            24.5\n" in out
    assert "bubble (simulated)  0.184" in out and "bubble (theory)     0.184" in out


@pytest.mark.parametrize("f,b,w", [(1, 1, 0.5), (1, 1, 0.25), (1, 2, 0.5), (2, 1, 1), (3, 2, 1)])
def test_zb_h1_reaches_closed_form_for_non_uniform_costs(f: float, b: float, w: float) -> None:
    c = Costs(f, b, w)
    for p in range(2, 7):
        for m in (p, p + 1, 2 * p, 3 * p):
            r = simulate(compile_schedule("zb-h1", p, m, costs=c), c)
            assert r.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w)), (p, m)


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
    assert simulate(compile_schedule("interleaved-1f1b", 6, 18, 3, c), c).makespan == pytest.approx(130.5)
    z = build_schedule("zb-h1", 4, 8)
    assert lower(z, Costs(0.1, 0.2, 0.3)).programs == lower(z, Costs(1, 2, 3)).programs


def test_lower_accepts_per_rank_costs() -> None:
    slow = [Costs(), Costs(f=3, b=1, w=1), Costs(), Costs()]
    s = build_schedule("zb-h1", 4, 8)
    lowered = lower(s, slow)
    validate(lowered)
    assert simulate(s, slow).makespan == simulate(lowered, slow).makespan
    assert lowered.programs != lower(s).programs
    with pytest.raises(ValueError, match="got 2 per-rank costs for pp=4"):
        lower(s, [Costs(), Costs()])


# ------------------------------------------------------------------ interleaved suggestions

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


@pytest.mark.timeout(120)
def test_profile_cli_prints_measured_costs_and_every_schedules_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--profile", "mlp", "--preset", "tiny", "--pp", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")}
    assert set(rows) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}, out
    layers = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(layers) == 10   # mlp tiny: one row of costs per layer
    bounds = [int(b) for b in rows["1f1b"].split("[")[1].split("]")[0].split(",")]
    assert bounds[0] == 0 and bounds[-1] == 10 and len(bounds) == 3
    assert main(["--profile", "mlp", "--preset", "huge", "--pp", "2"]) == 2
    assert "not a mlp preset" in capsys.readouterr().err
