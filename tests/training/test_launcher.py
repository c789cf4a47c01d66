"""launch/pipe.sh: the real job through torchrun, its own checks, signals, and what it leaves behind."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (ROOT, WorldPool, free_port, on_a_terminal, pipe_sh, pipe_sh_command, pipe_sh_job,
                           process_tree, start_pipe_sh_job)


def launch(tmp_path: Path, n: int, *flags: str, timeout: float = 240) -> dict[str, Any]:
    """The job's summary.json, and what it printed (``stdout``)."""
    proc = pipe_sh_job(tmp_path, n, *flags, timeout=timeout)
    summary: dict[str, Any] = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["stdout"] = proc.stdout + proc.stderr
    return summary


@pytest.mark.slow
@pytest.mark.launcher
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
            *(f"time/position{p}/{part}" for p in (0, 1) for part in ("compute", "bubble", "comm", "overhead", "sync"))}
    assert want <= set(tags["scalars"]), want - set(tags["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]   # the steps done, as the console counts
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


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_resnet_and_mlp_train_under_pp2(tmp_path: Path, world2: WorldPool) -> None:
    r = launch(tmp_path / "r", 2, "--model", "resnet", "--preset", "tiny", "--steps", "2", "--micro-batch-size", "2",
               "--eval-interval", "0")
    assert r["pp"] == 2 and math.isfinite(r["final_loss"])
    m = world2.run(_train, ["--model", "mlp", "--steps", "30", "--eval-interval", "0", "--lr", "1e-2", "--pp", "2",
                            "--log-dir", str(tmp_path / "m"), "--quiet"])[0]   # the same trainer, ranks reused
    assert m["pp"] == 2 and m["final_loss"] < 0.5 * m["first_loss"]


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    from pipeengine.training.cli import parse_args
    from pipeengine.training.trainer import run
    return run(parse_args(flags))


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
    few = pipe_sh("8", "gpus", env={"PATH": str(tmp_path) + os.pathsep + os.environ["PATH"]})
    assert few.returncode == 2 and "asked for 8 gpus but this node has 1" in few.stderr
    port = str(free_port())   # a second node started without the first: named, not a torchrun traceback
    alone = pipe_sh("2", "cpus", env={"NNODES": "2", "NODE_RANK": "1", "MASTER_PORT": port, "RDZV_TIMEOUT": "1"})
    assert alone.returncode == 2 and alone.stderr.rstrip().endswith(
        f"pipe.sh: node 0 (127.0.0.1:{port}) did not answer within 1 s; start node 0 first (NODE_RANK=0), or check "
        "MASTER_ADDR, MASTER_PORT and the firewall"), alone.stderr
    for nnodes, said in (("2:x", "NNODES must be a number of nodes or a range MIN:MAX (got '2:x')"),
                         ("3:2", "NNODES=3:2: MIN is larger than MAX"),
                         ("1:2", "NNODES=1:2 (elastic) needs RDZV_ID, a name for this job that is the same on every "
                                 "node")):
        r = pipe_sh("2", "cpus", env={"NNODES": nnodes, "SLURM_JOB_ID": "", "RDZV_ID": ""})
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_pipe_sh_gpus_without_a_gpu_says_so_in_one_line_before_starting_workers(tmp_path: Path) -> None:
    (tmp_path / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\nexec {sys.executable} \"$@\"\n")
    (tmp_path / "python").chmod(0o755)
    r = pipe_sh("2", "gpus", "--model", "mlp", env={
        "PYTHON": str(tmp_path / "python"),
        "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                if not os.path.exists(os.path.join(p, "nvidia-smi")))})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("pipe.sh: asked for 2 gpus but no CUDA GPU is visible on this node; use "
                        "'launch/pipe.sh 2 cpus'\n")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 1 and "torch.cuda.device_count()" in calls[0]   # torch counted; no torchrun, no worker


def test_pipe_sh_help_is_only_usage() -> None:
    h = pipe_sh("-h")
    assert h.returncode == 0 and h.stdout.startswith("launch/pipe.sh")
    assert not any(line.startswith(("set ", "usage()", "if ")) for line in h.stdout.splitlines())
    assert h.stdout.rstrip().endswith("Slurm: see launch/slurm.sbatch.")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Leave nothing behind, whatever the test saw: the launcher's session, and its workers if reparented."""
    for pid in _workers(proc.pid):
        os.kill(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=10)


def _workers(launcher: int) -> list[int]:
    """The trainer processes below ``launcher`` (pipe.sh -> torchrun -> workers)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    rows = [(int(p), int(pp), " ".join(a)) for p, pp, *a in (r.split() for r in out)]
    below, found = {launcher}, []
    for _ in range(4):
        for pid, ppid, args in rows:
            if ppid in below and pid not in below:
                below.add(pid)
                if "pipeengine.train" in args and "torch.distributed.run" not in args:
                    found.append(pid)
    return found


def _until_gone(pids: list[int], limit: float = 20) -> float:
    """Seconds until every process in ``pids`` has ended (at most ``limit``)."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < limit:
        time.sleep(0.2)
    return time.monotonic() - t0


def _kill_survivors(workers: list[int], proc: subprocess.Popen[str]) -> list[int]:
    """Kill what a test left running; the workers that were still alive."""
    survivors = [w for w in workers if _alive(w)]
    for w in survivors:
        os.kill(w, signal.SIGKILL)
    _kill_group(proc)
    return survivors


def _unprefixed(out: str) -> str:
    """Rank 0's output as torchrun shows it off a terminal, without its ``[default0]:`` prefix."""
    return re.sub(r"(?m)^\[default0\]:", "", out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_rank_saves_and_writes_the_summary(tmp_path: Path) -> None:
    proc = _endless(tmp_path, "--save-on-exit", "--save-dir", str(tmp_path / "ck"))
    try:
        _wait_for_step_line(proc, "step 3/")
        os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in a terminal does
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"pipe.sh still running 60 s after SIGINT:\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        _kill_group(proc)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT: every rank stopped after step" in err and "Traceback" not in err, err[-3000:]
    out = _unprefixed(out)
    assert "=" * 72 in out and "\nloss       first " in out   # the summary block, on Ctrl-C too
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    done = summary["steps_done"]
    assert summary["status"] == f"stopped by SIGINT after step {done}" and len(summary["losses"]) == done
    assert os.path.isdir(tmp_path / "ck" / f"step-{done:08d}"), os.listdir(tmp_path / "ck")


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_killing_the_launcher_any_way_leaves_no_worker(tmp_path: Path) -> None:
    """Three jobs at once (their start-ups overlap): torchrun killed with SIGKILL; pipe.sh's pid alone sent SIGTERM
    and SIGKILL, as a container runtime or a scheduler does (not its process group). No worker survives; SIGTERM is
    passed on: every worker stops after the same step and says so, with the summary."""
    how = {"torchrun SIGKILL": signal.SIGKILL, "pipe.sh SIGTERM": signal.SIGTERM, "pipe.sh SIGKILL": signal.SIGKILL}
    jobs = {name: _endless(tmp_path / name.replace(" ", "-")) for name in how}
    workers: dict[str, list[int]] = {name: [] for name in how}
    outputs: dict[str, tuple[str, str]] = {}
    try:
        for name, proc in jobs.items():
            _wait_for_step_line(proc, "step 2/")
            torchrun, workers[name] = _workers_parent(proc.pid), _workers(proc.pid)
            assert len(workers[name]) == 2 and len(torchrun) == 1, (name, workers[name], torchrun)
            os.kill(torchrun[0] if name.startswith("torchrun") else proc.pid, how[name])
            if name.startswith("pipe.sh"):
                workers[name] += torchrun
        for name, proc in jobs.items():
            _until_gone(workers[name])
            if name.startswith("pipe.sh"):
                outputs[name] = proc.communicate(timeout=30)
    finally:
        survivors = {name: _kill_survivors(workers[name], proc) for name, proc in jobs.items()}
    assert not any(survivors.values()), survivors   # (gone within _until_gone's limit: how soon is a benchmark's)
    out, err = outputs["pipe.sh SIGTERM"]
    assert jobs["pipe.sh SIGTERM"].returncode == 143 and "SIGTERM: every rank stopped after step" in err, err[-3000:]
    assert "\nloss       first " in _unprefixed(out)


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_pipe_sh_on_a_terminal_updates_rank_0s_progress_in_place(tmp_path: Path) -> None:
    """Rank 0 writes to the terminal itself (no torchrun prefix); every rank's output is in the run's ranks/."""
    cmd, env = pipe_sh_command(tmp_path, 2, ("--model", "mlp", "--steps", "12"), None)
    code, text = on_a_terminal(cmd, env, tmp_path, stderr_too=True, timeout=120)
    assert code == 0, text[-3000:]
    updates = [u for u in text[text.index("[", text.index("logs in")):text.index("=" * 72)].split("\r") if u.strip()]
    assert len(updates) == 12 and all(u.startswith("[") and "steps/s" in u for u in updates), updates
    assert "[default0]:[" not in text and "\nloss       first " in text.replace("\r\n", "\n")
    logs = sorted((tmp_path / "run" / "ranks").glob("*/attempt_0/*/stdout.log"))
    assert len(logs) == 2 and "step 12/12" in logs[0].read_text() and "\r" not in logs[0].read_text()


def _workers_parent(launcher: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    return [int(r.split()[0]) for r in out if int(r.split()[1]) == launcher and "torch.distributed.run" in r]


def _wait_for_step_line(proc: subprocess.Popen[str], text: str, limit: float = 90) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"pipe.sh exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError(f"no {text!r} within {limit} s")


def test_pipe_sh_names_a_port_in_use_before_starting_anything() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(os.environ, NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        proc = subprocess.run(["bash", str(ROOT / "launch" / "pipe.sh"), "1", "cpus"], capture_output=True,
                              text=True, timeout=30, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"pipe.sh: port {port} on 127.0.0.1 is already in use; set MASTER_PORT to a free "
                                   f"port (the same on every node)")


def _endless(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    """An mlp run that would go on for a long time, printing a progress line every step."""
    return start_pipe_sh_job(tmp_path, 2, "--model", "mlp", "--steps", "100000", "--log-interval", "1", *flags)


_RAISING_MODEL = '''
import torch
from torch import nn

import pipeengine
from pipeengine.training.models import load_model


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


class Boom(nn.Module):
    def forward(self, x):
        return _Boom.apply(x)


def model(preset, data):
    built = load_model("mlp", None, None)
    return pipeengine.Model(layers=[*built.layers[:-1], Boom, built.layers[-1]], loss_fn=built.loss_fn, data=built.data)
'''


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_a_layer_raising_in_backward_shows_one_traceback_and_every_rank_keeps_its_own(tmp_path: Path) -> None:
    """pp 2 x dp 2: the last stage's ranks raise in B0. On screen: rank 0's one line and the failing rank's
    traceback, nothing of torchrun's; exit 3; each rank's own output in the run folder's ranks/."""
    (tmp_path / "raising.py").write_text(_RAISING_MODEL)
    proc = pipe_sh_job(tmp_path, 4, "--model", "raising:model", "--partition", "uniform", "--steps", "3",
                       env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}, check=False)
    err = _unprefixed(proc.stderr)
    assert proc.returncode == 3, err[-3000:]
    assert re.search(r"^error: rank [23] \(position 1, replica [01], step 0\) failed in B0: RuntimeError: injected "
                     r"failure in backward\nTraceback \(most recent call last\):", err, re.M), err
    assert err.count("Traceback") == 1 and "ChildFailedError" not in err and len(err.splitlines()) < 40, err
    logs = {int(p.parent.name): p.read_text() for p in (tmp_path / "run" / "ranks").glob("*/attempt_0/*/stderr.log")}
    assert sorted(logs) == [0, 1, 2, 3]
    assert any("raise RuntimeError(\"injected failure in backward\")" in logs[r] for r in (2, 3)), logs


@pytest.mark.launcher
@pytest.mark.timeout(60)
def test_pipe_sh_shows_a_report_made_by_a_rank_it_does_not_show(tmp_path: Path) -> None:
    """Rank 0 stopped (SIGSTOP) or dead: another rank writes the wait-for report, into its own output and a file
    pipe.sh shows at the end. Here a fake interpreter plays torchrun and that rank (no torch: quick)."""
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/bash\n'
                    'if [[ "$1" == -c ]]; then shift 2; exec "$@"; fi   # the wrapper: run the command\n'
                    'echo "report: rank 0 said nothing; likely culprit: rank 0" '
                    '> "$PIPEENGINE_RANK_LOGS/shown-by-rank1.txt"\n'
                    'exit 3\n')
    fake.chmod(0o755)
    proc = pipe_sh_job(tmp_path, 2, env={"PYTHON": str(fake)}, check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.rstrip().endswith("report: rank 0 said nothing; likely culprit: rank 0"), proc.stderr


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_node_that_never_comes_and_a_killed_output_filter_are_said(tmp_path: Path) -> None:
    """NNODES=2:4 with node 1 never started: one line naming the rendezvous and the knobs (not torchrun's traceback
    with an empty message); the output filter (quiet.awk) killed under a running job: said, with torchrun's own
    exit status, not a bare 137."""
    job = start_pipe_sh_job(tmp_path / "job", 1, "--model", "mlp", "--steps", "30")   # runs while the other waits
    awk = _descendant(job.pid, b"quiet.awk")
    os.kill(awk, signal.SIGKILL)
    port = str(free_port())
    alone = pipe_sh("1", "cpus", "--model", "mlp", "--steps", "2", "--log-dir", str(tmp_path), cwd=tmp_path,
                    env={"NNODES": "2:4", "NODE_RANK": "0", "MASTER_PORT": port, "RDZV_ID": "t", "RDZV_TIMEOUT": "2"})
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    assert alone.stderr.rstrip().endswith(
        f"pipe.sh: the nodes' rendezvous timed out: fewer than 2 node(s) (NNODES=2:4) joined at 127.0.0.1:{port} "
        "within RDZV_TIMEOUT=2 s; start the other nodes (NODE_RANK=1, 2, ...) with the same NNODES, MASTER_ADDR, "
        "MASTER_PORT and RDZV_ID, or lower NNODES' minimum"), alone.stderr
    _, err = job.communicate(timeout=100)
    assert "pipe.sh: the output filter (quiet.awk) ended with status 137 (killed?)" in err, err
    assert job.returncode != 137 and f"torchrun exited {job.returncode}" in err, (job.returncode, err)


def _descendant(root: int, name: bytes, timeout: float = 60.0) -> int:
    """The first process below ``root`` whose command line holds ``name``, once it has started (pipe.sh starts
    torchrun and the filter after its own checks: on a loaded machine that takes seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in sorted(process_tree(root) - {root}):
            try:
                if name in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:   # (gone meanwhile)
                pass
        time.sleep(0.05)
    raise AssertionError(f"no process with {name!r} in its command line below {root} after {timeout:.0f} s")
