"""Shrinking to whatever world survives: every world gets a runnable layout (pp, dp, the global batch split), or one
line saying why none exists."""

from __future__ import annotations

import math

import pytest

from pipeengine.training.batch import resume_batch, split_global_batch
from pipeengine.training.elastic import HEADROOM, ModelState, replan_pp

GIB = 2**30
# a 7B-like model in fp32: embedding, 32 blocks of 202 M parameters, head; AdamW; a rank has 80 GiB
SEVEN_B = ModelState([131_000_000 * 4] + [202_000_000 * 4] * 32 + [131_000_000 * 4], optimizer_states=2)
CAPACITY = 80 * GIB


def _runnable(world: int, asked: int, state: ModelState, capacity: float) -> tuple[int, str] | str:
    try:
        return replan_pp(world, asked, 1, state, capacity)
    except ValueError as exc:
        return str(exc)


def _fits(d: int, world: int, asked: int, state: ModelState, capacity: float) -> bool:
    return (world % d == 0 and d <= len(state.layer_bytes)
            and (d > asked or state.per_rank(d, world // d) <= HEADROOM * capacity))


@pytest.mark.parametrize("asked", [2, 4, 8])
def test_every_world_from_1_to_64_gets_a_layout_or_one_line(asked: int) -> None:
    """The property: the pp chosen divides the world, fits the layers and the memory, and no fitting divisor is
    nearer to --pp; a world --pp divides keeps it; the global batch then splits over dp, evenly or not."""
    laid_out, refused = [], []
    for world in range(1, 65):
        got = _runnable(world, asked, SEVEN_B, CAPACITY)
        if isinstance(got, str):
            assert "\n" not in got and f"{world} processes fit no pipeline" in got, got
            assert not any(_fits(d, world, asked, SEVEN_B, CAPACITY) for d in range(1, world + 1)), (world, got)
            refused.append(world)
            continue
        pp, why = got
        assert _fits(pp, world, asked, SEVEN_B, CAPACITY), (world, pp)
        assert world % asked or pp == asked
        nearer = [d for d in range(1, world + 1) if _fits(d, world, asked, SEVEN_B, CAPACITY)
                  and abs(math.log(d / asked)) < abs(math.log(pp / asked))]
        assert not nearer, (world, pp, nearer)
        assert why.startswith(f"elastic: {world} processes: pp {pp} x dp {world // pp}") and "\n" not in why
        dp = world // pp
        batch = resume_batch(dp, split_global_batch(8, None, None, None, pp=asked), None, None, None, pp=pp)[0]
        assert sum(batch.counts(dp)) * batch.micro == batch.size and min(batch.counts(dp)) >= 1
        laid_out.append(world)
    print(f"--pp {asked}: {len(laid_out)} of 64 worlds laid out, refused {refused}")
    assert len(laid_out) >= 50   # only worlds whose divisors are all too deep or too shallow are refused


@pytest.mark.parametrize("world, want", [(1016, (8, 127)), (1000, (8, 125)), (999, (9, 111)), (1024, (8, 128))])
def test_a_1024_gpu_job_at_pp_8_losing_gpus(world: int, want: tuple[int, int]) -> None:
    pp, why = replan_pp(world, 8, 1, SEVEN_B, CAPACITY)
    assert (pp, world // pp) == want, why
    batch = resume_batch(world // pp, split_global_batch(128, None, None, None, pp=8), None, None, None, pp=pp)[0]
    assert batch.size == 2048 and min(batch.counts(world // pp)) >= 1   # the global batch of the 1024-GPU run


def test_a_shallower_pipeline_is_taken_only_when_a_rank_can_hold_it() -> None:
    tiny = ModelState([4 * 2**20] * 8)   # 32 MiB: any pp fits
    assert replan_pp(7, 4, 1, tiny, CAPACITY)[0] == 7 and replan_pp(6, 4, 1, tiny, CAPACITY)[0] == 3
    pp, why = replan_pp(6, 4, 2, tiny, CAPACITY)   # 2 stages per position: 8 layers allow at most pp 4
    assert pp == 3 and "no deeper one fits the model's 8 layers" in why
    with pytest.raises(ValueError, match=r"elastic: 37 processes fit no pipeline: --pp 4 does not divide 37; .*\(pp 1 "
                                         r"would hold an estimated .* GiB of model state per rank.*; restart on a "
                                         r"multiple of 4 processes \(36\)"):
        replan_pp(37, 4, 1, SEVEN_B, CAPACITY)   # 37 is prime, deeper than the 34 layers
