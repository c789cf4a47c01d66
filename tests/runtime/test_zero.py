"""ZeRO-1 (``shard_optimizer=True``): the same training as the unsharded engine, with 1/dp of its optimizer state.

Every case runs in NCCL-like strict mode next to its unsharded twin (equivalence.py, which also checks
both against single-process training): losses and parameters must be bitwise equal at dp 2 (the
reduce-scatter adds the same two numbers as the all-reduce); at dp 4 the sums may associate
differently, so they must agree to fp64 round-off and the largest difference is printed.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any

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
    by_stages: dict[tuple[int, ...], list[tuple[int, int]]] = {}   # the replicas of a position: 1/dp of the state each
    for a, b in zip(plain, sharded):
        by_stages.setdefault(tuple(b["stages"]), []).append((a["state_bytes"], b["state_bytes"]))
    for stages, parts in by_stages.items():
        whole = parts[0][0]
        assert sum(s for _, s in parts) == whole, (stages, parts)   # every element's state held once
        per_element, buckets = (16 if c.opt == "adam" else 8), sharded[0]["buckets"][1]
        assert all(s < whole / c.dp + buckets * per_element for _, s in parts), (stages, parts)   # padding apart


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


def _bf16_head(rank: int, world: int) -> str:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import mlp_layers
    layers = mlp_layers()
    layers[-1].to(torch.bfloat16)   # only the last position's parameters: the refusal still reaches every rank
    try:
        PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps),
                       topology=Topology(pp=2, dp=2), shard_optimizer=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_optimizer_that_is_not_elementwise_and_bf16_parameters_are_refused(  # type: ignore[no-untyped-def]
        world2, world4) -> None:
    for message in world2.run(_lbfgs):
        assert message.startswith("shard_optimizer (--zero 1) steps flat slices") and "LBFGS" in message, message
    for message in world4.run(_bf16_head):
        assert "torch.bfloat16" in message and "--precision bf16" in message and len(message.splitlines()) == 1, \
            message


# ------------------------------------------------------------------ the loop idioms users write

def _idiom_layers() -> list[Any]:
    """Factories: parameterless layers (ReLU, Identity, Tanh as layers of their own), a frozen bias, a weight the
    user's optimizer leaves out (marked ``left_out``), and a last stage without parameters at pp 2."""
    def frozen_bias() -> nn.Module:
        layer = nn.Linear(8, 8)
        layer.bias.requires_grad_(False)
        return layer

    def left_out() -> nn.Module:
        layer = nn.Linear(8, 8)
        layer.weight.left_out = True   # type: ignore[attr-defined]
        return layer

    return [lambda: nn.Linear(8, 8), nn.ReLU, frozen_bias, nn.Identity, nn.Tanh, left_out, nn.Tanh,
            lambda: nn.Linear(8, 8), lambda: nn.Linear(8, 1), nn.Identity]


def _user_optimizer(ps: list[nn.Parameter], cls: Any = torch.optim.AdamW) -> torch.optim.Optimizer:
    """Decay and no-decay groups, as users write them; a parameter marked ``left_out`` in neither. (Adagrad makes
    its state in its constructor: the sharded optimizer keeps each part's share of it.)"""
    kept = [p for p in ps if not getattr(p, "left_out", False)]
    return cls([{"params": [p for p in kept if p.ndim > 1], "weight_decay": 0.1},
                {"params": [p for p in kept if p.ndim <= 1], "weight_decay": 0.0, "lr": 0.05}], lr=0.01)


def _idioms(rank: int, world: int, pp: int, shard: bool, adagrad: bool = False) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import batch, replica_iter
    torch.set_default_dtype(torch.float64)
    try:
        dp, m = world // pp, 2
        factory = functools.partial(_user_optimizer, cls=torch.optim.Adagrad) if adagrad else _user_optimizer
        engine = PipelineEngine(_idiom_layers(), nn.functional.mse_loss, factory,
                                topology=Topology(pp=pp, dp=dp), microbatches=m, wire="strict", bucket_mb=2e-4,
                                partition=[0, 9, 10] if pp == 2 else "parameters", shard_optimizer=shard)
        opt = engine.optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        start = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
        losses = []
        for step in range(4):
            opt.zero_grad(set_to_none=step % 2 == 0)   # the first line of every PyTorch loop, both ways
            if step == 2:   # hyperparameters changed by hand take effect at the next step
                opt.param_groups[0]["weight_decay"] = 0.3
                opt.param_groups[1]["lr"] *= 0.5
            data = replica_iter(batch, step, engine.replica, dp, m) if engine.needs_data else None
            losses.append(engine.train_batch(data).loss)
            scheduler.step()
        saved = opt.state_dict()
        engine.train_batch(replica_iter(batch, 4, engine.replica, dp, m) if engine.needs_data else None)
        opt.load_state_dict(saved)   # round trip: the state of step 4 again
        again = opt.state_dict()
        round_trip = all(torch.equal(again["state"][i][k], v) if isinstance(v, torch.Tensor)
                         else again["state"][i][k] == v for i, st in saved["state"].items() for k, v in st.items())
        params = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("layers.")}
        return {"losses": losses, "params": params, "start": start, "round_trip": round_trip,
                "groups": [(len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups],
                "same_object": all(isinstance(p, nn.Parameter) for g in opt.param_groups for p in g["params"])}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("pp, world, adagrad", [(1, 2, False), (2, 4, False), (1, 4, False), (1, 2, True)],
                         ids=["pp1dp2", "pp2dp2-a-stage-without-parameters", "pp1dp4", "pp1dp2-adagrad"])
def test_the_loops_users_write_train_sharded_as_unsharded(pp: int, world: int, adagrad: bool,
                                                          request: pytest.FixtureRequest) -> None:
    """zero_grad both ways, an LR scheduler, hyperparameters changed by hand, decay / no-decay groups, a weight left
    out of every group, a frozen bias, layers without parameters (a whole stage of them at pp 2): the user's own
    optimizer object, sharded, trains as unsharded (bitwise at dp 2, fp64 round-off at dp 4)."""
    pool = request.getfixturevalue(f"world{world}")
    plain, sharded = pool.run(_idioms, pp, False, adagrad), pool.run(_idioms, pp, True, adagrad)
    for a, b in zip(plain, sharded):
        assert b["same_object"] and b["groups"] == a["groups"], (a["groups"], b["groups"])
        assert b["round_trip"] and a["round_trip"]
        moved = {k for k, v in a["params"].items() if not torch.equal(v, a["start"][k])}
        assert "layers.5.weight" not in moved and "layers.2.bias" not in moved   # left out, frozen: never stepped
        assert {k for k in a["params"] if k.startswith(("layers.0.", "layers.7.", "layers.8."))} <= moved
        if world // pp == 2:
            assert a["losses"] == b["losses"], (a["losses"], b["losses"])
            assert all(torch.equal(b["params"][k], v) for k, v in a["params"].items())
        else:
            torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=0, atol=1e-12)
            for k, v in a["params"].items():
                torch.testing.assert_close(b["params"][k], v, rtol=0, atol=1e-12)


def _parameterless_stage(rank: int, world: int, shard: bool) -> list[float]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import batch, replica_iter
    engine = PipelineEngine(_idiom_layers(), nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                            topology=Topology(pp=2, dp=world // 2), microbatches=2, partition=[0, 9, 10],
                            shard_optimizer=shard)
    return [engine.train_batch(replica_iter(batch, step, engine.replica, world // 2, 2) if engine.needs_data
                               else None).loss for step in range(2)]


def test_a_stage_without_parameters_takes_the_plain_optimizer_factory(  # type: ignore[no-untyped-def]
        world2, world4) -> None:
    """``lambda ps: AdamW(ps)`` on a rank whose stage holds only an Identity: torch refuses an empty list, the
    engine gives it a placeholder; unsharded at dp 1 and sharded at dp 2 train alike."""
    alone, sharded = world2.run(_parameterless_stage, False), world4.run(_parameterless_stage, True)
    assert alone[0] == alone[1] and sharded[0] == sharded[-1]
    torch.testing.assert_close(torch.tensor(sharded[0]), torch.tensor(alone[0]), rtol=1e-6, atol=0)
