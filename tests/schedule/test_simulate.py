"""The simulator: the engine's semantics against the strictest one, and the in-flight peaks of the closed forms."""

from __future__ import annotations

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
