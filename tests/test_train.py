"""The real job: launch/pipe.sh -> torchrun -> trainer -> TensorBoard; tied GPT; bad configs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.train import parse_args
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parent.parent


def launch(tmp_path: Path, n: int, *flags: str, timeout: float = 240) -> dict[str, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOG_RANK="0")
    cmd = ["bash", str(ROOT / "launch" / "pipe.sh"), str(n), "cpus", "--log-dir", str(tmp_path), "--run-name", "run",
           *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["stdout"] = proc.stdout + proc.stderr
    return summary


@pytest.mark.timeout(300)
def test_pipe_sh_4_cpus_gpt_pp2_dp2_writes_tensorboard_views(tmp_path: Path) -> None:
    s = launch(tmp_path, 4, "--model", "gpt", "--preset", "tiny", "--steps", "4", "--eval-interval", "2",
               "--timeline-interval", "2", "--trace-step", "1", "--wire", "strict")   # as NCCL orders the wire
    assert "4 ranks = pp 2 x dp 2" in s["stdout"]
    assert "partition profile: bounds [0, " in s["stdout"] and "stage 1: layers " in s["stdout"]   # the default
    assert (s["pp"], s["dp"]) == (2, 2)
    assert math.isfinite(s["final_loss"]) and s["final_loss"] < s["first_loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    want = {"train/loss", "train/lr", "train/grad_norm", "time/step_s", "throughput/samples_per_s",
            "throughput/tokens_per_s", "pipeline/bubble_measured", "pipeline/bubble_theoretical", "val/loss",
            *(f"time/stage{s}/{part}" for s in (0, 1) for part in ("compute", "bubble", "comm", "overhead", "sync"))}
    assert want <= set(tags["scalars"]), want - set(tags["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2, 3]
    for e in acc.Scalars("throughput/samples_per_s") + acc.Scalars("throughput/tokens_per_s"):
        assert e.value > 0
    for tag in ("pipeline/bubble_measured", "pipeline/bubble_theoretical"):
        assert all(0.0 <= e.value <= 1.0 for e in acc.Scalars(tag))
    # simulator's bubble for 1F1B pp=2 m=4 with measured costs is near the closed form 1/5
    assert 0.05 < acc.Scalars("pipeline/bubble_theoretical")[-1].value < 0.45
    assert "pipeline/timeline" in tags["images"]
    assert "custom_scalars__config__" in tags["tensors"]
    assert "config/text_summary" in tags["tensors"]   # the resolved configuration, as TOML
    trace = json.loads((tmp_path / "run" / "trace_step1.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B0", "F3", "B3"} <= names


@pytest.mark.timeout(300)
def test_resnet_and_mlp_train_under_pp2(tmp_path: Path) -> None:
    r = launch(tmp_path / "r", 2, "--model", "resnet", "--preset", "tiny", "--steps", "2", "--micro-batch-size", "2",
               "--eval-interval", "0")
    assert r["pp"] == 2 and math.isfinite(r["final_loss"])
    m = launch(tmp_path / "m", 2, "--model", "mlp", "--steps", "30", "--eval-interval", "0", "--lr", "1e-2")
    assert m["pp"] == 2 and m["final_loss"] < 0.5 * m["first_loss"]


# ------------------------------------------------------------------ tied GPT

def gpt_run(rank: int, world: int) -> dict[str, Any]:
    from pipeengine.models import gpt
    from pipeengine.engine import PipelineEngine
    from pipeengine.topology import Topology
    torch.set_default_dtype(torch.float64)
    cfg = gpt.presets()["tiny"]()
    engine = PipelineEngine(gpt.layer_factories(cfg), gpt.loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            topology=Topology(2, 1), schedule="1f1b", microbatches=2, seed=3,
                            tied=gpt.tied_parameters(cfg.n_layer + 2), grad_clip=1.0)
    losses = []
    for step in range(4):
        x, y = gpt_batch(step)
        losses.append(engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])])).loss)
    layers = engine.chunks[0].module.layers
    tied = layers[0].wte.weight if engine.position == 0 else layers[-1].lm_head.weight
    return {"losses": losses, "tied": tied.detach().clone()}


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, 256, (4, 17), generator=g)
    return seq[:, :-1], seq[:, 1:]


@pytest.mark.timeout(200)
def test_tied_embedding_stays_bit_identical_and_matches_single_process() -> None:
    results = run_distributed(gpt_run, 2, timeout=180)
    assert torch.equal(results[0]["tied"], results[1]["tied"])
    from pipeengine.models import gpt
    torch.set_default_dtype(torch.float64)
    try:
        layers = gpt.build(gpt.presets()["tiny"](), seed=3)
        net = nn.Sequential(*layers)
        assert layers[-1].lm_head.weight is layers[0].wte.weight
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            x, y = gpt_batch(step)
            loss = gpt.loss_fn(net(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(results[0]["tied"], layers[0].wte.weight.detach(), rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------ bad configs

@pytest.mark.parametrize("flags,world,match", [
    (["--pp", "3"], 4, r"world size 4 is not divisible by --pp 3; use --pp in \[1, 2, 4\]"),
    (["--pp", "2", "--dp", "3"], 4, r"pp=2 x dp=3 = 6 ranks, but the world has 4"),
    (["--microbatches", "0"], 1, r"--microbatches must be >= 1 \(got 0\)"),
    (["--global-batch", "30", "--microbatches", "4", "--pp", "2"], 4,
     r"--global-batch 30 is not divisible by dp=2 x microbatches=4 = 8; use a multiple of 8"),
    (["--schedule", "forward"], 1, r"is not a training schedule"),
    (["--checkpoint", "some"], 1, r"--checkpoint: checkpoint must be 'none', 'full' or 'every:K'"),
    (["--checkpoint", "every:0"], 1, r"every:K' with K >= 1 layers per region \(got 'every:0'\)"),
    (["--keep", "-1"], 1, r"--save-interval and --keep must be >= 0"),
    (["--partition", "time"], 1, r"--partition must be profile, parameters, uniform or stage bounds like 0,3,6,10"),
    (["--memory-cap", "0"], 1, r"--memory-cap must be a positive number of GiB \(got 0\)"),
    (["--memory-cap", "2", "--partition", "uniform"], 1, r"--memory-cap is planned for by --partition profile"),
])
def test_bad_configs_are_explained(flags: list[str], world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_args(flags).check(world)


def test_interleaved_defaults_to_two_chunks() -> None:
    cfg = parse_args(["--schedule", "interleaved-1f1b"])
    cfg.check(2)
    assert cfg.chunks == 2
    cfg = parse_args(["--schedule", "1f1b"])
    cfg.check(2)
    assert cfg.chunks == 1


def test_unknown_schedule_rejected_by_argparse_or_check() -> None:
    with pytest.raises(ValueError, match="not a training schedule"):
        parse_args(["--schedule", "2f2b"]).check(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,match", [
    (["--model", "mlp", "--schedule", "interleaved-1f1b", "--chunks", "16", "--microbatches", "4"],
     "mlp (tiny) has 10 layers but pp=1 x chunks=16 needs 16 stages"),
    (["--model", "gpt", "--preset", "huge"], "--preset 'huge' is not a gpt preset; choose tiny, small"),
    (["--model", "gpt", "--data", "/nonexistent/corpus.txt"], "--data '/nonexistent/corpus.txt' does not exist"),
    (["--model", "mlp", "--precision", "fp16"], "precision fp16 (with a loss scale) needs CUDA; use bf16 on CPU"),
    (["--model", "mlp", "--resume", "/nonexistent/ck"], "checkpoint '/nonexistent/ck' does not exist"),
])
def test_trainer_cli_prints_clear_error(flags: list[str], match: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeengine.train", "--log-dir", str(tmp_path), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------ the launcher's own checks

def pipe_sh(*args: str, path_prefix: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if path_prefix:
        env["PATH"] = path_prefix + os.pathsep + env["PATH"]
    return subprocess.run(["bash", str(ROOT / "launch" / "pipe.sh"), *args], capture_output=True, text=True,
                          timeout=30, env=env)


def test_pipe_sh_usage_and_bad_arguments(tmp_path: Path) -> None:
    h = pipe_sh("-h")
    assert h.returncode == 0 and "launch/pipe.sh N gpus|cpus [--pp P]" in h.stdout and "NNODES" in h.stdout
    bad = pipe_sh("3", "tpus")
    assert bad.returncode == 2 and "second argument must be 'gpus' or 'cpus' (got 'tpus')" in bad.stderr
    assert "N must be a positive integer (got 'x')" in pipe_sh("x", "cpus").stderr
    assert "--pp 3 does not divide the world size 4" in pipe_sh("4", "cpus", "--pp", "3").stderr
    assert "--max-restarts must be a whole number >= 0 (got 'x')" in pipe_sh("2", "cpus", "--max-restarts", "x").stderr
    fake = tmp_path / "nvidia-smi"   # a node with one GPU
    fake.write_text("#!/bin/sh\necho 'GPU 0: Fake'\n")
    fake.chmod(0o755)
    few = pipe_sh("8", "gpus", path_prefix=str(tmp_path))
    assert few.returncode == 2 and "asked for 8 gpus but this node has 1" in few.stderr
