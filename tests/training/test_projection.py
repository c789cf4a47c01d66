"""The dry run for a cluster (python -m pipeengine.plan): costs on meta, the world's links, the search, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeengine import plan
from pipeengine.training.hardware import GPUS, World, gpu_preset
from pipeengine.training.meta_costs import gpt_config, gpt_work, layer_costs
from pipeengine.training.projection import NoFit, Projection, Settings, project
from pipeengine.training.scoring import EXTEND_FROM, Search, simulated_counts, split
from tests.harness import ROOT

H100 = gpu_preset("h100")


@pytest.fixture(scope="module")
def work_7b() -> list[Any]:
    return gpt_work(gpt_config("7b"), 1)


def check_plan(p: Projection, world: World, settings: Settings) -> None:
    """What every projection must satisfy, whatever the twin predicts."""
    usable = world.gpu.memory_bytes * (1 - settings.reserve)
    assert p.ranked[0] is p.best
    for c in p.ranked:
        assert c.pp * c.dp == world.size
        assert c.microbatches * c.dp * settings.micro_batch == settings.global_batch
        assert c.peak <= usable and len(c.memory) == c.pp
        assert c.step_s == pytest.approx(sum(c.parts.values()))
        assert c.tokens_per_s == pytest.approx(settings.global_batch * settings.context / c.step_s)
        assert 0 <= c.bubble < 1 and 0 < c.mfu <= settings.mfu * 1.0001
    assert [c.tokens_per_s for c in p.ranked] == sorted((c.tokens_per_s for c in p.ranked), reverse=True)


def test_a_block_on_meta_costs_what_its_shapes_say() -> None:
    """FLOPs and bytes of one GPT block on the meta device, derived by hand (b rows, t tokens, c wide, h heads)."""
    b, t, c, h, vocab = 2, 32, 64, 4, 128
    work = gpt_work(gpt_config("tiny", n_layer=3, n_embd=c, n_head=h, block_size=t, vocab_size=vocab), b)
    assert [w.kind for w in work] == ["embedding", "block", "block", "block", "head"]
    block = work[1]
    assert block.forward == 24 * b * t * c * c + 2 * b * t * t * c         # matmuls 2 x 12c^2 per token; causal half
    assert block.weight_grad == 24 * b * t * c * c                         # each weight's gradient: its product again
    assert block.input_grad == 24 * b * t * c * c + 2.5 * 2 * b * t * t * c  # attention's backward 2.5x its forward
    # kept for backward: x and x2 in fp32 (4 + 4), bf16 copies into qkv and fc (2 + 2), q k v (6), attention out
    # (2, its reshape a view), fc out and gelu out (8 + 8): 36 bytes per b t c; two layer norms' mean and rstd
    # (16 bt), the log-sum-exp (4 bht) and the attention's random seed and offset (24 bytes)
    assert block.saved_bytes == 36 * b * t * c + 16 * b * t + 4 * b * h * t + 24
    assert block.output_bytes == 4 * b * t * c                              # the residual stream stays fp32
    assert block.param_bytes == 4 * (12 * c * c + 13 * c)
    assert block.cast_bytes == 2 * (12 * c * c + 9 * c)                     # linear weights and biases, once a step
    head = work[-1]
    assert head.forward == head.input_grad == head.weight_grad == 2 * b * t * c * vocab
    assert head.tied_bytes == 4 * vocab * c and head.output_bytes == 0      # the loss is its output


def test_presets_are_the_spec_sheets_and_match_the_trainers_peaks() -> None:
    from pipeengine.training.resources import PEAK_TFLOPS
    peaks = {fragment: half for fragment, half, _ in PEAK_TFLOPS}
    for name, fragment in (("h100", "H100"), ("h200", "H200"), ("a100", "A100"), ("l40s", "L40S")):
        assert GPUS[name].tflops == peaks[fragment]
    assert (H100.memory_gib, H100.memory_gbs, H100.intra_gbs, H100.inter_gbs) == (80, 3350, 450, 50)
    changed = gpu_preset("H100", memory_gib=94, inter_gbs=25)
    assert (changed.memory_gib, changed.inter_gbs, changed.tflops) == (94, 25, 989) and "modified" in changed.name
    with pytest.raises(ValueError, match="h100, h200, a100, l40s"):
        gpu_preset("b300")


def test_links_and_all_reduce_follow_the_engines_rank_order() -> None:
    """Position-major ranks (rank = position x dp + replica), 8 a node: which transfers leave the node."""
    world = World(2, 8, H100)
    assert world.dp_bandwidth(2, 8) == 450e9                  # a position's 8 replicas: one node
    assert world.links(2, 8).bandwidth == (50e9,)             # position 0 on node 0, position 1 on node 1
    assert world.dp_bandwidth(1, 16) == 50e9                  # 16 replicas over both nodes
    links = world.links(8, 2)                                 # ranks 2p + r: positions 0-3 node 0, 4-7 node 1
    assert links.bandwidth == (450e9, 450e9, 450e9, 50e9, 450e9, 450e9, 450e9, 50e9)   # hop 3 and the wrap 7 -> 0
    assert world.dp_bandwidth(8, 2) == 450e9


def test_a_small_model_on_one_node_takes_pp_1_and_its_step_is_its_work(work_7b: Any) -> None:
    """GPT small fits one GPU many times over: pp 1 x dp 8 (no bubble), the step m x every layer's F + B + W."""
    work = gpt_work(gpt_config("small"), 4)
    world, settings = World(1, 8, H100), Settings(global_batch=256, micro_batch=4, context=128)
    p = project(work, world, settings)
    check_plan(p, world, settings)
    best = p.best
    assert (best.pp, best.dp, best.microbatches, best.recompute) == (1, 8, 8, None)
    rate = 989e12 * 0.5
    assert best.parts["compute"] == pytest.approx(8 * sum(w.flops for w in work) / rate, rel=1e-9)
    assert best.bubble == pytest.approx(0, abs=1e-9)
    assert best.tflops_per_gpu == pytest.approx(8 * 8 * sum(w.flops for w in work) / best.step_s / 8 / 1e12)


def test_7b_on_64_h100s_pipelines_and_fits(work_7b: Any) -> None:
    world, settings = World(8, 8, H100), Settings(global_batch=1024, micro_batch=1, context=4096)
    p = project(work_7b, world, settings)
    check_plan(p, world, settings)
    assert p.best.pp > 1                        # 7B x 16 bytes of state is more than one H100 holds
    assert 6.5e9 < p.parameters < 6.7e9


def test_70b_on_8_gpus_is_refused_naming_the_least_memory(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NoFit) as refused:
        project(gpt_work(gpt_config("70b"), 1), World(1, 8, H100), Settings(1024, 1, 4096))
    assert refused.value.least > 64.7e9 * 16 / 8             # more than its state over 8 positions
    assert plan.main(["--preset", "70b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plan: nothing fits: the least any candidate needs is ")
    assert "GiB per GPU" in err and "--nodes" in err and "Traceback" not in err


def test_less_memory_brings_recompute_and_the_plan_still_fits(work_7b: Any) -> None:
    world, settings = World(1, 8, gpu_preset("h100", memory_gib=32)), Settings(1024, 1, 4096)
    p = project(work_7b, world, settings)
    check_plan(p, world, settings)
    assert p.best.recompute is not None


def test_1024_ranks_complete() -> None:
    world, settings = World(128, 8, H100), Settings(global_batch=1024, micro_batch=1, context=4096)
    p = project(gpt_work(gpt_config("70b"), 1), world, settings)
    check_plan(p, world, settings)
    assert p.best.pp >= 16


@pytest.mark.parametrize("name", sorted(EXTEND_FROM))
def test_the_linear_extension_matches_the_full_simulation(work_7b: Any, name: str) -> None:
    """Past k pp microbatches each one adds the same time: the step extended from two counts is the simulated one."""
    search = Search(work_7b, World(1, 8, H100), Settings(512, 1, 4096))
    pp, m = 4, 64
    bounds = split(search.totals, name, pp)
    mean = search.mean_costs(name, pp, bounds, 2)
    counts = simulated_counts(name, pp, 10**6, 2)
    assert counts is not None and len(counts) == 2

    def step(ms: tuple[int, ...]) -> float:
        from pipeengine.schedule import build_schedule, lower
        orders = [lower(build_schedule(name, pp, c, costs=mean), mean) for c in ms]
        return search.score(pp, 2, m, orders, bounds, None).parts["compute"]
    assert step(counts) == pytest.approx(step((m,)), rel=1e-3)


def test_uneven_global_batches_are_skipped_or_refused(work_7b: Any) -> None:
    world, settings = World(3, 8, H100), Settings(global_batch=1000, micro_batch=1, context=4096)
    p = project(work_7b, world, settings)   # 1000 = 8 x 125: dp 8, 4, 2 or 1; not 24, 12, 6, 3
    check_plan(p, world, settings)
    assert any(n.startswith("skipped: pp 1 (dp 24), pp 2 (dp 12), pp 4 (dp 6), pp 8 (dp 3):") for n in p.notes)
    with pytest.raises(ValueError, match="use a multiple of 2"):
        project(gpt_work(gpt_config("tiny"), 1), World(2, 8, H100), Settings(3, 1, 64))   # pp <= 8 layers: dp >= 2


@pytest.mark.parametrize("args, says", [
    (["--gpu", "b300"], "the presets are h100, h200, a100, l40s"),
    (["--width", "100", "--heads", "3"], "--width=100 must be divisible by --heads=3"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["--nodes", "0"], "0 is not above 0"),
    (["--mfu", "1.5"], "1.5 is above 1"),
    (["--preset", "huge"], "invalid choice"),
    (["--reserve", "1"], "--reserve must be in [0, 1)"),
])
def test_bad_input_is_one_line_and_status_2(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        status = plan.main(args)
    except SystemExit as stop:   # argparse's own checks
        status = int(str(stop.code))
    err = capsys.readouterr().err
    assert status == 2 and says in err and err.count("\n") == 1 and err.startswith("plan: error: ")


def test_the_command_prints_a_labelled_projection_and_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert plan.main(["--preset", "gpt2-124m", "--gpus", "16", "--gpu", "a100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("projection (not measured)") and "runner-ups" in text and "assumes" in text
    got = json.loads(out.read_text())
    assert got["projection"] == "not measured" and got["world"]["gpus"] == 16 and got["gpu"]["tflops_bf16"] == 312
    chosen = got["chosen"]
    assert chosen["pp"] * chosen["dp"] == 16 and chosen["peak_memory_gib"] <= got["settings"]["usable_memory_gib"]
    assert set(chosen["memory_gib"][0]) == {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
    assert got["settings"]["global_batch"] == 2**22 // 1024   # the default: about 4M tokens


def test_help_and_the_presets_need_no_torch() -> None:
    code = ("import sys, contextlib, io\nfrom pipeengine import plan\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    plan.main(['--list-gpus'])\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_layer_costs_are_flops_over_the_rate() -> None:
    work = gpt_work(gpt_config("tiny"), 1)
    costs = layer_costs(work, 100.0, 0.25)
    assert costs[1].f == pytest.approx(work[1].forward / 25e12)
    assert costs[1].fused == pytest.approx(costs[1].b + costs[1].w)
    assert costs[1].activation_bytes == work[1].saved_bytes + work[1].output_bytes
