"""The dry run for a cluster (python -m pipeengine.plan): costs on meta, the world's links, the search, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeengine import plan
from pipeengine.schedule import build_schedule
from pipeengine.training import hardware, meta_costs, projection, projection_report, scoring
from pipeengine.training.hardware import GPUS, World, gpu_preset
from pipeengine.training.meta_costs import gpt_config, gpt_work, layer_costs
from pipeengine.training.projection import NoFit, Projection, Settings, project
from pipeengine.training.projection_report import describe
from pipeengine.training.scoring import CHECK_ACTIONS, EXTEND_FROM, SCHEDULES, Search, refusal, simulated_counts, split
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
        assert c.microbatches * c.dp * settings.micro_batch == c.global_batch
        assert c.global_batch == settings.global_batch or settings.round_batch
        if c.pp * c.microbatches * c.chunks <= CHECK_ACTIONS:   # the real count builds, not only the simulated ones
            build_schedule(c.schedule, c.pp, c.microbatches)
        assert c.peak <= usable and len(c.memory) == c.pp
        assert c.step_s == pytest.approx(sum(c.parts.values()))
        assert c.tokens_per_s == pytest.approx(c.global_batch * settings.context / c.step_s)
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
    # a split backward: B keeps the gradients arriving at qkv, proj, fc and fc_proj (bf16: 6 + 2 + 8 + 2) and at the
    # two layer norms (fp32, behind the casts: 4 + 4); W reads the layer norms' inputs and statistics (4 + 4, 16 bt)
    # and the four products' inputs (2 + 2 + 2 + 8): the rest, q k v and fc's output, the log-sum-exp and the seed,
    # B frees
    assert block.held_for_w == 26 * b * t * c
    assert block.freed_at_b == 14 * b * t * c + 4 * b * h * t + 24 == block.saved_bytes - (22 * b * t * c + 16 * b * t)
    assert (work[0].held_for_w, work[0].freed_at_b) == (0, 0)   # an embedding's W needs autograd: the defaults
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
    (["--vocab", "100000000000000000"], "argument --vocab: 100000000000000000 is above 16,777,216"),
    (["--layers", "5000"], "argument --layers: 5000 is above 1,024"),
    (["--tflops", "1e300"], "--tflops 1e+300 is outside 1 to 100,000 TFLOP/s"),
    (["--intra-gbs", "1e-300"], "--intra-gbs 1e-300 is outside 0.1 to 100,000 GB/s"),
    (["--inter-gbs", "1e-300"], "--inter-gbs 1e-300 is outside"),
    (["--memory-gbs", "1e300"], "--memory-gbs 1e+300 is outside"),
    (["--memory-gib", "1e9"], "--memory-gib 1e+09 is outside"),
    (["--inter-gbs", "inf"], "inf is not a finite number"),
    (["--tflops", "nan"], "nan is not a finite number"),
    (["--mfu", "1e-300"], "1e-300 is below 0.01"),
    (["--global-batch", "99999999999"], "is above 16,777,216"),
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


def test_a_candidate_is_chosen_only_where_its_real_count_builds(work_7b: Any) -> None:
    """1026 sequences on 8 GPUs: pp 4 runs 513 microbatches a replica, which interleaved-1f1b refuses (m a multiple
    of pp), though its step is simulated at two smaller counts that build."""
    world, settings = World(1, 8, H100), Settings(global_batch=1026, micro_batch=1, context=4096)
    p = project(work_7b, world, settings)
    check_plan(p, world, settings)              # builds every fitting candidate at its real count
    assert (p.best.pp, p.best.microbatches) == (4, 513) and p.best.schedule != "interleaved-1f1b"
    assert "not built: interleaved-1f1b at pp 4 (m 513): needs microbatches to be a multiple of pp" in p.notes
    assert "interleaved-1f1b" in refusal("interleaved-1f1b", 4, 513) and refusal("interleaved-1f1b", 4, 512) is None
    # beyond CHECK_ACTIONS the count's residue modulo pp is built: quick at a million microbatches
    assert refusal("interleaved-1f1b", 64, 10**6 + 1) and refusal("interleaved-1f1b", 64, 64 * 10**4) is None
    assert refusal("zbv", 64, 10**6 + 1) is None


def test_the_tied_weight_is_held_twice_as_the_engine_holds_it() -> None:
    """runtime/ties.py: one copy per entry of a tie, also on one rank; memory counts both, the count of parameters
    the logical ones."""
    work = gpt_work(gpt_config("small"), 1)
    p = project(work, World(1, 1, H100), Settings(8, 1, 1024))
    assert p.best.pp == 1 and p.best.fullest.parameters == sum(w.param_bytes for w in work)   # both copies
    assert p.parameters == sum(w.param_bytes - w.tied_bytes for w in work) // 4
    doc = meta_costs.gpt_work.__doc__ or ""
    assert "counts one where they share" not in doc and "memory counts both" in doc
    assert "tied embedding and head weight held twice" in projection_report.ASSUMPTIONS


def test_the_default_batch_is_about_4m_tokens_rounded_per_pp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert plan.main(["--preset", "7b", "--context", "8192", "--gpus", "1024", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["settings"]["global_batch"] == 512 == got["settings"]["global_batch_aimed"]   # 2^22 tokens, not 1,024
    assert "512 sequences of 8,192 tokens" in capsys.readouterr().out
    # a batch rounded away from the one aimed at is said: 1,024 on 24 GPUs at pp 1 is 43 x 24 = 1,032
    settings = Settings(1024, 1, 128, round_batch=True)
    assert [settings.batch_for(dp) for dp in (24, 12, 8, 3, 2048)] == [1032, 1020, 1024, 1023, 2048]
    p = project(gpt_work(gpt_config("small", block_size=128), 1), World(3, 8, H100), settings)
    check_plan(p, World(3, 8, H100), settings)
    assert (p.best.pp, p.best.global_batch) == (1, 1032)
    assert any(n.startswith("the global batch is 1,032 sequences (132,096 tokens), not the 1,024 aimed at")
               for n in p.notes)
    assert "1,032 sequences of 128 tokens" in describe(p, "m", World(3, 8, H100), settings)


def test_a_model_too_large_for_the_meta_device_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"too large to build on the meta device \(Storage size calculation "
                                         r"overflowed.*\); lower --vocab"):
        plan._work(gpt_config("tiny", vocab_size=10**17), 1)


def test_the_bubble_is_never_negative(capsys: pytest.CaptureFixture[str]) -> None:
    """pp 1: busy / makespan rounds to 1 + 1e-16 (printed -0.0%)."""
    world, settings = World(1, 8, H100), Settings(1024, 1, 4096)
    p = project(gpt_work(gpt_config("1b"), 1), world, settings)
    check_plan(p, world, settings)
    assert p.best.pp == 1 and p.best.bubble == 0.0
    assert "-0.0%" not in describe(p, "1b", world, settings)


def test_v_min_is_tried_where_only_it_fits_without_recompute(work_7b: Any) -> None:
    assert SCHEDULES == __import__("pipeengine.runtime.budget", fromlist=["SHAPES"]).SHAPES
    world, settings = World(1, 8, gpu_preset("h100", memory_gib=37)), Settings(32, 1, 4096)
    p = project(work_7b, world, settings)
    check_plan(p, world, settings)
    assert any(c.schedule == "v-min" and c.recompute is None for c in p.ranked)


def test_a_failed_run_leaves_no_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, kept = tmp_path / "plan.json", tmp_path / "kept.json"
    kept.write_text("{}\n")
    assert plan.main(["--preset", "70b", "--gpus", "8", "--json", str(out)]) == 2
    assert plan.main(["--preset", "70b", "--gpus", "8", "--json", str(kept)]) == 2
    assert not out.exists() and kept.read_text() == "{}\n"
    assert plan.main(["--preset", "tiny", "--json", str(tmp_path / "no" / "plan.json")]) == 2
    assert "--json" in capsys.readouterr().err.splitlines()[-1]


def test_one_simulation_and_one_candidate_are_singular(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--preset", "small", "--gpus", "1", "--global-batch", "8"]) == 0
    text = capsys.readouterr().out
    assert "searched          1 simulation in " in text and "; 1 candidate fits" in text
    assert projection.plural(2, "candidate") == "2 candidates"


def test_shared_figures_have_one_source() -> None:
    """recompute_text is budget.py's, GIB hardware.py's, RUNNER_UPS used by the report; no Settings.schedules;
    the GPU peaks named as resources.py's table (checked equal by the preset test)."""
    from pipeengine.runtime import budget
    assert scoring.recompute_text is budget.recompute_text
    assert projection.GIB is hardware.GIB and projection_report.GIB is hardware.GIB
    assert not hasattr(projection, "RUNNER_UPS")
    assert describe.__defaults__ == (projection_report.RUNNER_UPS,)
    assert "schedules" not in Settings.__dataclass_fields__
    assert "PEAK_TFLOPS" in (hardware.__doc__ or "")


def test_zero_1_is_suggested_only_where_it_would_fit() -> None:
    """Two blocks: pp at most 4 on 8 GPUs, so dp >= 2; at 4 GiB only the optimizer state over dp is the excess."""
    work = gpt_work(gpt_config("7b", n_layer=2, block_size=1024), 1)
    settings = Settings(64, 1, 1024)
    with pytest.raises(NoFit) as helped:
        project(work, World(1, 8, gpu_preset("h100", memory_gib=4)), settings)
    assert "--zero 1" in str(helped.value)
    project(work, World(1, 8, gpu_preset("h100", memory_gib=4)), dataclasses.replace(settings, zero=True))
    with pytest.raises(NoFit) as hopeless:
        project(work, World(1, 8, gpu_preset("h100", memory_gib=3)), settings)
    assert "--zero 1" not in str(hopeless.value)


def test_70b_on_8_gpus_does_not_suggest_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--preset", "70b", "--gpus", "8"]) == 2
    assert "--zero 1" not in capsys.readouterr().err   # pp 8 x dp 1 is the least: nothing to shard


def test_a_world_smaller_than_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--preset", "small", "--gpus", "4"]) == 0
    assert "(1 node x 4)" in capsys.readouterr().out


def test_the_assumptions_name_the_cpu_fitted_working_set_and_the_rank_order() -> None:
    from pipeengine.runtime.twin import BACKWARD_SET
    text = projection_report.ASSUMPTIONS
    assert f"backward's working set {BACKWARD_SET:g}x" in text and "fitted on CPU" in text
    assert "position-major" in text and "rank = position x dp + replica" in text
