"""ZeRO-1 (``shard_optimizer=True``): the same training as the unsharded engine, with 1/dp of its optimizer state.

Every case runs in NCCL-like strict mode next to its unsharded twin (equivalence.py, which also checks
both against single-process training): losses and parameters must be bitwise equal at dp 2 (the
reduce-scatter adds the same two numbers as the all-reduce); at dp 4 the sums may associate
differently, so they must agree to fp64 round-off and the largest difference is printed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from pipeengine.runtime.zero import boxes
from tests.runtime.equivalence import Case, case, check, run_case

TWO = {"chunks": 2}
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("zb-h2", {}), ("interleaved-1f1b", TWO),
             ("interleaved-zb", TWO), ("zbv", TWO), ("v-half", TWO), ("v-min", TWO), ("dualpipev", TWO)]
SMALL_BUCKETS = {"bucket_mb": 2e-4}   # several buckets, parameters cut across shards
CASES: list[Case] = [
    *[case("mlp", "adam" if k % 2 else "sgd", sched, 2, 2, 4, **opts, **SMALL_BUCKETS)
      for k, (sched, opts) in enumerate(SCHEDULES)],
    case("tied", "adam", "1f1b", 2, 2, 4), case("tied", "adam", "v-min", 2, 2, 4, **TWO),   # tie across / on a rank
    case("tuple", "adam", "1f1b", 2, 2, 4), case("mlp", "adam", "1f1b", 2, 2, 4, overlap_grad_sync=True),
    case("mlp", "adam", "1f1b", 2, 2, 4, precision="bf16"),
    # the all-gather waited for stage by stage before its first F, as on CUDA
    *[case("mlp", "adam", sched, 2, 2, 4, gather_in_background=True, **opts, **SMALL_BUCKETS)
      for sched, opts in (("1f1b", {}), ("interleaved-1f1b", TWO))],
    case("mlp", "adam", "1f1b", 1, 4, 4, **SMALL_BUCKETS), case("tied", "sgd", "gpipe", 1, 4, 4),
    case("mlp", "adam", "1f1b", 4, 2, 8, **SMALL_BUCKETS),
]


def _marks(c: Case) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if c.world == 8 else []


def _largest_difference(a: list[dict], b: list[dict]) -> float:   # type: ignore[type-arg]
    worst = 0.0
    for x, y in zip(a, b):
        worst = max([worst, *(abs(u - v) for u, v in zip(x["losses"], y["losses"]))])
        worst = max([worst, *((x["params"][k] - v).abs().max().item() for k, v in y["params"].items())])
    return worst


@pytest.mark.parametrize("c", [pytest.param(c, id=str(c), marks=_marks(c)) for c in CASES])
def test_sharded_optimizer_trains_as_the_unsharded_one(c: Case, request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(f"world{c.world}")
    plain, sharded = run_case(c, pool), run_case(c.but(shard_optimizer=True), pool)
    check(sharded, c)   # single-process training, the posted programs, every parameter present
    if c.dp == 2:
        for a, b in zip(plain, sharded):
            assert a["losses"] == b["losses"], (a["losses"], b["losses"])
            assert all(torch.equal(b["params"][k], v) for k, v in a["params"].items())
    else:
        diff = _largest_difference(plain, sharded)
        print(f"{c}: largest difference sharded - unsharded {diff:.3g}")
        assert diff < 1e-12, diff
    for a, b in zip(plain, sharded):   # 1/dp of the state (a shard's padding: under dp elements per bucket)
        buckets, per_element = b["buckets"][1], (16 if c.opt == "adam" else 8)
        assert a["state_bytes"] / c.dp <= b["state_bytes"] < a["state_bytes"] / c.dp + buckets * per_element, (
            a["state_bytes"], b["state_bytes"])


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 5), (2, 1, 3, 2), ()])
def test_boxes_cover_exactly_the_flattened_range(shape: tuple[int, ...]) -> None:
    rng = random.Random(sum(shape))
    n = math.prod(shape)
    for start, stop in [(0, n), *((a, rng.randint(a, n)) for a in (rng.randrange(n) for _ in range(40)))]:
        mark = torch.zeros(shape, dtype=torch.int64)
        found = boxes(shape, start, stop)
        for offsets, sizes in found:
            mark[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))] += 1
        flat = mark.reshape(-1)
        assert flat[start:stop].eq(1).all() and flat[:start].eq(0).all() and flat[stop:].eq(0).all(), (start, stop)
        assert len(found) <= max(1, 2 * len(shape) - 1), found


def _clipped(rank: int, world: int, shard: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import batch, mlp_layers, replica_iter
    torch.set_default_dtype(torch.float64)
    try:
        engine = PipelineEngine(mlp_layers(), nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                                topology=Topology(pp=2, dp=2), microbatches=2, grad_clip=0.01, wire="strict",
                                shard_optimizer=shard, bucket_mb=2e-4)
        norms = [engine.train_batch(replica_iter(batch, step, engine.replica, 2, 2)).grad_norm or 0.0
                 for step in range(3)]
        return norms, {k: v.detach().clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
    finally:
        torch.set_default_dtype(torch.float32)


def test_clipping_uses_the_global_norm_over_the_shards(world4) -> None:  # type: ignore[no-untyped-def]
    """Clipping active every step: the norm is summed from shards, equal to the unsharded one to round-off."""
    plain, sharded = world4.run(_clipped, False), world4.run(_clipped, True)
    for (norms_a, params_a), (norms_b, params_b) in zip(plain, sharded):
        assert all(n > 0.01 for n in norms_a), norms_a   # it clipped
        torch.testing.assert_close(torch.tensor(norms_b), torch.tensor(norms_a), rtol=1e-13, atol=0)
        for k, v in params_a.items():
            torch.testing.assert_close(params_b[k], v, rtol=1e-12, atol=1e-15)


def _lbfgs(rank: int, world: int) -> str:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import mlp_layers
    try:
        PipelineEngine(mlp_layers(), nn.functional.mse_loss, lambda ps: torch.optim.LBFGS(ps),
                       topology=Topology(pp=1, dp=2), shard_optimizer=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_optimizer_that_is_not_elementwise_is_refused(world2) -> None:  # type: ignore[no-untyped-def]
    for message in world2.run(_lbfgs):
        assert message.startswith("shard_optimizer (--zero 1) steps flat slices") and "LBFGS" in message, message
