"""``--schedule auto``: never slower in simulation than the best library schedule, never over the cap, above its
bound."""

from __future__ import annotations

import pytest

from benchmarks.planner import profile_costs
from pipeengine.runtime.auto import LIBRARY, auto_schedule, lower_bound
from pipeengine.runtime.planner import LayerCost, PartitionError
from pipeengine.schedule import Costs, simulate, validate


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


def test_auto_keeps_under_the_memory_cap() -> None:
    costs = [LayerCost(1, 1, 1, 2, 1000, 100) for _ in range(16)]
    free = auto_schedule(costs, 4, 8)
    # room for 4 stage activations of 4 layers (4000 bytes each) beside the state of 4 layers (4 x 4 x 100)
    capped = auto_schedule(costs, 4, 8, memory_cap=4 * 400 + 4 * 4000)
    assert capped.makespan >= free.makespan
    for name, t in capped.candidates.items():
        if name in ("zb-h2", "interleaved-zb"):   # hold up to 2pp-1 or more microbatches: over the cap
            assert t is None, name
    assert max(capped.memory) <= 4 * 400 + 4 * 4000 < max(free.memory)
    with pytest.raises(PartitionError, match="no schedule fits"):
        auto_schedule(costs, 4, 8, memory_cap=100)
