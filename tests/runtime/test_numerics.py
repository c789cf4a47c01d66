"""Numerics at the end of a step: the signal vector's layout and its sum over the pipeline, non-finite reports, fp16's
dynamic loss scale."""

from __future__ import annotations

import math
import signal

import pytest
import torch

from pipeengine.runtime.consensus import Consensus
from pipeengine.runtime.faults import watch
from pipeengine.runtime.numerics import LossScale, SignalVector, nonfinite_message
from pipeengine.runtime.topology import Topology, build_groups
from tests.harness import WorldPool


def test_fp16_scaling_follows_overflows() -> None:
    scale = LossScale(enabled=True)
    scale.update(overflow=True)
    assert scale.value == 2.0**15 and scale.good_steps == 0
    for _ in range(2000):
        scale.update(overflow=False)
    assert scale.value == 2.0**16
    for _ in range(39):   # far below 1: overflows are still seen and skipped (a scale of 1 is no "off")
        assert scale.overflow(math.inf)
        scale.update(overflow=True)
    assert scale.value == 2.0**-23 and scale.overflow(math.inf) and not scale.overflow(3.0)
    scale.update(overflow=True)   # at the floor a non-finite gradient is non-finite: on_nonfinite decides
    assert scale.value == LossScale.FLOOR and not scale.overflow(math.inf)
    off = LossScale(enabled=False)
    off.update(overflow=True)
    assert off.value == 1.0


@pytest.mark.parametrize("outputs,grads", [((0, 0, 0, 0), (0, 0, 0, 0)), ((0, 1, 1, 0), (1, 0, 1, 0)),
                                           ((0, 0, 0, 0), (1, 0, 1, 0)), ((1, 0, 0, 0), (0, 0, 0, 0)),
                                           ((0, 0, 0, 3), (0, 0, 0, 2))])
def test_the_replicas_part_carries_the_origin_the_host_would_compute(outputs: tuple[int, ...],
                                                                     grads: tuple[int, ...]) -> None:
    """The origin is computed on the device (no host read before the replicas' all-reduce) as StepSignals does."""
    vec = SignalVector(4, 2, torch.device("cpu"))
    vec.set_loss(torch.tensor(1.25, dtype=torch.float64))
    vec.request_stop(signal.SIGTERM)
    for stage, (o, g) in enumerate(zip(outputs, grads)):
        vec.add_stage(stage, torch.tensor([math.inf if o else 0.0, math.nan if g else 1.0, 0.0], dtype=torch.float64))
    part = vec.replica_part(3, 1).tolist()
    origin = vec.decode(vec.tensor.tolist()).origin()
    assert part == [1.25, 0.0, 1.0, 0.0, 0.0, float(origin), 0.0], (part, origin)
    assert vec.replica_part(3, 1, origin=False).tolist() == [1.25, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]   # (not asked for)


def test_signal_vector_decodes_what_each_stage_added() -> None:
    vec = SignalVector(3, 4, torch.device("cpu"))
    vec.set_grad_sq(0, torch.tensor([4.0], dtype=torch.float64))
    vec.set_grad_sq(2, torch.tensor([2.0, 3.0], dtype=torch.float64))
    vec.set_loss(torch.tensor(2.5, dtype=torch.float64))
    vec.add_stage(1, torch.tensor([-math.inf, 2.0, math.nan], dtype=torch.float64))
    s = vec.decode(vec.tensor.tolist())
    assert (s.grad_sq, s.loss) == (9.0, 2.5)
    assert s.nonfinite_outputs == [0.0, 1.0, 0.0] and s.nonfinite_grads == [0.0, 0.0, 0.0]
    assert s.nonfinite_weights == [0.0, 1.0, 0.0] and s.origin() == 2   # stage 1's output: 1 + 1
    text = nonfinite_message(7, s, s.loss, math.inf, [0, s.origin()],
                             lambda st, r: f"layers of stage {st}, replica {r}")
    assert text.startswith("step 7: loss 2.5, gradient norm inf: the first non-finite forward output came from "
                           "stage 1 of replica 1 (layers of stage 1, replica 1)")


def test_a_stage_flags_nan_and_inf_but_not_a_large_finite_half_tensor() -> None:
    """The per-tensor sums the stage keeps carry a NaN, an inf and a -inf to its non-finite flag; a half-precision
    activation whose finite values add up beyond the half range (65504) is not taken for non-finite (the sum is
    accumulated in float32)."""
    from torch import nn

    from pipeengine.runtime.chain import LayerChain
    from pipeengine.runtime.stage import Stage
    ones = torch.ones(100_000, dtype=torch.float16)   # sums to 1e5: inf in half precision
    for bad, flagged in ((None, 0.0), (float("nan"), 1.0), (float("inf"), 1.0), (-float("inf"), 1.0)):
        stage = Stage(LayerChain([nn.Linear(2, 2)], 0), 1, 3, nn.functional.mse_loss, 1)
        x = ones.clone()
        if bad is not None:
            x[7] = bad
        stage._count_nonfinite(0, (x,))
        big = torch.full((2,), 1e38)
        stage._count_nonfinite(1, (big, big))   # two finite sums of 2e38: together beyond float32, not float64
        assert (~torch.isfinite(stage.step_sums())).tolist() == [bool(flagged), False], bad


def _summed(rank: int, world_size: int, pp: int) -> list[float]:
    """This rank's vector (a slot of its own, a NaN on rank 1, a count everyone adds to), summed over its pipeline."""
    topology = Topology(pp, world_size // pp)
    groups = build_groups(topology)
    consensus = Consensus(topology, rank, groups, pp, pp - 1, torch.device("cpu"),
                          lambda work, what, peers: work.wait(), watch())
    mine = torch.zeros(world_size + 2, dtype=torch.float64)
    mine[rank] = 0.1 * (rank + 1)
    mine[world_size] = math.nan if rank == 1 else 0.0
    mine[world_size + 1] = 1.0
    total = consensus._sum_over_pipeline(mine)
    if rank == consensus.root:   # the first position's receives posted ahead, as Consensus.expect does in a step
        consensus._early = consensus._receives(len(mine))
    again = consensus._sum_over_pipeline(mine)
    for group in (groups.pp_group, groups.dp_group):
        torch.distributed.destroy_process_group(group)
    return total.tolist() + again.tolist() + [len(consensus._early)]


@pytest.mark.parametrize("pp", [4, 2])
def test_the_pipelines_sum_is_exact_on_every_rank_and_stays_in_its_replica(world4: WorldPool, pp: int) -> None:
    """The end-of-step sum through the first position (pp 4 x dp 1, pp 2 x dp 2): every rank of a pipeline gets each
    slot's one value to the bit, the NaN and the count of its ranks, and nothing from the other replica."""
    results = world4.run(_summed, pp, timeout=60)
    topology = Topology(pp, 4 // pp)
    for rank, both in enumerate(results):
        got, again, left = both[:6], both[6:12], both[12]
        assert str(again) == str(got) and left == 0, (rank, both)   # posted ahead or at the end: the same sum, all used
        pipeline = topology.pp_group_ranks(topology.replica_of(rank))
        assert got[:4] == [0.1 * (r + 1) if r in pipeline else 0.0 for r in range(4)], (rank, got)
        assert math.isnan(got[4]) == (1 in pipeline) and got[5] == pp, (rank, got)
