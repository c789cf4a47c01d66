"""Checkpoints: bitwise resume, re-partitioning, export to the plain model, crash safety, restarts, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.training.checkpoint import CheckpointError, complete_checkpoints, latest, resolve
from pipeengine.training.cli import parse_args
from pipeengine.training.config import Config
from pipeengine.training.export import export, main
from pipeengine.training.trainer import run
from tests.harness import ROOT, WorldPool, python_cli
GPT = ["--model", "gpt", "--preset", "tiny", "--optimizer", "adamw", "--warmup", "2", "--eval-interval", "0",
       "--log-interval", "100", "--timeline-interval", "0", "-m", "2", "--global-batch", "8", "--wire", "strict"]


def trainer(tmp: str, name: str, *flags: str) -> Config:
    return parse_args([*GPT, "--log-dir", os.path.join(tmp, "runs"), "--run-name", name, *flags])


def train_runs(rank: int, world: int, runs: list[list[str]], tmp: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for i, flags in enumerate(runs):
        # runs 0-2 resume at the same layout with the measured split; the others compare across layouts,
        # where a measured split would only cost time
        s = run(trainer(tmp, f"r{i}", *flags, *([] if i < 3 else ["--partition", "uniform"])))
        out.append({"losses": s["losses"], "first_step": s["first_step"], "val_loss": s["val_loss"]})
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_is_bitwise_and_repartitioning_keeps_the_next_loss(tmp_path: Path, world4: WorldPool) -> None:
    s0, d, p, q, iv = (str(tmp_path / n) for n in ("straight", "split", "pp4", "pp1", "interleaved"))
    runs = [
        ["--pp", "2", "--steps", "6", "--save-interval", "6", "--save-dir", s0],      # 0: uninterrupted, pp2 x dp2
        ["--pp", "2", "--steps", "3", "--save-interval", "3", "--save-dir", d,         # 1: 3 steps, saved in the
         "--async-save"],                                                              # background
        ["--pp", "2", "--steps", "6", "--save-interval", "3", "--resume", "--save-dir", d,   # 2: resume + 3 steps
         "--async-save"],
        ["--pp", "4", "--steps", "4", "--save-interval", "3", "--save-dir", p],        # 3: pp4 saves at 3
        ["--pp", "2", "--steps", "4", "--resume", os.path.join(p, "step-00000003")],   # 4: ... loaded at pp2 x dp2
        ["--pp", "1", "--steps", "4", "--resume", os.path.join(p, "step-00000003")],   # 5: ... at pp1 x dp4
        ["--pp", "2", "--steps", "5", "--schedule", "interleaved-1f1b",                # 6: ... interleaved, 2 chunks,
         "--resume", os.path.join(p, "step-00000003"), "--save-interval", "4", "--save-dir", iv],   # saving at 4
        ["--pp", "1", "--steps", "4", "--save-interval", "3", "--save-dir", q],        # 7: pp1 (both tied copies
        ["--pp", "4", "--steps", "4", "--resume", os.path.join(q, "step-00000003")],   # 8: on one rank) -> pp4
        ["--pp", "4", "--steps", "5", "--resume", os.path.join(iv, "step-00000004")],  # 9: interleaved -> pp4
        ["--pp", "1", "--steps", "5", "--resume", os.path.join(iv, "step-00000004")],  # 10: interleaved -> pp1
    ]
    results = world4.run(train_runs, runs, str(tmp_path), timeout=280)
    r = results[0]
    assert r[2]["first_step"] == 3 and r[2]["losses"] == r[0]["losses"][3:], (r[0]["losses"], r[2]["losses"])
    assert r[1]["losses"] == r[0]["losses"][:3]
    for k in (4, 5, 6):   # the next step's loss after loading the pp=4 checkpoint elsewhere
        assert r[k]["first_step"] == 3
        torch.testing.assert_close(r[k]["losses"][0], r[3]["losses"][3], rtol=1e-5, atol=1e-6)
    # the tied LM head's optimizer state was saved under the embedding's key: found under its own at pp=4
    torch.testing.assert_close(r[8]["losses"][0], r[7]["losses"][3], rtol=1e-5, atol=1e-6)
    # saved with interleaved chunks, loaded at pp=4: the next step's loss
    for k in (9, 10):
        torch.testing.assert_close(r[k]["losses"][0], r[6]["losses"][1], rtol=1e-5, atol=1e-6)
    # parameters equal bitwise too: the straight run and the resumed one end in the same state
    export(s0, str(tmp_path / "a.pt"))
    export(d, str(tmp_path / "b.pt"))   # the newest: step 6
    straight, resumed = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    # export the step-3 checkpoint and evaluate the plain model: the pipeline's validation loss at step 3
    out = str(tmp_path / "model.pt")
    assert export(os.path.join(d, "step-00000003"), out) > 0
    from pipeengine.models import gpt
    from pipeengine.training.batch import Batch
    from pipeengine.training.feed import Feed
    model = gpt.model()
    net = nn.Sequential(*gpt.build(gpt.presets()["tiny"]()))
    net.load_state_dict(torch.load(out, weights_only=True))
    feed = Feed(model.data, None, 1234, Batch(2 * 2 * 2, 1, 8), 1, 0, 6, 0, False, model.packing)
    with torch.no_grad():   # the step's mean over its real tokens (each target carries its weight)
        loss = sum(gpt.loss_fn(net(x), y).item() for x, y in feed.val(3) or [])
    torch.testing.assert_close(loss, r[1]["val_loss"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero_1_checkpoints_resume_bitwise_and_reshard_across_dp_and_pp(tmp_path: Path, world4: WorldPool) -> None:
    """ZeRO-1 saves a replica's part of each optimizer tensor as DCP shards of the global tensor: a checkpoint
    loads at any dp (4 -> 2 -> 1), sharded or not, and at another pp, continuing the saved run's losses."""
    a, b, c = (str(tmp_path / n) for n in ("dp4", "plain", "dp2"))
    a3, b3 = os.path.join(a, "step-00000003"), os.path.join(b, "step-00000003")
    runs = [
        ["--pp", "1", "--steps", "4", "--save-interval", "3", "--save-dir", a, "--zero", "1"],  # 0: dp 4, sharded
        ["--pp", "1", "--steps", "4", "--resume", a3, "--zero", "1"],                 # 1: the same layout: bitwise
        ["--pp", "2", "--steps", "5", "--resume", a3, "--zero", "1",                  # 2: dp 4 -> 2, pp 1 -> 2,
         "--save-interval", "4", "--save-dir", c],                                    # (saving sharded at dp 2)
        ["--pp", "4", "--steps", "4", "--resume", a3],                                # 3: dp 4 -> 1 (pp 4)
        ["--pp", "2", "--steps", "4", "--resume", a3],                                # 4: sharded -> unsharded dp 2
        ["--pp", "2", "--steps", "4", "--save-interval", "3", "--save-dir", b],       # 5: unsharded dp 2
        ["--pp", "1", "--steps", "4", "--resume", b3, "--zero", "1"],                 # 6: -> sharded dp 4
        ["--pp", "4", "--steps", "5", "--resume", os.path.join(c, "step-00000004")],  # 7: dp 2 sharded -> dp 1
    ]
    r = world4.run(train_runs, runs, str(tmp_path), timeout=280)[0]
    assert r[1]["first_step"] == 3 and r[1]["losses"] == r[0]["losses"][3:], (r[0]["losses"], r[1]["losses"])
    for k, (src, step) in {2: (0, 3), 3: (0, 3), 4: (0, 3), 6: (5, 3), 7: (2, 1)}.items():
        torch.testing.assert_close(r[k]["losses"][0], r[src]["losses"][step], rtol=1e-5, atol=1e-6,
                                   msg=lambda e: f"run {k}: {e}")
    info = json.loads((Path(a3) / "manifest.json").read_text())
    assert info["zero"] == 1 and info["dp"] == 4
    from pipeengine.training.checkpoint import metadata
    md = metadata(a3).state_dict_metadata   # one tensor of the parameter's shape, written in parts
    wte = md["optim.layers.0.wte.weight.exp_avg"]
    assert tuple(wte.size) == tuple(md["layers.0.wte.weight"].size) and len(wte.chunks) > 1


# ------------------------------------------------------------------ crash safety and bad input (no torchrun)

CRASH = r"""
import os, sys, torch.distributed.checkpoint.filesystem as fs
from pipeengine.training.cli import main
write = fs.FileSystemWriter.write_data
calls = [0]
def dying(self, plan, planner):
    calls[0] += 1
    if calls[0] == 2:            # the second save dies half-way: the process is killed
        os._exit(9)
    return write(self, plan, planner)
fs.FileSystemWriter.write_data = dying
main(sys.argv[1:])
"""
cli = python_cli

# killed after step 3, once the background save of step 2 is on disk: before the save of step 4
KILLED_AFTER_A_BACKGROUND_SAVE = r"""
import os, sys, time
from pipeengine.training import trainer
from pipeengine.training.cli import main
step = trainer.Trainer.train_step
def train_step(self, n):
    result = step(self, n)
    if n == 3:
        while os.path.isdir(os.path.join(self.cfg.saving.dir, ".tmp-step-00000002")):
            time.sleep(0.05)   # the loop publishes it at a step boundary: wait for the write, then end
            self.saves.publish(wait=False)
        os._exit(9)
    return result
trainer.Trainer.train_step = train_step
main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_and_is_ignored(tmp_path: Path) -> None:
    d = str(tmp_path / "ck")
    flags = ["--model", "mlp", "--steps", "4", "--save-interval", "2", "--save-dir", d, "--log-dir", str(tmp_path)]
    p = cli(*flags, code=CRASH)
    assert p.returncode == 9, p.stderr[-2000:]
    found, partial = latest(d)
    assert found is not None and found.endswith("step-00000002"), (found, os.listdir(d))
    assert [os.path.basename(x) for x in partial] == [".tmp-step-00000004"]
    assert resolve(d) == found
    resumed = cli("pipeengine.train", *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ignoring incomplete checkpoint" in resumed.stdout and "at step 2" in resumed.stdout
    assert [os.path.basename(x) for x in complete_checkpoints(d)] == ["step-00000002", "step-00000004"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bad_checkpoints_give_one_line_errors_and_overwrite_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def tool(*args: str) -> tuple[int, str, str]:   # python -m pipeengine.checkpoint, in this process
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    d = str(tmp_path / "ck")
    ok = cli("pipeengine.train", "--model", "mlp", "--steps", "2", "--save-interval", "2", "--save-dir", d,
             "--log-dir", str(tmp_path))
    assert ok.returncode == 0, ok.stderr[-2000:]
    ck = resolve(d)
    out = tmp_path / "keep.pt"
    out.write_bytes(b"precious")
    (tmp_path / "empty").mkdir()
    cases = [(str(tmp_path / "missing"), "does not exist"), (str(tmp_path / "empty"), "holds no complete checkpoint"),
             (str(out), "is a file")]
    for path, msg in cases:
        code, _, err = tool("export", path, str(out))
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    for target, msg in [(str(tmp_path / "no" / "model.pt"), f"the folder {str(tmp_path / 'no')!r} does not exist"),
                        (str(tmp_path / "empty"), "is a folder; give the file to write"),
                        ("/proc/model.pt", "cannot write '/proc/model.pt': No such file or directory")]:
        code, _, err = tool("export", ck, target)   # checked before reading, said in one line
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    shard = next(Path(ck).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])   # truncated
    code, _, err = tool("export", ck, str(out))
    assert code == 2 and "could not be read" in err and len(err.strip().splitlines()) == 1, err
    assert out.read_bytes() == b"precious"
    # a checkpoint of another model: the key and both shapes are named
    other = str(tmp_path / "other")
    assert cli("pipeengine.train", "--model", "mlp", "--preset", "small", "--steps", "1", "--save-interval", "1",
               "--save-dir", other, "--log-dir", str(tmp_path)).returncode == 0
    with pytest.raises(SystemExit) as exc:
        run(parse_args(["--model", "mlp", "--steps", "3", "--resume", other, "--log-dir", str(tmp_path)]))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert "error: checkpoint" in err and "layers.0.weight of shape (256, 32), but the model's is (64, 32)" \
        in err, err
    code, stdout, _ = tool("inspect", other)
    assert code == 0 and '"preset": "small"' in stdout and "tensors (" in stdout
    manifest = Path(resolve(other)) / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])   # truncated
    code, _, err = tool("inspect", other)
    assert code == 2 and "cannot read its manifest.json" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_background_save_is_published_when_written_not_at_the_next_save(tmp_path: Path) -> None:
    """Killed between the write of step 2 (--async-save) and the save of step 4: the restart resumes at 2."""
    d = str(tmp_path / "ck")
    flags = ["--model", "mlp", "--steps", "6", "--save-interval", "2", "--async-save", "--save-dir", d,
             "--log-dir", str(tmp_path), "--partition", "uniform"]
    killed = cli(*flags, code=KILLED_AFTER_A_BACKGROUND_SAVE)
    assert killed.returncode == 9, killed.stderr[-2000:]
    found, partial = latest(d)
    assert found is not None and found.endswith("step-00000002") and not partial, (found, os.listdir(d))
    resumed = cli("pipeengine.train", *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout, resumed.stdout[-2000:]


def test_cli_usage_and_which_folders_count_as_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main([])
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve("/nonexistent/ck")
    # a re-save of step 4 died between its renames: the old one (complete) still counts; a save that
    # died before its manifest does not; step 6's re-save finished its swap but not the clean-up
    for name in ("step-00000002", ".old-step-00000004", "step-00000006", ".old-step-00000006", ".tmp-step-00000008",
                 "step-00000010"):
        (tmp_path / name).mkdir()
        if name != "step-00000010":
            (tmp_path / name / "manifest.json").write_text("{}")
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == \
        ["step-00000002", ".old-step-00000004", "step-00000006"]
    # an empty manifest (a crash between creating it and writing it) does not make a checkpoint complete
    (tmp_path / "step-00000012").mkdir()
    (tmp_path / "step-00000012" / ".metadata").write_bytes(b"x")
    (tmp_path / "step-00000012" / "manifest.json").write_text("")
    assert os.path.basename(complete_checkpoints(str(tmp_path))[-1]) == "step-00000006"
    with pytest.raises(CheckpointError, match="is incomplete"):
        resolve(str(tmp_path / "step-00000012"))


# ------------------------------------------------------------------ restart after a rank dies (real processes)

@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_a_killed_worker_is_restarted_and_the_run_finishes_with_the_uninterrupted_loss(
        tmp_path: Path, world2: WorldPool) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOG_RANK="all")
    flags = ["--model", "mlp", "--steps", "14", "--save-interval", "2", "--log-interval", "100",
             "--eval-interval", "0", "--timeline-interval", "0"]   # no --resume: a restarted group resumes itself

    def launch(name: str, kill: bool) -> tuple[str, float]:   # (output, seconds from the kill to "resumed")
        cmd = ["bash", str(ROOT / "launch" / "pipe.sh"), "2", "cpus", "--max-restarts", "1", *flags,
               "--save-dir", str(tmp_path / name), "--log-dir", str(tmp_path), "--run-name", name]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        out, killed_at, recovered = [], 0.0, 0.0
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if kill and not killed_at and "step-00000006" in line:   # a checkpoint exists: kill rank 1
                pid = _worker_pid(proc.pid, rank=1)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at and not recovered and "resumed from" in line:
                recovered = time.monotonic() - killed_at
        proc.wait(timeout=200)
        text = "".join(out)
        assert proc.returncode == 0, text[-4000:]
        return text, recovered

    # the uninterrupted run, on two ranks without the launcher (the same computation)
    straight = world2.run(_train, [*flags, "--save-dir", str(tmp_path / "straight"), "--log-dir", str(tmp_path),
                                   "--run-name", "straight"], timeout=200)[0]
    text, recovery = launch("killed", kill=True)
    assert recovery and "restart 1: resuming from " in text, text[-3000:]
    print(f"recovery: {recovery:.1f} s from the kill to the resumed state")
    assert json_summary(tmp_path, "killed")["final_loss"] == straight["final_loss"]
    # the newest --keep 3 of the checkpoints every 2 steps, none left half-written
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path / "killed"))] == \
        ["step-00000010", "step-00000012", "step-00000014"]
    assert not [n for n in os.listdir(tmp_path / "killed") if n.startswith(".") and n != ".lock"]


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    return run(parse_args(flags))


def json_summary(tmp: Path, name: str) -> dict[str, Any]:
    import json
    return json.loads((tmp / name / "summary.json").read_text())  # type: ignore[no-any-return]


def _worker_pid(launcher: int, rank: int | str) -> int:
    """The pid of the trainer process with RANK=rank (or the environment entry ``rank``, e.g. "LOCAL_RANK=1") below
    the launcher (pipe.sh -> torchrun -> workers)."""
    entry = (rank if isinstance(rank, str) else f"RANK={rank}").encode()
    for _ in range(100):
        parents: dict[int, int] = {}
        environs: dict[int, list[bytes]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                environs[int(pid)] = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        for pid, ppid in parents.items():
            if launcher in (ppid, parents.get(ppid)) and entry in environs[pid]:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank} under launcher {launcher}")


# ------------------------------------------------------------------ what earlier versions wrote still loads

ASSETS = ROOT / "tests" / "assets"


def test_a_checkpoint_written_before_the_restructuring_loads_bitwise(tmp_path: Path) -> None:
    """tests/assets/checkpoint-v0: three layers trained 2 steps with AdamW by the code before the package
    was split into schedule/runtime/training (flat config in its manifest; checkpoint meant recompute)."""
    import torch.distributed as dist

    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.training.checkpoint import load, manifest
    from pipeengine.training.config import flat_config
    want = torch.load(ASSETS / "checkpoint-v0-expected.pt", weights_only=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        torch.manual_seed(5)   # other weights than the saved ones: loading must replace them
        layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
        engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                                microbatches=2)
        info = load(engine, str(ASSETS / "checkpoint-v0"))
        assert info["step"] == 2 and engine.step_count == 2
        assert all(torch.equal(p, w) for p, w in zip(engine.parameters, want["params"]))
        for i, p in enumerate(engine.parameters):
            assert all(torch.equal(engine.optimizer.state[p][k], v) for k, v in want["state"][i].items())
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(2)]
        assert engine.train_batch(iter(data)).loss == want["loss"]   # the next step, as the old code took it
    finally:
        dist.destroy_process_group()
    old = flat_config(manifest(str(ASSETS / "checkpoint-v0" / "step-00000002"))["config"])
    assert (old["model"], old["steps"], old["lr"], old["recompute"]) == ("mlp", 5, 0.01, "full")


def test_a_config_file_written_before_sections_loads() -> None:
    cfg = parse_args(["--config", str(ASSETS / "config-v0.toml")])
    assert (cfg.model.name, cfg.optimizer.steps, cfg.recompute.policy, cfg.data.micro_batch_size) == \
        ("mlp", 7, "full", 2)
    # the file gives microbatches = 4 and preset = "tiny", the defaults it was written with (now the global batch
    # and the model choose them)
    assert cfg == parse_args(["--model", "mlp", "--steps", "7", "--recompute", "full", "-b", "2", "-m", "4",
                              "--preset", "tiny"])


# ------------------------------------------------------------------ many nodes

def _setup_in_own_folder(rank: int, world: int, folder: str, flags: list[str]) -> str:
    """Each rank in a folder of its own, as nodes without a shared filesystem see a relative --save-dir."""
    from pipeengine.training.trainer import Trainer
    here = os.getcwd()
    os.makedirs(os.path.join(folder, f"node{rank}"), exist_ok=True)
    os.chdir(os.path.join(folder, f"node{rank}"))
    try:
        Trainer(parse_args(flags)).setup()
        return "set up"
    except ValueError as exc:
        return str(exc)
    finally:
        os.chdir(here)


def test_a_save_dir_that_is_not_one_folder_for_every_node_is_refused(tmp_path: Path, world2: WorldPool) -> None:
    flags = ["--model", "mlp", "--save-interval", "1", "--save-dir", "ck", "--log-dir", str(tmp_path / "runs"),
             "--partition", "uniform"]
    apart = world2.run(_setup_in_own_folder, str(tmp_path), flags)
    assert apart[0] == apart[1], apart
    assert apart[0].startswith("--save-dir 'ck' is not one folder for every node: node "), apart
    assert "(rank 1) does not see the file rank 0 wrote in it" in apart[0]
    shared = world2.run(_setup_in_own_folder, str(tmp_path), [*flags[:5], str(tmp_path / "ck"), *flags[6:]])
    assert shared == ["set up", "set up"] and os.listdir(tmp_path / "ck") == [".lock"]   # the probe is gone


def test_the_save_on_sigterm_is_bounded_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import signal as signals

    from pipeengine.training.saves import Saves
    t = Saves.__new__(Saves)   # only what the exit save reads
    t.cfg, t.rank, saved = parse_args(["--exit-save-budget", "20"]), 0, []

    def fake_save(step: int, newline: bool = False) -> None:
        saved.append(step)
        t.last_s = 3.0
    t.save = fake_save   # type: ignore[method-assign]
    t.last_s = 41.0   # the last save took longer than torchrun's grace
    t.on_exit(7, signals.SIGTERM)
    assert saved == [] and "exit save skipped: the last save took 41.0 s, more than the 20 s allowed after " \
                           "SIGTERM (--exit-save-budget)" in capsys.readouterr().err
    t.last_s = 2.0
    t.on_exit(7, signals.SIGTERM)
    assert saved == [7] and "exit save: 3.0 s of the 20 s allowed after SIGTERM" in capsys.readouterr().err
    t.last_s = 41.0
    t.on_exit(8, signals.SIGINT)   # Ctrl-C: no launcher's deadline follows
    assert saved == [7, 8]


# ------------------------------------------------------------------ the global batch under another layout

def _layout_runs(rank: int, world: int, runs: list[list[str]], tmp: str) -> list[dict[str, Any]]:
    import contextlib
    import io
    torch.set_num_threads(1)
    out = []
    for i, flags in enumerate(runs):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            s = run(parse_args(["--model", "gpt", "--preset", "tiny", "--eval-interval", "0", "--partition", "uniform",
                                "--log-dir", os.path.join(tmp, "runs"), "--run-name", f"w{world}r{i}", "--quiet",
                                *flags]))
        out.append({"losses": s["losses"], "first_step": s["first_step"], "batch": s["global_batch"],
                    "text": text.getvalue()})
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resuming_under_another_layout_keeps_the_global_batch(tmp_path: Path, world2: WorldPool,
                                                              world4: WorldPool) -> None:
    """The same command (no batch flags) resumed from pp 2 x dp 1 as pp 1 x dp 2 and as pp 4 x dp 1 trains on
    the saved global batch (more or fewer microbatches per replica) and continues the uninterrupted run."""
    saves = str(tmp_path / "saves")
    step3 = os.path.join(saves, "step-00000003")
    straight, resumed_dp2 = world2.run(_layout_runs, [
        ["--pp", "2", "--steps", "6", "--save-interval", "3", "--save-dir", saves],   # pp 2 x dp 1, saved at 3
        ["--pp", "1", "--steps", "6", "--resume", step3],                             # pp 1 x dp 2
    ], str(tmp_path), timeout=280)[0]
    resumed_pp4 = world4.run(_layout_runs, [["--pp", "4", "--steps", "6", "--resume", step3]], str(tmp_path),
                             timeout=280)[0][0]
    assert straight["batch"] == 32 and "global batch 32" in straight["text"]
    for resumed in (resumed_dp2, resumed_pp4):
        assert resumed["first_step"] == 3 and resumed["batch"] == 32
        torch.testing.assert_close(resumed["losses"], straight["losses"][3:], rtol=1e-5, atol=0)
    assert "resuming with the checkpoint's global batch 32 = dp 2 x 4 microbatches x 4 (it was 4 microbatches " \
           "of 8)" in resumed_dp2["text"]   # the pipeline keeps its 4 microbatches per replica
    assert "global batch" not in resumed_pp4["text"].split("resumed from")[0]   # 4 x 8 at dp 1 still: no note


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_changed_bytes_name_the_tensor_and_unusable_folders_are_said(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A bit flipped anywhere in a shard either changes nothing that is read or is an error (never weights
    changed without a word); a changed weight is named. A newer step folder without its manifest is passed over
    with a line; a manifest's schedule_costs that are not [f, b, w] are named."""
    d = tmp_path / "ck"
    flags = ["--model", "mlp", "--steps", "2", "--log-dir", str(tmp_path / "runs"), "--quiet", "--eval-interval", "0"]
    run(parse_args([*flags, "--save-interval", "2", "--save-dir", str(d), "--partition", "uniform"]))
    ck = Path(resolve(str(d)))
    assert export(str(ck), str(tmp_path / "good.pt")) > 0
    good = torch.load(tmp_path / "good.pt")
    shard = next(ck.glob("*.distcp"))
    original = shard.read_bytes()
    named: list[int] = []
    for offset in range(37, len(original), max(1, len(original) // 24)):
        damaged = bytearray(original)
        damaged[offset] ^= 1 << (offset % 8)
        shard.write_bytes(bytes(damaged))
        try:
            export(str(ck), str(tmp_path / "out.pt"))
        except CheckpointError as exc:
            if "does not match its checksum" in str(exc):
                named.append(offset)
            continue
        loaded = torch.load(tmp_path / "out.pt")
        assert all(torch.equal(loaded[k], good[k]) for k in good), offset   # a flip outside what is read
    assert len(named) >= 3, named   # the others hit headers (an error) or bytes nothing reads
    # resuming from a changed weight: one line naming it
    damaged = bytearray(original)
    damaged[named[0]] ^= 1 << (named[0] % 8)
    shard.write_bytes(bytes(damaged))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run(parse_args([*flags, "--steps", "3", "--resume", str(ck)]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.fullmatch(r"error: checkpoint '.*' is damaged: [\w.]+ does not match its "
                                                r"checksum \(written [0-9a-f]{8}, read [0-9a-f]{8}\): the file changed "
                                                r"after it was saved; resume from another checkpoint\n", err), err
    shard.write_bytes(original)
    # a newer step folder without a manifest (an unfinished copy): passed over, and said
    newer = d / "step-00000009"
    newer.mkdir()
    (newer / ".metadata").write_bytes(b"")
    run(parse_args([*flags, "--steps", "3", "--resume", "latest", "--save-dir", str(d)]))
    out = capsys.readouterr().out
    assert f"ignoring incomplete checkpoint {newer} (it has no manifest.json: a save or copy that did not finish)" \
        in out, out
    # schedule_costs that are no [f, b, w]
    manifest = ck / "manifest.json"
    info = json.loads(manifest.read_text())
    for costs in ("abc", [1, -1, 2]):
        manifest.write_text(json.dumps({**info, "schedule": "1f1b", "schedule_costs": costs}))
        with pytest.raises(SystemExit) as exc:
            run(parse_args([*flags, "--steps", "3", "--resume", str(ck), "--partition", "profile"]))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"has schedule_costs {costs!r}, not [f, b, w]" in err, (costs, err)


@pytest.mark.timeout(120)
def test_two_runs_saving_into_one_folder_is_refused_naming_the_other(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "ck")
    holder = subprocess.Popen([sys.executable, "-c", "import time; from pipeengine.training.savedir import _claim; "
                               f"_claim({d!r}, '--save-dir'); print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as exc:
            run(parse_args(["--model", "mlp", "--steps", "2", "--save-interval", "1", "--save-dir", d,
                            "--log-dir", str(tmp_path / "runs"), "--quiet"]))
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.fullmatch(
        rf"error: --save-dir '{re.escape(d)}' is in use by another run \(pid {holder.pid} on .+, since .+\); give "
        r"each run its own --save-dir\n", err), err
