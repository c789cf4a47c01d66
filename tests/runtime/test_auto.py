"""``--schedule auto``: never slower in simulation than the best library schedule, never over the cap, above its
bound."""

from __future__ import annotations

import pytest

from benchmarks.planner import profile_costs, stage_costs
from pipeengine.runtime.auto import LIBRARY, auto_schedule, fill_bound, lower_bound
from pipeengine.runtime.planner import LayerCost, PartitionError, choose_bounds
from pipeengine.schedule import Costs, compile_schedule, simulate, validate


@pytest.mark.parametrize("profile", ["uniform 48", "head x6, 48", "MoE-like alternating x1/x2, 48"])
def test_auto_is_never_slower_than_the_library_and_never_below_its_bound(profile: str) -> None:
    costs = profile_costs(profile)
    choice = auto_schedule(costs, 4, 8)
    validate(choice.schedule)
    library = [t for name, t in choice.candidates.items() if t is not None and not name.startswith("synth")]
    assert len(library) == len(LIBRARY) == 9 and choice.makespan <= min(library)
    stage = [Costs(*c) for c in choice.stage_costs]
    assert simulate(choice.schedule, stage).makespan == choice.makespan
    assert choice.bound <= choice.makespan and choice.gap >= 1.0
    assert choice.bound == lower_bound(choice.stage_costs, choice.schedule, 8)
    assert "lower bound" in choice.describe()
    assert choice.bound <= choice.fill <= choice.makespan and choice.fill_gap <= choice.gap


@pytest.mark.parametrize("profile", ["head x6, 48", "random +-50% #1, 82", "one huge layer (x10) first, 82"])
def test_the_fill_bound_is_below_every_schedule_of_its_split_and_tight_for_zbv_and_zb_h2(profile: str) -> None:
    costs = profile_costs(profile)
    for name, chunks in LIBRARY:
        sched = compile_schedule(name, 4, 8, chunks)
        n = sched.num_stages
        bounds = [round(k * len(costs) / n) for k in range(n + 1)]   # an equal-count split
        stage = [(c.f, c.b, c.w) for c in stage_costs(costs, sched, bounds)]
        makespan = simulate(sched, [Costs(*c, comm=0.1) for c in stage]).makespan
        assert lower_bound(stage, sched, 8, 0.1) <= fill_bound(stage, sched, 8, 0.1) <= makespan + 1e-9, name
    for name, pp, m, want in (("zbv", 8, 32, 99.5), ("zb-h2", 8, 16, 55.0), ("zb-h1", 4, 8, 27.0)):
        sched = compile_schedule(name, pp, m)
        unit = Costs().per_chunk(sched.chunks)
        stage = [(unit.f, unit.b, unit.w)] * sched.num_stages
        assert lower_bound(stage, sched, m) < fill_bound(stage, sched, m) == simulate(sched, unit).makespan == want


def test_auto_keeps_under_the_memory_cap() -> None:
    costs = [LayerCost(1, 1, 1, 2, 1000, 100) for _ in range(16)]
    free = auto_schedule(costs, 4, 8)
    # room for 4 stage activations of 4 layers (4000 bytes each) beside the state of 4 layers (4 x 4 x 100)
    capped = auto_schedule(costs, 4, 8, memory_cap=4 * 400 + 4 * 4000)
    assert capped.makespan >= free.makespan
    assert capped.candidates["zb-h2"] is None   # holds up to 2pp - 1 microbatches: over the cap
    assert capped.candidates["interleaved-zb"] is not None   # pp, as 1F1B's first position: under it
    assert max(capped.memory) <= 4 * 400 + 4 * 4000 < max(free.memory)
    with pytest.raises(PartitionError, match="no schedule fits"):
        auto_schedule(costs, 4, 8, memory_cap=100)


def test_a_synthesised_order_can_win_and_without_a_cap_holds_no_more_than_zb_h2() -> None:
    """The greedy order is lowered both ways (lower.py, [Note: batches by time]) under two caps; with random layer
    costs it beats every library schedule, holding at most zb-h2's 2pp - 1 microbatches per position."""
    choice = auto_schedule(profile_costs("random +-50% #0, 82"), 4, 32)
    library = min(t for name, t in choice.candidates.items() if t is not None and not name.startswith("synth"))
    assert choice.schedule.name.startswith("synthesised-") and choice.makespan < library
    said = choice.describe().splitlines()[0]   # what it built, in words, and by how much it beats the library
    assert said.startswith("schedule auto: a synthesised order (placement ") and "shorter than the best library " \
        "schedule" in said, said
    validate(choice.schedule)
    peaks = simulate(choice.schedule, [Costs(*c) for c in choice.stage_costs]).peak_in_flight
    assert max(peaks) <= choice.schedule.chunks * (2 * 4 - 1)


def test_microbatches_of_their_own_sizes_are_planned_with_their_sizes() -> None:
    """Ragged microbatches (one four times the measured size, three a quarter): auto simulates every candidate with
    their sizes and picks another schedule than for equal ones, one that is faster on them; its bounds stay bounds.
    The planner alone: sizes all c give the same split and c times the step."""
    costs = profile_costs("uniform 48")
    sizes = [4.0, 0.25, 0.25, 0.25]
    equal, ragged = auto_schedule(costs, 2, 4), auto_schedule(costs, 2, 4, sizes=sizes)
    assert equal.winner == "dualpipev" and ragged.winner != equal.winner
    on_them = [simulate(c.schedule, [Costs(*s) for s in c.stage_costs], sizes=sizes).makespan
               for c in (equal, ragged)]
    assert on_them[1] == ragged.makespan < on_them[0]
    assert ragged.bound <= ragged.fill <= ragged.makespan
    assert ragged.bound == lower_bound(ragged.stage_costs, ragged.schedule, 4, sizes=sizes) > equal.bound
    sched = compile_schedule("1f1b", 4, 8)
    one, doubled = choose_bounds(costs, sched), choose_bounds(costs, sched, sizes=[2.0] * 8)
    assert doubled.bounds == one.bounds and doubled.makespan == 2 * one.makespan
