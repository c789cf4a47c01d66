"""The PP x DP grid: rank math without processes, and groups in one fixed order with them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeengine.runtime.topology import Topology, TopologyError, build_groups
from tests.harness import WorldPool


@pytest.mark.parametrize("order", ["position-major", "replica-major"])
def test_rank_math_round_trips_and_groups_partition_the_world(order: str) -> None:
    for pp in range(1, 5):
        for dp in range(1, 5):
            t = Topology(pp, dp, order)
            world = list(range(t.world_size))
            assert sorted(t.rank(t.position_of(r), t.replica_of(r)) for r in world) == world
            assert sorted(r for s in range(pp) for r in t.dp_group_ranks(s)) == world
            assert sorted(r for d in range(dp) for r in t.pp_group_ranks(d)) == world
            for r in world:
                nxt = t.next_rank(r)
                assert (nxt is None) == t.is_last_position(r)
                if nxt is not None:
                    assert t.prev_rank(nxt) == r and t.replica_of(nxt) == t.replica_of(r)


def test_position_major_dp_groups_are_contiguous() -> None:
    t = Topology(pp=4, dp=2)
    assert [t.dp_group_ranks(s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.pp_group_ranks(1) == [1, 3, 5, 7]
    assert Topology(4, 2, "replica-major").pp_group_ranks(1) == [4, 5, 6, 7]


def test_describe() -> None:
    assert Topology(2, 2, "stage-major") == Topology(2, 2)   # the order's name before the glossary
    assert Topology(2, 2).describe() == ("pp=2 x dp=2 = 4 ranks (position-major)\n"
                                         "             r0 r1\n"
                                         "position 0    0  1\n"
                                         "position 1    2  3")


@pytest.mark.parametrize("call,match", [
    (lambda: Topology.from_world(6, pp=4), r"world size 6 is not divisible by pp=4; use pp in \[1, 2, 3, 6\]"),
    (lambda: Topology.from_world(8, pp=2, dp=2), r"pp=2 x dp=2 = 4 ranks, but the world has 8"),
    (lambda: Topology(0, 1), r"pp must be an integer >= 1 \(got 0\)"),
    (lambda: Topology(2, 1, "diagonal"), r"order must be one of"),
    (lambda: Topology(2, 2).rank(2, 0), r"position 2 is outside 0..1"),
    (lambda: Topology(2, 2).position_of(4), r"rank 4 is outside 0..3"),
])
def test_errors_name_the_numbers(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TopologyError, match=match):
        call()


def test_from_world_defaults() -> None:
    assert Topology.from_world(8) == Topology(8, 1)
    assert Topology.from_world(8, pp=4) == Topology(4, 2)
    assert Topology.from_world(8, dp=4) == Topology(2, 4)


def sums(rank: int, world: int) -> tuple[float, float, float]:
    g = build_groups(Topology(2, 2), ties=[(0, 1)])
    out = []
    for group in (g.dp_group, g.pp_group, g.tie_groups[(0, 1)]):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out.append(float(t))
    return out[0], out[1], out[2]


@pytest.mark.timeout(60)
def test_build_groups_reduces_inside_the_right_ranks(world4: WorldPool) -> None:
    results = world4.run(sums, timeout=50)
    t = Topology(2, 2)
    for r, (dp_sum, pp_sum, tie_sum) in enumerate(results):
        assert dp_sum == sum(t.dp_group_ranks(t.position_of(r)))
        assert pp_sum == sum(t.pp_group_ranks(t.replica_of(r)))
        assert tie_sum == pp_sum  # the tie spans both positions of this replica


def test_rank_math_needs_no_torch() -> None:
    """The trainer's config resolves the grid before torch is imported (--help and bad flags stay fast)."""
    import subprocess
    import sys
    code = ("import sys; from pipeengine.runtime.topology import Topology; Topology.from_world(8, pp=4); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
