"""The validator: broken schedules are rejected with the position, the step and the picture."""

from __future__ import annotations

import pytest

from pipeengine.schedule import (Costs, DeadlockError, Kind, ScheduleError, compile_schedule, format_schedule,
                                 parse_schedule, simulate, validate)


def test_backward_before_forward_is_rejected() -> None:
    s = parse_schedule("F0 B1 F1 B0\nF0 B0 F1 B1")
    with pytest.raises(ScheduleError, match=r"position 0, step 1 \(B1\): B1 runs before F1") as exc:
        validate(s)
    assert ">>B1<<" in str(exc.value)


def test_missing_microbatch_is_rejected() -> None:
    s = parse_schedule("# pp=2 microbatches=2\nF0 F1 B0 B1\nF0 B0")
    with pytest.raises(ScheduleError, match="position 1 never runs F1"):
        validate(s)


def test_link_order_mismatch_is_rejected() -> None:
    good = format_schedule(compile_schedule("1f1b", 2, 2)).splitlines()
    # rank 0 posts the send of microbatch 1 before that of microbatch 0 -> order differs on the link
    bad = good[1].replace("F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1", "F0 F1 sendH1>1 sendF1>1 sendF0>1+recvB0<1")
    s = parse_schedule("\n".join([bad, good[2]]))
    with pytest.raises(ScheduleError, match=r"link \(0, 1\) is not in paired order: op 0 is sendH1>1 at position 0 "
                                            r"but recvH0<0 at position 1"):
        validate(s)


def test_two_positions_blocking_on_sends_is_a_deadlock_cycle() -> None:
    # position 0 sends F1 before receiving B0, position 1 sends B0 before receiving F1: each blocks on a
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
    assert "position 0 blocked at step 4 (sendF1>1) waiting for position 1 to post recvF1<0" in msg
    assert "position 1 blocked at step 4 (sendB0>0) waiting for position 0 to post recvB0<1" in msg
    assert ">>sendF1>1<<" in msg and ">>sendB0>0<<" in msg
    with pytest.raises(DeadlockError) as exc2:  # one in-order comm queue per rank deadlocks too
        simulate(dead, Costs())
    assert exc2.value.cycle == [0, 1]
    assert "position 0's comm queue is stuck at step 4 (sendF1>1)" in str(exc2.value)


OUT_OF_ORDER = (   # position 0 waits for B0 before sending F1; position 1 waits for F1 before sending B0
    "F0 sendH0>1 sendF0>1 F1 recvB0<1 sendF1>1 B0 recvB1<1 B1\n"
    "recvH0<0 recvF0<0 F0 B0 recvF1<0 sendB0>0 F1 B1 sendB1>0")
# a hand-written schedule file: not what compile_schedule lowers, but valid (the validator proves it)
HAND_WRITTEN = (
    "F0 sendH0>1 sendF0>1 F1 sendF1>1+recvB0<1 B0 recvB1<1 B1\n"
    "recvH0<0 recvF0<0 F0 recvF1<0 B0 sendB0>0 F1 B1 sendB1>0")


def test_a_hand_written_order_is_proven_and_an_unpaired_one_rejected() -> None:
    validate(parse_schedule(HAND_WRITTEN))
    with pytest.raises(ScheduleError, match=r"link \(0, 1\) is not in paired order: op 2 is recvB0<1 at position 0 "
                                            r"but recvF1<0 at position 1"):
        validate(parse_schedule(OUT_OF_ORDER))


def test_a_schedule_without_headers_is_rejected() -> None:
    sched = compile_schedule("1f1b", 2, 2)
    sched.programs = [[st for st in prog if st[0].kind not in (Kind.SEND_H, Kind.RECV_H)] for prog in sched.programs]
    with pytest.raises(ScheduleError, match=r"sendF0>1 has no header before it: the first transfer of a stream needs "
                                            r"sendH0>1 in a step of its own before it"):
        validate(sched)
