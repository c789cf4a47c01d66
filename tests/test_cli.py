"""What the user sees: help, config files, progress on a terminal, the summary's decomposition, the launcher."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeengine.train import PRECISION_NAMES, STARTUP_TIMEOUT, parse_args, run, to_toml

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_default_and_every_preset_without_importing_torch() -> None:
    code = ("import sys, pipeengine.train as t\ntry:\n    t.parse_args(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert out.strip().endswith("TORCH False"), out[-300:]
    text = " ".join(out[out.index("options:"):].split())   # argparse wraps lines
    for flag, default in [("--lr", "0.003"), ("--warmup", "5"), ("--microbatches", "4"), ("--seed", "1234"),
                          ("--grad-clip", "1.0"), ("--steps", "50"), ("--keep", "3"), ("--on-nonfinite", "stop")]:
        after = text[text.index(f"{flag} "):]
        assert f"(default: {default})" in after[:400], flag
    assert ("gpt: tiny, small, gpt2-124m; resnet: tiny, resnet18, resnet18-gn, resnet50, resnet50-imagenet; mlp: "
            "tiny, small, large") in text


def test_constants_named_for_a_torch_free_help_match_their_sources() -> None:
    from pipeengine.faults import STARTUP_TIMEOUT as startup
    from pipeengine.stage import PRECISIONS
    assert STARTUP_TIMEOUT == startup and PRECISION_NAMES == tuple(PRECISIONS)


def test_config_file_then_flags_and_unknown_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\nsteps = 7\nmicro-batch-size = 2\nlr = 1\nsave_on_exit = true\n')
    cfg = parse_args(["--config", str(path), "--steps", "9"])
    assert (cfg.model, cfg.steps, cfg.micro_batch_size, cfg.lr, cfg.save_on_exit) == ("mlp", 9, 2, 1.0, True)
    # --print-config writes a complete file that reads back to the same settings
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path), "--steps", "9", "--print-config"])
    assert exc.value.code == 0
    (tmp_path / "again.toml").write_text(capsys.readouterr().out)
    assert parse_args(["--config", str(tmp_path / "again.toml")]) == cfg
    assert to_toml(cfg).count("\n") == len(cfg.__dataclass_fields__) + 1
    for text, message in [("stepz = 3\n", "unknown setting 'stepz'; did you mean 'steps'?"),
                          ('steps = "many"\n', "steps = 'many' should be int"),
                          ("steps = \n", "is not valid TOML")]:
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            parse_args(["--config", str(path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_one_process_run_decomposes_its_steps_and_shows_bubble_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGINT)
    s = run(parse_args(["--model", "mlp", "--steps", "6", "--log-dir", str(tmp_path), "--run-name", "r", "--quiet"]))
    assert signal.getsignal(signal.SIGINT) is before   # run() gives Ctrl-C back to its caller
    out = capsys.readouterr().out
    assert s["measured_bubble"] == 0.0 and s["theoretical_bubble"] == 0.0 and s["status"] == "done"
    assert sum(s["step_parts"].values()) == pytest.approx(1.0, abs=0.02)
    assert s["warmup_steps"] == 1 and s["timed_steps"] == [1, 2, 3, 4, 5]
    assert "(5 timed steps, the first 1 left out as warm-up)" in out and "step time  compute " in out
    assert "[####" not in out   # --quiet
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "r"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("pipeline/timeline")] == [1, 5]   # first step after warm-up, and the last
    assert acc.Scalars("time/stage0/bubble")[-1].value == 0.0
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["steps_done"] == 6 and saved["config"]["model"] == "mlp"


@pytest.mark.timeout(120)
def test_progress_on_a_terminal_is_one_updating_line_with_eta(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "pipeengine.train", "--model", "mlp", "--steps", "8",
                             "--log-dir", str(tmp_path)], cwd=ROOT, stdout=slave, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data.decode())
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    text = "".join(chunks)
    progress = text[text.index("[", text.index("logs in")):text.index("=" * 72)]
    updates = [u for u in progress.split("\r") if u.strip()]
    assert proc.returncode == 0
    assert len(updates) == 8 and all("ETA 0:00:" in u and "steps/s" in u for u in updates), updates
    assert progress.count("\n") == 1   # only after the last update


def _pipe_sh(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "launch" / "pipe.sh"), *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **env))


def test_pipe_sh_gpus_without_a_gpu_says_so_in_one_line_before_starting_workers(tmp_path: Path) -> None:
    (tmp_path / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\nexec {sys.executable} \"$@\"\n")
    (tmp_path / "python").chmod(0o755)
    r = _pipe_sh("2", "gpus", "--model", "mlp", PYTHON=str(tmp_path / "python"),
                 PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                      if not os.path.exists(os.path.join(p, "nvidia-smi"))))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("pipe.sh: asked for 2 gpus but no CUDA GPU is visible on this node; use "
                        "'launch/pipe.sh 2 cpus'\n")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 1 and "torch.cuda.device_count()" in calls[0]   # torch counted; no torchrun, no worker


def test_pipe_sh_help_is_only_usage() -> None:
    h = _pipe_sh("-h")
    assert h.returncode == 0 and h.stdout.startswith("launch/pipe.sh")
    assert not any(line.startswith(("set ", "usage()", "if ")) for line in h.stdout.splitlines())
    assert h.stdout.rstrip().endswith("Slurm: see launch/slurm.sbatch.")
