"""Never hang silently, never lie: bad inputs named, failures reach every rank, hangs explained, NaN policy."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.faults import adaptive_timeout, wait_for_report
from pipeengine.layers import fingerprint, model_mismatch
from pipeengine.metrics import write_json
from pipeengine.train import parse_args, run
from tests.harness import free_port, run_distributed

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ units

def test_a_cuda_wait_leaves_the_host_free_and_fp16_scaling_follows_overflows() -> None:
    """No GPU here: the CUDA branches are checked on fakes. A CUDA wait is ``work.wait()`` without a
    timeout (which would make it a host busy-wait that aborts the communicator); NCCL's watchdog
    enforces the group's timeout."""
    from pipeengine.faults import Watch
    from pipeengine.grad_sync import LossScale

    class Work:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def wait(self, *args: Any, **kwargs: Any) -> bool:
            self.calls.append((args, kwargs))
            return True

    class Store:
        def set(self, *a: Any) -> None:
            pass

        def check(self, *a: Any) -> bool:
            return False

    w = Watch(Store(), 0, 1)
    cuda, cpu = Work(), Work()
    w.wait(cuda, "sendF0>1", [1], cuda=True)
    w.wait(cpu, "sendF0>1", [1])
    assert cuda.calls == [((), {})] and "timeout" in cpu.calls[0][1]
    scale = LossScale(enabled=True)
    scale.update(overflow=True)
    assert scale.value == 2.0**15 and scale.good_steps == 0
    for _ in range(2000):
        scale.update(overflow=False)
    assert scale.value == 2.0**16
    for _ in range(39):   # far below 1: overflows are still seen and skipped (a scale of 1 is no "off")
        assert scale.overflow(math.inf)
        scale.update(overflow=True)
    assert scale.value == 2.0**-23 and scale.overflow(math.inf) and not scale.overflow(3.0)
    scale.update(overflow=True)   # at the floor a non-finite gradient is non-finite: on_nonfinite decides
    assert scale.value == LossScale.FLOOR and not scale.overflow(math.inf)
    off = LossScale(enabled=False)
    off.update(overflow=True)
    assert off.value == 1.0


def test_wait_for_report_names_the_silent_rank_and_the_cycle() -> None:
    lines = {0: {"rank": 0, "context": "position 0, replica 0, step 21", "state": "waits", "what": "recvB0<1",
                 "peers": [2], "secs": 20.0},
             1: {"rank": 1, "context": "position 0, replica 1, step 21", "state": "waits",
                 "what": "the data-parallel gradient all-reduce", "peers": [0], "secs": 19.5},
             3: {"rank": 3, "context": "position 1, replica 1, step 21", "state": "runs", "what": "F3", "peers": [],
                 "secs": 0.0}}
    report = wait_for_report(lines, 4, 20, {2: "pid 4242 on node7"}).splitlines()
    assert report[0] == "pipeengine: wait-for report (a wait exceeded 20 s; 3 of 4 ranks answered)"
    assert report[1] == "  rank 0 (position 0, replica 0, step 21): waits 20.0 s in recvB0<1 for rank(s) 2"
    assert report[3] == "  rank 3 (position 1, replica 1, step 21): runs F3"
    assert report[4] == "  rank 2 (pid 4242 on node7): said nothing: stopped, dead or stuck outside the engine"
    assert report[-1] == "  likely culprit: rank 2 (said nothing)"
    deadlock = {r: {"rank": r, "context": "", "state": "waits", "what": "x", "peers": [(r + 1) % 3], "secs": 5.0}
                for r in range(3)}
    assert "cycle: rank 0 -> rank 1 -> rank 2 -> rank 0" in wait_for_report(deadlock, 3, 5)


def test_model_mismatch_names_the_first_differing_layer_and_the_ranks() -> None:
    f32 = torch.float32
    a = [fingerprint(nn.Linear(8, 16, dtype=f32)), fingerprint(nn.Linear(16, 4, dtype=f32))]
    b = [fingerprint(nn.Linear(8, 16, dtype=f32)), fingerprint(nn.Linear(16, 5, dtype=f32))]
    assert model_mismatch([(0, a), (0, a)]) is None
    assert model_mismatch([(0, a), (0, a), (0, b)]) == (
        "the ranks were given different models: layer 1 is Linear(weight (4, 16), bias (4,)) on ranks 0, 1 but "
        "Linear(weight (5, 16), bias (5,)) on rank 2; every rank must be given the same layer list (same code, "
        "model, preset and seed)")
    short = str(model_mismatch([(0, a), (0, a[:1])]))
    assert "layer lists of different length: 2 on rank 0 but 1 on rank 1 layers" in short
    assert "different seeds: 0 on rank 0 but 1 on rank 1" in str(model_mismatch([(0, a), (1, a)]))


def test_summary_json_is_strict_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "run" / "summary.json"
    write_json(str(path), {"loss": float("nan"), "xs": [1.0, float("inf")], "ok": 2})
    assert json.loads(path.read_text()) == {"loss": None, "xs": [1.0, None], "ok": 2}
    assert os.listdir(path.parent) == ["summary.json"]   # no temporary left behind


def test_adaptive_timeout() -> None:
    assert adaptive_timeout([]) == 600
    assert adaptive_timeout([0.1, 0.2, 0.3]) == 60
    assert adaptive_timeout([5.0, 4.0, 6.0]) == 100


# ------------------------------------------------------------------ every bad input named before the first step

def _file(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


BAD_INPUTS: list[tuple[list[str], str]] = [
    (["--timeout", "0"], "error: --timeout must be a positive number of seconds (got 0)"),
    (["--timeout", "-5"], "error: --timeout must be a positive number of seconds (got -5)"),
    (["--global-batch", "-8"], "error: --global-batch must be a positive number of examples (got -8)"),
    (["--steps", "10", "--trace-step", "12"], "error: --trace-step 12 is not one of the run's steps 0..9"),
    (["--partition", "0,3"], "error: boundaries [0, 3] must be 2 strictly increasing indices from 0 to 8"),
    (["--partition", "half"], "error: --partition must be profile, parameters, uniform or stage bounds like 0,3,6,10"),
    (["--model", "mlp", "--eval-interval", "-1"], "error: --eval-interval must be >= 0 (got -1)"),
    (["--data", "{tmp}/empty.txt"], "error: --data '{tmp}/empty.txt' is empty; give a text file"),
    (["--data", "{tmp}/blob.bin"], "error: --data: '{tmp}/blob.bin' is binary (it holds NUL bytes), not text"),
    (["--data", "{tmp}/short.txt"], "error: the train text has 9 bytes, fewer than block_size+1"),
    (["--data", "{tmp}/nofiles"], "error: --data '{tmp}/nofiles' is empty (a folder without files)"),
    (["--log-dir", "{tmp}/short.txt/logs"], "error: --log-dir '{tmp}/short.txt/logs' cannot be created: Not a "
                                            "directory; choose a writable folder"),
]


@pytest.mark.timeout(120)
def test_bad_inputs_give_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _file(tmp_path, "empty.txt", b"")
    _file(tmp_path, "blob.bin", b"text\x00\x01\x02" * 100)
    _file(tmp_path, "short.txt", b"0123456789")
    (tmp_path / "nofiles").mkdir()
    for flags, message in BAD_INPUTS:
        flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
        if "--log-dir" not in flags:
            flags += ["--log-dir", str(tmp_path / "runs")]
        with pytest.raises(SystemExit) as exc:
            run(parse_args(["--steps", "2", *flags]))
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2, (flags, err)
        assert len(err) == 1 and err[0].startswith(message.replace("{tmp}", str(tmp_path))), (flags, err)
        assert not torch.distributed.is_initialized()


def test_binary_schedule_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeengine.schedule import main
    path = tmp_path / "sched.bin"
    path.write_bytes(b"F0 B0\n\xff\xfe\x00")
    assert main(["--file", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: schedule file {str(path)!r} is not UTF-8 text (byte 0xff at offset 6); "
                                       f"a schedule file has one line per rank, e.g. F0 F1 B0 B1\n")


def mismatch_worker(rank: int, world: int) -> list[str]:
    from pipeengine.engine import PipelineEngine
    from pipeengine.faults import watch
    watch().kill_after = 60   # let the blocked rank raise when rank 1's process ends (not end itself)
    out = []
    for layers in ([nn.Linear(4, 4) for _ in range(3 + rank)],                        # another depth
                   [nn.Linear(4, 4), nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 4)]):  # other shapes
        try:
            PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
            out.append("built")
        except ValueError as exc:
            out.append(str(exc))
    # a stage whose output the next stage cannot take: named on every rank, no hang
    layers = [nn.Linear(4, 6), nn.Linear(4, 4)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                            microbatches=2, timeout=30)
    try:
        engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))] * 2))
        out.append("trained")
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
    return out


@pytest.mark.timeout(120)
def test_ranks_with_different_models_are_told_which_layer_differs() -> None:
    r0, r1 = run_distributed(mismatch_worker, 2, timeout=100)
    assert r0[:2] == r1[:2]
    assert r0[0].startswith("the ranks were given layer lists of different length: 3 on rank 0 but 4 on rank 1")
    assert r0[1].startswith("the ranks were given different models: layer 1 is Linear(weight (4, 4), bias (4,)) on "
                            "rank 0 but Linear(weight (5, 4), bias (5,)) on rank 1")
    assert r1[2].startswith("LayerError: stage 1: layer 1 (Linear) cannot take its input (2, 6) float32: mat1 and "
                            "mat2 shapes cannot be multiplied"), r1[2]
    assert "(that input is the output of stage 0, whose last layer is layer 0)" in r1[2]
    assert r0[2].startswith("PeerFailed: error: rank 1 (position 1, replica 0, step 0) failed in F0: LayerError"), r0


# ------------------------------------------------------------------ NaN policy

def nan_worker(rank: int, world: int, policy: str) -> dict[str, Any]:
    from pipeengine.engine import NonFiniteError, PipelineEngine
    from pipeengine.topology import Topology
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                            topology=Topology(2, 1), microbatches=3, on_nonfinite=policy, grad_clip=1.0)
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)) for _ in range(3)] for _ in range(3)]
    batches[1][2][0][0, 0] = float("nan")   # step 1, microbatch 2: a NaN in the input
    snapshots, out = [], []
    for step in range(3):
        snapshots.append([p.detach().clone() for p in engine.parameters])
        try:
            res = engine.train_batch(iter(batches[step]))
            out.append((res.skipped, res.nonfinite, math.isfinite(res.loss)))
        except NonFiniteError as exc:
            out.append(str(exc))
            break
    snapshots.append([p.detach().clone() for p in engine.parameters])
    state = [len(s) for s in engine.optimizer.state.values()]
    same = [all(torch.equal(a, b) for a, b in zip(snapshots[i], snapshots[i + 1])) for i in range(len(snapshots) - 1)]
    return {"out": out, "unchanged": same, "skipped": engine.skipped_steps, "state": state,
            "steps": [int(s["step"]) for s in engine.optimizer.state.values()]}


@pytest.mark.timeout(120)
def test_nan_in_one_microbatch_is_skipped_or_stops_naming_the_stage() -> None:
    skip = run_distributed(nan_worker, 2, "skip", timeout=100)
    for r in skip:
        assert r["out"] == [(False, False, True), (True, True, False), (False, False, True)], r
        assert r["unchanged"] == [False, True, False]   # step 1 left every parameter bitwise unchanged
        assert r["skipped"] == 1 and r["steps"] == [2] * len(r["steps"])   # AdamW stepped twice, not three times
    stop = run_distributed(nan_worker, 2, "stop", timeout=100)
    for r in stop:
        assert r["out"][0] == (False, False, True) and len(r["out"]) == 2
        assert r["out"][1].startswith("step 1: loss nan, gradient norm nan: the first non-finite forward output came "
                                      "from stage 0 (layers 0..1, rank 0)"), r["out"][1]
        assert r["unchanged"] == [False, True]
    assert stop[0]["out"] == stop[1]["out"]   # the same decision and words on every rank


# ------------------------------------------------------------------ real processes: failure, hang, launcher

def _spawn(world: int, scenario: str, **env: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return [subprocess.Popen([sys.executable, "-m", "tests.fault_worker", str(r), str(world), str(port), scenario],
                             cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def _wait_for_step(proc: subprocess.Popen[str], step: int, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(f"step {step}"):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"rank exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError(f"no step {step} within {limit} s")


@pytest.mark.timeout(150)
def test_exception_in_stage_1_ends_every_rank_within_10_s_without_torchrun() -> None:
    procs = _spawn(3, "raise")
    try:
        _wait_for_step(procs[0], 1)
        t0 = time.monotonic()
        for r in (0, 2):   # rank 1 raised and stays alive; its peers must not wait for it
            procs[r].wait(timeout=30)
        elapsed = time.monotonic() - t0
        errs = {r: procs[r].communicate(timeout=10)[1] for r in (0, 2)}
    finally:
        for p in procs:
            p.kill()
    assert [procs[r].returncode for r in (0, 2)] == [3, 3], errs
    assert elapsed < 10, elapsed
    # rank 0 shows rank 1's failure, once, with its traceback
    assert errs[0].count("error: rank 1 (position 1, replica 0, step 2) failed in F0: RuntimeError: injected "
                         "failure in Boom.forward\nTraceback (most recent call last):") == 1, errs[0]


@pytest.mark.timeout(150)
def test_stopped_rank_is_named_as_the_culprit() -> None:
    procs = _spawn(2, "stop", PE_TIMEOUT="4")
    try:
        _wait_for_step(procs[1], 2)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        procs[0].wait(timeout=60)
        elapsed = time.monotonic() - t0
        err = procs[0].communicate(timeout=10)[1]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3, err
    assert elapsed < 15, elapsed
    assert "pipeengine: wait-for report (a wait exceeded 4 s; 1 of 2 ranks answered)" in err, err
    assert f"rank 1 (pid {procs[1].pid} on {socket.gethostname()}): said nothing: stopped, dead or stuck outside " \
           "the engine" in err
    assert "likely culprit: rank 1 (said nothing)" in err
    assert err.count("pipeengine: wait-for report") == 2   # printed once, and carried by rank 0's exception


def _pipe_sh(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOG_RANK="0")
    return subprocess.Popen(["bash", str(ROOT / "launch" / "pipe.sh"), "2", "cpus", "--model", "mlp", "--steps",
                             "100000", "--log-interval", "1", "--log-dir", str(tmp_path), "--run-name", "run", *flags],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_rank_saves_and_writes_the_summary(tmp_path: Path) -> None:
    proc = _pipe_sh(tmp_path, "--save-on-exit", "--save-dir", str(tmp_path / "ck"))
    try:
        _wait_for_step_line(proc, "step 3/")
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        _kill_group(proc)
    assert proc.returncode == 130, err[-3000:]
    assert elapsed < 15, elapsed
    assert "SIGINT: every rank stopped after step" in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    done = summary["steps_done"]
    assert summary["status"] == f"stopped by SIGINT after step {done}" and len(summary["losses"]) == done
    assert os.path.isdir(tmp_path / "ck" / f"step-{done:08d}"), os.listdir(tmp_path / "ck")


@pytest.mark.timeout(150)
def test_launcher_killed_with_sigkill_leaves_no_worker(tmp_path: Path) -> None:
    proc = _pipe_sh(tmp_path)
    workers: list[int] = []
    try:
        _wait_for_step_line(proc, "step 2/")
        torchrun = _workers_parent(proc.pid)
        workers = _workers(proc.pid)
        assert len(workers) == 2 and len(torchrun) == 1, (workers, torchrun)
        os.kill(torchrun[0], signal.SIGKILL)
        t0 = time.monotonic()
        while any(_alive(w) for w in workers) and time.monotonic() - t0 < 20:
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
    finally:
        survivors = [w for w in workers if _alive(w)]
        for w in survivors:
            os.kill(w, signal.SIGKILL)
        _kill_group(proc)
    assert not survivors and elapsed < 10, elapsed


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
