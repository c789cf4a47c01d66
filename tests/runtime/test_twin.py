"""The twin (step time and memory per position, predicted) and the memory budget it plans to: arithmetic only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.runtime.budget import HEADROOM, fit_budget
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.measured import LayerCost
from pipeengine.runtime.options import SELECTIVE
from pipeengine.runtime.planner import PartitionError
from pipeengine.runtime.twin import BACKWARD_SET, Host, predict, stage_costs, stage_memory
from pipeengine.schedule import Costs, Kind, Schedule, compile_schedule, simulate

MB = 2**20
FREE = Host(per_step=0.0, per_post=0.0, post_bandwidth=float("inf"))


def layers(n: int = 8, kept: int = 3 * MB, out: int = MB, params: int = 4 * MB, host: float = 0.0) -> list[LayerCost]:
    """``n`` alike layers: 1 ms F, 2 ms fused backward (1 + 1 split), ``kept`` bytes saved beside their output."""
    return [LayerCost(1e-3, 1e-3, 1e-3, 2e-3, kept + out, params, output_bytes=out, host=(host, host, host, 2 * host))
            for _ in range(n)]


def awaiting_w(schedule: Schedule) -> dict[int, int]:
    """Per stage, the peak count of microbatches between their B and their W (split backward only): each keeps the
    gradients of its layers' outputs for W beside its activations."""
    split = schedule.split_backwards()
    out = {s: 0 for s in range(schedule.num_stages)}
    for p in range(schedule.pp):
        held = [0] * schedule.chunks
        for a in schedule.compute_actions(p):
            if a.kind is Kind.B and (p, a.microbatch, a.chunk) in split:
                held[a.chunk] += 1
            elif a.kind is Kind.W:
                held[a.chunk] -= 1
            stage = schedule.stage(p, a.chunk)
            out[stage] = max(out[stage], held[a.chunk])
    return out


def test_memory_by_hand_for_1f1b() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    mem = stage_memory(layers(), [0, 4, 8], sched, optimizer_states=2, input_bytes=MB, runtime=[7 * MB, 5 * MB])
    # 1F1B: position 0 holds pp = 2 microbatches at its peak, position 1 one; each keeps 4 x 3 MiB
    for p, held in ((0, 2), (1, 1)):
        m = mem[p]
        assert (m.parameters, m.gradients, m.optimizer) == (16 * MB, 16 * MB, 32 * MB)
        assert m.activations == held * 12 * MB
        # B's working set, the wire's buffers, then the process's own
        assert m.buffers == BACKWARD_SET * 3 * MB + 2 * MB * (held + 1) + (7 if p == 0 else 5) * MB
        assert m.total == sum(m.mib().values()) * MB
    # Gloo's tags mode posts a comm step's receives with the step before: one boundary tensor more, none at pp 1
    early = stage_memory(layers(), [0, 4, 8], sched, optimizer_states=2, input_bytes=MB, runtime=[7 * MB, 5 * MB],
                         early_receives=True)
    assert [e.buffers - m.buffers for e, m in zip(early, mem)] == [MB, MB]
    alone = compile_schedule("1f1b", 1, 4)
    assert stage_memory(layers(), [0, 8], alone, input_bytes=MB, early_receives=True) == \
        stage_memory(layers(), [0, 8], alone, input_bytes=MB)


def test_frozen_parameters_have_no_gradient_nor_optimizer_state() -> None:
    sched = compile_schedule("1f1b", 1, 2)
    half = [LayerCost(1e-3, 1e-3, 1e-3, 2e-3, 2 * MB, 4 * MB, output_bytes=MB, grad_bytes=MB) for _ in range(2)]
    m, = stage_memory(half, [0, 2], sched)
    assert (m.parameters, m.gradients, m.optimizer) == (8 * MB, 2 * MB, 4 * MB)


def test_zero_shards_the_optimizer_state_only() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    whole, sharded = (stage_memory(layers(), [0, 4, 8], sched, shards=k)[0] for k in (1, 4))
    assert sharded.optimizer == whole.optimizer / 4
    assert (sharded.parameters, sharded.gradients, sharded.activations) == (
        whole.parameters, whole.gradients, whole.activations)


def test_recompute_trades_activations_for_a_second_forward() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    none, every2, full = (stage_memory(layers(), [0, 4, 8], sched, recompute=r, input_bytes=MB)[0]
                          for r in (None, 2, 0))
    # every:2 keeps two region inputs per microbatch, recomputes 2 layers at a time; full keeps one, recomputes 4
    assert (every2.activations, full.activations) == (2 * (2 * MB), 2 * MB)
    assert (every2.buffers - none.buffers, full.buffers - none.buffers) == (2 * 3 * MB, 4 * 3 * MB)
    assert every2.total < none.total and full.total < none.total
    plain, again = stage_costs(layers(), [0, 4, 8], sched), stage_costs(layers(), [0, 4, 8], sched, recompute=0)
    assert [b - f for (f, b, _) in again] == pytest.approx([b for (_, b, _) in plain])   # B runs F again first
    zb = compile_schedule("zb-h1", 2, 4)   # split: W runs from the roots again, recomputing once
    (f, b, w), = stage_costs(layers(), [0, 4, 8], zb, host=FREE, recompute=0)[:1]
    assert (b, w) == pytest.approx((2 * f, 3 * f))   # every layer: F = B = W = 1 ms
    per = stage_costs(layers(), [0, 4, 8], sched, recompute=[None, 0])   # one per stage
    assert per[0] == plain[0] and per[1] == again[1]


def test_selective_recompute_keeps_what_the_profile_counted_and_adds_its_measured_time() -> None:
    """"selective": each layer keeps its measured bytes (here 1 of its 3 MiB), recomputes one layer's rest at a time;
    B gains the measured seconds; under a split schedule the stage runs its whole backward in B (W: nothing)."""
    measured = [dataclasses.replace(c, selective_bytes=MB, selective_s=0.1e-3) for c in layers()]
    sched = compile_schedule("1f1b", 2, 4)
    none, sel = (stage_memory(measured, [0, 4, 8], sched, recompute=r, input_bytes=MB)[0] for r in (None, SELECTIVE))
    assert (none.activations, sel.activations) == (2 * 4 * 3 * MB, 2 * 4 * MB)   # 2 in flight x 4 layers
    assert sel.buffers - none.buffers == 3 * MB   # one layer's kept bytes while it is recomputed
    plain = stage_costs(measured, [0, 4, 8], sched, host=FREE)
    again = stage_costs(measured, [0, 4, 8], sched, host=FREE, recompute=SELECTIVE)
    assert [x for f, b, w in again for x in (f, b - 4 * 0.1e-3, w)] == pytest.approx([x for c in plain for x in c])
    zb = compile_schedule("zb-h1", 2, 4)
    (f, b, w), = stage_costs(measured, [0, 4, 8], zb, host=FREE, recompute=SELECTIVE)[:1]
    assert (f, b, w) == pytest.approx((4e-3, 4 * 2e-3 + 4 * 0.1e-3, 0.0))   # the fused backward, in B
    # and B releases: as 1F1B's order holds them (2 in flight), none kept until W, no gradients waiting for W
    zb_none, zb_sel = (stage_memory(measured, [0, 4, 8], zb, recompute=r, input_bytes=MB)[0] for r in (None, SELECTIVE))
    assert zb_sel.activations == 2 * 4 * MB < zb_none.activations


def test_a_budget_tries_selective_before_recomputing_whole_layers() -> None:
    """Where the profile measured "selective" and it fits, the budget takes it (it recomputes only cheap ops: the
    step is shorter than with every:K); where it was not measured, every:K as before."""
    measured = [dataclasses.replace(c, selective_bytes=MB, selective_s=0.05e-3) for c in layers()]
    free = fit_budget(measured, 2, 8, 10**12, host=FREE)
    peak = max(m.total for m in free.twin.memory)
    budget = (peak - max(m.activations for m in free.twin.memory) / 2) / (1 - HEADROOM)
    chosen = fit_budget(measured, 2, 8, budget, host=FREE, schedules=["1f1b"])
    assert "selective" in chosen.recompute and set(chosen.recompute) <= {"none", "selective"}, chosen.recompute
    assert max(m.total for m in chosen.twin.memory) <= budget * (1 - HEADROOM)
    unmeasured = fit_budget(layers(), 2, 8, budget, host=FREE, schedules=["1f1b"])
    assert "selective" not in unmeasured.recompute and unmeasured.twin.step_s > chosen.twin.step_s


def test_split_backward_keeps_output_gradients_until_w() -> None:
    sched = compile_schedule("zb-h1", 2, 4)
    waiting = awaiting_w(sched)
    assert all(0 < waiting[s] for s in range(2))
    split, fused = (stage_memory(layers(), [0, 4, 8], s)[0] for s in (sched, compile_schedule("1f1b", 2, 4)))
    assert split.activations == fused.activations + waiting[0] * 4 * MB   # zb-h1 holds what 1F1B holds, + grads


def test_a_position_of_two_stages_peaks_once_not_once_per_stage() -> None:
    """A V or interleaved position holds two stages whose peaks need not come together: its activations are the
    most its program holds at once (walked microbatch by microbatch here, each stage keeping its own bytes), at most
    the sum of the stages' peaks and below it here; dualpipev mixes full and split backwards; forward-only: none."""
    from pipeengine.schedule.simulate import stage_peaks
    costs = [LayerCost(1e-3, 1e-3, 1e-3, 2e-3, (i + 1) * MB, MB, output_bytes=MB // 2) for i in range(8)]
    bounds = [0, 2, 4, 6, 8]
    # what a microbatch keeps per stage: each layer's saved bytes less the output the next layer keeps
    kept = {s: sum((j + 1) * MB - MB // 2 for j in range(bounds[s], bounds[s + 1])) for s in range(4)}
    for_w = {s: (bounds[s + 1] - bounds[s]) * MB // 2 for s in range(4)}   # layers' outputs: held_for_w unmeasured
    for name in ("zbv", "interleaved-zb", "interleaved-1f1b", "dualpipev"):
        sched = compile_schedule(name, 2, 4)
        mem = stage_memory(costs, bounds, sched)
        split, peaks, waiting = sched.split_backwards(), stage_peaks(sched), awaiting_w(sched)
        for p in range(2):
            live: set[tuple[int, int]] = set()   # (microbatch, stage) from F to its release
            held: set[tuple[int, int]] = set()   # split: from B to W
            most = 0.0
            for a in sched.compute_actions(p):
                key = (a.microbatch, sched.stage(p, a.chunk))
                if a.kind is Kind.F:
                    live.add(key)
                elif a.kind is Kind.B and (p, a.microbatch, a.chunk) in split:
                    held.add(key)
                else:
                    live.discard(key)
                    held.discard(key)
                most = max(most, sum(kept[st] for _, st in live) + sum(for_w[st] for _, st in held))
            stages = [sched.stage(p, c) for c in range(2)]
            each = sum(peaks[st] * kept[st] + waiting[st] * for_w[st] for st in stages)
            assert mem[p].activations == pytest.approx(most), (name, p)
            assert most < each, (name, p)
    assert all(m.activations == 0 for m in stage_memory(costs, bounds, compile_schedule("forward", 2, 4, 2)))


def test_the_engine_cost_around_a_layer_counts_once_per_stage() -> None:
    sched = compile_schedule("1f1b", 1, 2)
    timed = layers(4, host=0.2e-3)   # each layer's profile holds 0.2 ms of the engine's own cost per phase
    (f, b, w), = stage_costs(timed, [0, 4], sched, host=FREE)
    assert (f, b + w) == pytest.approx((4 * 1e-3 - 3 * 0.2e-3, 4 * 2e-3 - 3 * 0.4e-3))
    # a split backward runs the stage a layer at a time: there the cost around each layer is real
    split = stage_costs(layers(8, host=0.2e-3), [0, 4, 8], compile_schedule("zb-h1", 2, 4), host=FREE)
    assert split[0] == pytest.approx((4e-3, 4e-3, 4e-3))
    # ... unless every layer's W needs no autograd call (torch's Linear, LayerNorm, Conv): one part past the first
    direct = [dataclasses.replace(c, direct_w=True) for c in layers(8, host=0.2e-3)]
    first, second = stage_costs(direct, [0, 4, 8], compile_schedule("zb-h1", 2, 4), host=FREE)
    assert first == pytest.approx((4e-3, 4e-3, 4e-3)) and second == pytest.approx((4e-3 - 3 * 0.2e-3,) * 3)


def test_a_layer_timed_shorter_than_the_engines_cost_beside_it_costs_nothing_not_less() -> None:
    """On a busy machine a nearly empty layer can time shorter than the engine's own cost measured beside it (a
    launcher run ended with "cost f=-1.4e-05 is negative" in the twin): its own work counts 0, and the step is
    predicted."""
    sched = compile_schedule("1f1b", 2, 4)
    timed = layers(8, host=0.2e-3)
    timed[1:8] = [dataclasses.replace(c, f=0.1e-3, b=0.1e-3, w=0.1e-3, fused=0.2e-3) for c in timed[1:8]]
    first, second = stage_costs(timed, [0, 4, 8], sched, host=FREE)
    assert first == pytest.approx((1e-3, 1e-3, 1e-3)) and second == pytest.approx((0.2e-3, 0.2e-3, 0.2e-3))
    assert predict(timed, [0, 4, 8], sched, host=FREE).step_s > 0
    # without a split the backward counts as a whole: fused 1.0 less the engine's 0.5, whatever the parts' own shares
    one = LayerCost(0.5, 0.9, 0.1, 1.0, MB, MB, host=(0.2, 0.2, 0.3, 0.5))
    (f, b, w), = stage_costs([one], [0, 1], compile_schedule("1f1b", 1, 2), host=FREE)
    assert (f, b + w) == pytest.approx((0.5, 1.0))   # (0.3 + 0.2 and 0.5 + 0.5: its own plus the engine's, once)


def test_posting_transfers_lengthens_the_actions_that_post_them() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    host = Host(per_step=0.0, per_post=1e-3, post_bandwidth=MB / 1e-3)   # a post: 1 ms + 1 ms per MiB
    free, posted = (stage_costs(layers(), [0, 4, 8], sched, host=h) for h in (FREE, host))
    assert all(p[0] > f[0] and p[1] > f[1] and p[2] == f[2] for p, f in zip(posted, free))


def test_the_predicted_step_is_the_simulated_one_plus_the_end_of_the_step() -> None:
    sched = compile_schedule("1f1b", 2, 4)
    twin = predict(layers(), [0, 4, 8], sched, host=Host(per_step=5e-3, per_post=0.0, post_bandwidth=float("inf")),
                   optimizer_states=2, optimizer_bandwidth=16 * MB / 1e-3)
    assert twin.parts["compute"] == pytest.approx(simulate(sched, Costs(4e-3, 4e-3, 4e-3)).makespan)
    assert twin.parts["host"] == 5e-3 and twin.parts["dp sync"] == 0
    assert twin.parts["optimizer"] == pytest.approx(6 * 16 * MB / (16 * MB / 1e-3))   # params, grads, 2 states
    clipped = predict(layers(), [0, 4, 8], sched, optimizer_bandwidth=16 * MB / 1e-3, clip=True)
    assert clipped.parts["optimizer"] == pytest.approx(8 * 1e-3)   # and the clip reads and writes the gradients
    assert twin.step_s == pytest.approx(sum(twin.parts.values()))
    shared = predict(layers(), [0, 4, 8], sched, host=FREE, processes=4, cores=2)   # pp 2 x dp 2 on 2 cores
    alone = predict(layers(), [0, 4, 8], sched, host=FREE)
    node_work = 2 * sum(simulate(sched, Costs(4e-3, 4e-3, 4e-3)).busy)   # two pipelines' work over 2 cores
    assert shared.parts["compute"] >= node_work / 2 > alone.parts["compute"]
    synced = predict(layers(), [0, 4, 8], sched, host=FREE, dp=4, dp_bandwidth=16 * MB / 1e-3)
    assert synced.parts["dp sync"] == pytest.approx(2 * 3 / 4 * 1e-3)   # ring all-reduce of 16 MiB of gradients


def test_a_budget_is_kept_and_a_smaller_one_costs_time() -> None:
    costs = layers()
    unconstrained = fit_budget(costs, 2, 8, 10**12, host=FREE)
    assert all(r == "none" for r in unconstrained.recompute)
    least = None
    steps = []
    for budget in [g * MB for g in (400, 200, 150, 120, 100, 90, 80, 70)]:
        try:
            chosen = fit_budget(costs, 2, 8, budget, host=FREE)
        except PartitionError as exc:
            least = str(exc)
            break
        assert max(m.total for m in chosen.twin.memory) <= budget * (1 - HEADROOM)
        steps.append(chosen.twin.step_s)
    assert steps == sorted(steps) and steps[-1] > steps[0]   # less memory, never a faster plan
    assert least is not None and least.startswith("no plan fits the memory budget of") and "needs is" in least
    needed = float(least.split("needs is ")[1].split(" GiB")[0]) * 2**30
    assert fit_budget(costs, 2, 8, needed * 1.01, host=FREE) is not None   # the least it names does fit


def _free_and_tight(model: Any, data: list[tuple[torch.Tensor, torch.Tensor]],
                    keep: float) -> tuple[PipelineEngine, PipelineEngine]:
    """GPipe over ``data`` on one rank, planned without a budget and with one that has room for ``keep`` of the
    unconstrained plan's activations."""
    def engine(budget: float) -> PipelineEngine:
        return PipelineEngine(model(), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                              schedule="gpipe", microbatches=4, partition="profile", sample=data[0],
                              memory_budget=budget, facts={"host": FREE, "runtime": 0.0}, cut_microbatches=False)
    free = engine(1e12)
    assert free.plan.recompute == ("none",) and free.plan.budget is not None
    peak = free.plan.budget.twin.memory[0]
    tight = engine((peak.total - (1 - keep) * peak.activations) / (1 - HEADROOM))
    assert tight.plan.budget is not None and tight.plan.budget.twin.memory[0].total <= (
        peak.total - (1 - keep) * peak.activations)
    return free, tight


def _same_step(free: PipelineEngine, tight: PipelineEngine, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One step of each: the same loss and weights, bit for bit."""
    losses = [e.train_batch(iter(data)).loss for e in (free, tight)]
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(free.parameters, tight.parameters))
    for e in (free, tight):
        e.close()


@pytest.mark.slow
def test_the_engine_runs_the_recompute_a_budget_chose(one_process_group: None) -> None:
    """One rank, six Linear+GELU layers, GPipe over four 2,048-row microbatches (about 4 MiB kept per layer each): a
    budget that leaves room for half the activations makes the stage recompute, and the step's loss and weights
    stay what they were."""
    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)]
    data = [(torch.randn(2048, 256), torch.randn(2048, 256)) for _ in range(4)]
    free, tight = _free_and_tight(model, data, 0.5)
    assert tight.plan.recompute != ("none",) and tight.stages[0].regions is not None
    _same_step(free, tight, data)


def test_a_budget_chooses_selective_recompute_on_transformer_like_layers(one_process_group: None) -> None:
    """Layers of LayerNorm, Linear, GELU, Linear (an MLP block): the profile counts what "selective" keeps (the
    input and the two matrix products' outputs: less than without recompute, more than a region's input); a budget
    with room for 70% of the activations runs it, the loss and weights as without recompute."""
    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                for _ in range(4)]
    data = [(torch.randn(512, 128), torch.randn(512, 128)) for _ in range(4)]
    free, tight = _free_and_tight(model, data, 0.7)
    for c in free.plan.measured[1:]:   # input 128 + 512 + 128 of the products, against 128 + 128 + 512 + 512
        assert c.selective_bytes is not None and c.activation_bytes - c.output_bytes > c.selective_bytes > 0
    assert tight.plan.recompute == ("selective",) and tight.stages[0].selective
    _same_step(free, tight, data)


def test_selective_on_a_layer_that_changes_a_kept_output_in_place() -> None:
    """torch refuses a kept output changed in place (ReLU(inplace=True) after a Linear): the profile leaves "selective"
    unmeasured there, so a budget never chooses it, and a stage asked for it says what to do in one line."""
    from pipeengine.runtime.chain import LayerChain
    from pipeengine.runtime.profile import profile_layers
    from pipeengine.runtime.stage import Stage

    def layers() -> list[nn.Module]:
        return [nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)) for _ in range(3)]
    costs = profile_layers(layers(), 0, 3, torch.randn(4, 8), loss_fn=nn.functional.mse_loss,
                           target=torch.randn(4, 8), device=torch.device("cpu"), selective=True, repeats=1,
                           min_time=0.0, max_repeats=1)
    assert [c.selective_bytes for c in costs] == [None, None, None]
    stage = Stage(LayerChain(layers()[:1], 1), 1, 3, nn.functional.mse_loss, 1, recompute="selective")
    stage.forward(0, torch.randn(4, 8), None, True)
    with pytest.raises(ValueError, match=r"stage 1: recompute 'selective' keeps the outputs of matrix products.*"
                                         r"ReLU\(inplace=True\).*use recompute 'full' or 'every:K'"):
        stage.backward(0, (torch.ones(4, 8),), split=False)
