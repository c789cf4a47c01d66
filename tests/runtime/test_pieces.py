"""Microbatch pieces: a memory budget may run each microbatch as 2 or 4 equal pieces ([Note: microbatch pieces] in
microbatches.py). The cut and the join, how the loss adds up over them, the pipeline trained on pieces against one
process on whole batches (a mean loss and a weighted sum), and a budget that chooses pieces over recompute."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.runtime.budget import HEADROOM
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.microbatches import loss_pieces, merged, pieces_of, read_microbatches
from pipeengine.runtime.twin import Host
from tests.runtime.equivalence import ATOL, GLOBAL_BATCH, OPTIMIZERS, RTOL, STEPS, batch, mlp_layers, train_alone

FREE = Host(per_step=0.0, per_post=0.0, post_bandwidth=float("inf"))
MICROBATCHES = 4


def test_a_microbatch_is_cut_along_its_rows_and_joined_back() -> None:
    tokens, segments = torch.arange(24).view(4, 6), torch.arange(4)
    labels, weight = torch.arange(24).view(4, 6) + 100, torch.tensor(0.25)
    parts = pieces_of(((tokens, segments), (labels, weight)), 2)
    assert len(parts) == 2
    assert torch.equal(parts[1][0][0], tokens[2:]) and torch.equal(parts[1][0][1], segments[2:])
    assert torch.equal(parts[0][1][0], labels[:2]) and parts[0][1][1] is weight   # a 0-d tensor goes to each piece
    joined = merged([p[0] for p in parts] + [p[0] for p in parts], 2)   # two microbatches' outputs, two pieces each
    assert len(joined) == 2 and all(torch.equal(j[0], tokens) and torch.equal(j[1], segments) for j in joined)
    with pytest.raises(ValueError, match=r"microbatch 1 of step 3 has 6 rows, but the memory budget's plan runs each "
                                         r"microbatch as 4 equal pieces along its rows: give microbatches whose rows "
                                         r"are a multiple of 4, or plan without pieces \(--whole-microbatches"):
        read_microbatches(iter([(torch.zeros(8, 2), torch.zeros(8)), (torch.zeros(6, 2), torch.zeros(6))]), 2,
                          torch.device("cpu"), 3, 0, pieces=4)
    x, t = read_microbatches(iter([(torch.ones(8, 2), torch.zeros(8)), (torch.zeros(8, 2), torch.ones(8))]), 2,
                             torch.device("cpu"), 0, 0, pieces=4)
    assert [len(v) for v in x] == [2] * 8 and torch.equal(torch.cat(t), torch.cat([torch.zeros(8), torch.ones(8)]))


def _weighted_sum(output: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """GPT's packed-rows convention: the sum over the real elements times a weight the target carries."""
    values, weight = target
    return ((output - values) ** 2).sum() * weight


def _token_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the real positions (-1 is padding): neither a mean over rows nor a sum when rows differ."""
    real = target >= 0
    return ((output - target) ** 2)[real].mean()


def test_the_profile_tells_a_mean_loss_from_a_sum_and_from_neither() -> None:
    out, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    assert loss_pieces(nn.functional.mse_loss, out, y) == {2: "mean", 4: "mean"}
    assert loss_pieces(_weighted_sum, out, (y, torch.tensor(0.01, dtype=torch.float64))) == {2: "sum", 4: "sum"}
    assert loss_pieces(nn.functional.mse_loss, out[:6], y[:6]) == {2: "mean"}   # 4 does not divide 6 rows
    padded = y.abs()
    padded[:4, 1:] = -1.0   # the first rows are mostly padding: their pieces' means weigh as much as the others'
    wrong = padded + torch.where(torch.arange(8)[:, None] < 4, 1.0, 3.0).double()   # errors 1, then 3
    assert loss_pieces(_token_mean, wrong, padded) == {}


def test_gpt_packed_rows_add_up_over_pieces() -> None:
    """The built-in GPT's loss on ragged rows (labels -100 at padding, a weight per step) is a weighted sum: its
    pieces add up to the whole, so a budget may cut its microbatches."""
    from pipeengine.models.gpt import loss_fn
    logits, labels = torch.randn(8, 12, 50), torch.randint(0, 50, (8, 12))
    labels[::3, 5:] = -100
    assert loss_pieces(loss_fn, logits, (labels, torch.tensor(0.02))) == {2: "sum", 4: "sum"}
    assert loss_pieces(loss_fn, logits, labels) == {}   # a plain target: a mean over the real tokens, not the rows'
    assert loss_pieces(loss_fn, logits, labels.clamp(min=0)) == {2: "mean", 4: "mean"}   # no padding: the rows' mean


def _reference(loss: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, float64, the whole batch: the step's loss is the microbatches' mean (or the weighted sums')."""
    return train_alone("adam", lambda net, x, y: nn.functional.mse_loss(net(x), y) if loss == "mean"
                       else _weighted_sum(net(x), (y, torch.tensor(1.0 / GLOBAL_BATCH))))


def _in_pieces(rank: int, world: int, schedule: str, pieces: int, loss: str) -> dict[str, Any]:
    """pp 2, each of 4 microbatches run as ``pieces``: the plan the budget would make, given whole."""
    from pipeengine.runtime.plan import make_plan
    from pipeengine.runtime.topology import Topology
    torch.set_default_dtype(torch.float64)
    try:
        fn = nn.functional.mse_loss if loss == "mean" else _weighted_sum
        plan = make_plan(mlp_layers(), 2, schedule=schedule, microbatches=MICROBATCHES * pieces)
        plan = dataclasses.replace(plan, pieces=pieces, piece_losses=loss)
        engine = PipelineEngine(mlp_layers(), fn, OPTIMIZERS["adam"], topology=Topology(pp=2, dp=1), plan=plan,
                                wire="strict")
        micro, losses = GLOBAL_BATCH // MICROBATCHES, []
        for step in range(STEPS):
            x, y = batch(step)
            # the weighted sum: each microbatch's weight makes the step's sum the whole batch's mean
            target = (lambda v: v) if loss == "mean" else (lambda v: (v, torch.tensor(MICROBATCHES / GLOBAL_BATCH)))
            mine = [(x[k * micro:(k + 1) * micro], target(y[k * micro:(k + 1) * micro])) for k in range(MICROBATCHES)]
            losses.append(engine.train_batch(iter(mine) if engine.needs_data else None).loss)
        params = {f"{engine.bounds[st.index] + j}.{k}": v.detach().clone() for st in engine.stages
                  for j, layer in enumerate(st.module.layers) for k, v in layer.state_dict().items()}
        engine.close()
        return {"losses": losses, "params": params, "microbatches": engine.microbatches}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("schedule, pieces, loss", [("1f1b", 2, "mean"), ("zbv", 4, "sum")])
def test_a_pipeline_of_pieces_trains_as_one_process(schedule: str, pieces: int, loss: str, world2: Any) -> None:
    ref_losses, ref_params = _reference(loss)
    seen: set[str] = set()
    for r in world2.run(_in_pieces, schedule, pieces, loss):
        assert r["microbatches"] == MICROBATCHES   # what the data iterator gives; the schedule runs 4 x pieces
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref_params[k], rtol=RTOL, atol=ATOL, msg=lambda e: f"{k}: {e}")
            seen.add(k)
    assert seen == set(ref_params)


def _budgeted(model: Any, data: list[tuple[torch.Tensor, torch.Tensor]], keep: float,
              **extra: Any) -> tuple[PipelineEngine, PipelineEngine]:
    """1F1B over ``data`` on one rank (one microbatch's activations held at a time), planned without a budget and
    with room for ``keep`` of its activations."""
    def engine(budget: float) -> PipelineEngine:
        return PipelineEngine(model(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                              schedule="1f1b", microbatches=len(data), partition="profile", sample=data[0],
                              memory_budget=budget, facts={"host": FREE, "runtime": 0.0}, **extra)
    free = engine(1e12)
    assert free.plan.pieces == 1 and free.plan.budget is not None
    peak = free.plan.budget.twin.memory[0]
    return free, engine((peak.total - (1 - keep) * peak.activations) / (1 - HEADROOM))


@pytest.mark.slow
def test_a_budget_runs_microbatches_as_pieces_rather_than_recompute(one_process_group: None) -> None:
    """Six Linear+GELU layers, four 1,024-row microbatches, room for half the activations: pieces of 512 rows keep
    the step's arithmetic (recompute would add a forward); the step's loss, weights and outputs are the whole
    microbatches' (up to the order of sums). Without pieces (``cut_microbatches=False``) no recompute fits it."""
    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)]
    data = [(torch.randn(1024, 256), torch.randn(1024, 256)) for _ in range(4)]
    free, tight = _budgeted(model, data, 0.5)
    assert tight.plan.pieces > 1 and tight.plan.recompute == ("none",) and tight.microbatches == 4
    assert tight.schedule.microbatches == 4 * tight.plan.pieces
    assert tight.plan.budget is not None and f"each microbatch run as {tight.plan.pieces} pieces" in \
        tight.plan.budget.describe()
    outputs = [e.eval_batch(iter(data), return_outputs=True).outputs for e in (free, tight)]
    assert len(outputs[1]) == 4 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*outputs))
    losses = [e.train_batch(iter(data)).loss for e in (free, tight)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(free.parameters, tight.parameters))
    for e in (free, tight):
        e.close()
    with pytest.raises(ValueError, match="no plan fits the memory budget of .* needs is"):   # recompute alone: no
        _budgeted(model, data, 0.5, cut_microbatches=False)


def test_a_model_with_batch_norm_is_never_cut(one_process_group: None) -> None:
    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.GELU()) for _ in range(4)]
    data = [(torch.randn(1024, 256), torch.randn(1024, 256)) for _ in range(4)]
    free, tight = _budgeted(model, data, 0.8)
    assert free.plan.measured[-1].loss_pieces == ((2, "mean"), (4, "mean"))   # the loss alone would allow it
    assert tight.plan.pieces == 1 and tight.plan.recompute != ("none",)
    for e in (free, tight):
        e.close()
