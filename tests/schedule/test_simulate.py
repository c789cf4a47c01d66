"""The simulator: the engine's semantics against the strictest one, and the in-flight peaks of the closed forms."""

from __future__ import annotations

import pytest

from pipeengine.schedule import Costs, compile_schedule, simulate
from tests.schedule.test_builders import GRID


def test_async_and_rendezvous_agree_without_waiting() -> None:
    # 1F1B with free comm: the async engine model and the strict model give the same makespan
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        s = compile_schedule("1f1b", p, m)
        assert simulate(s, Costs(1, 2, 0)).makespan == simulate(s, Costs(1, 2, 0), mode="rendezvous").makespan


def test_peak_in_flight_1f1b_and_gpipe() -> None:
    for p, m in GRID:
        assert simulate(compile_schedule("1f1b", p, m), Costs()).peak_in_flight == [
            min(p - s, m) for s in range(p)]
        assert simulate(compile_schedule("gpipe", p, m), Costs()).peak_in_flight == [m] * p


def test_microbatches_of_their_own_sizes() -> None:
    """``sizes``: microbatch k's computes and transfers take sizes[k] times the costs (ragged microbatches)."""
    one = compile_schedule("gpipe", 1, 3)
    assert simulate(one, Costs(1, 2, 0), sizes=[1, 2, 3]).makespan == 6 * 3
    sched = compile_schedule("1f1b", 4, 8)
    base = simulate(sched, Costs(1, 2, 0, comm=0.5))
    assert simulate(sched, Costs(1, 2, 0, comm=0.5), sizes=[1.0] * 8).makespan == base.makespan
    assert simulate(sched, Costs(1, 2, 0, comm=0.5), sizes=[2.0] * 8).makespan == 2 * base.makespan
    # one heavy microbatch: the step takes longer than with equal ones of the same total, by less than its excess
    heavy = simulate(sched, Costs(1, 2, 0, comm=0.5), sizes=[4.0] + [4 / 7] * 7).makespan
    assert base.makespan < heavy < base.makespan + 3 * (1 + 2) * 4
    with pytest.raises(ValueError, match="one number >= 0 per microbatch"):
        simulate(sched, Costs(), sizes=[1.0] * 7)
