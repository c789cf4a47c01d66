"""Never hang silently, never lie: failures reach every rank, hangs are explained, the NaN policy holds."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine.runtime.faults import adaptive_timeout
from pipeengine.runtime.hangs import wait_for_report
from tests.harness import ROOT, WorldPool, free_port, run_distributed


def test_a_cuda_wait_leaves_the_host_free() -> None:
    """No GPU here: the CUDA branches are checked on fakes. A CUDA wait is ``work.wait()`` without a
    timeout (which would make it a host busy-wait that aborts the communicator); NCCL's watchdog
    enforces the group's timeout."""
    from pipeengine.runtime.faults import Watch

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


def test_adaptive_timeout() -> None:
    assert adaptive_timeout([]) == 600
    assert adaptive_timeout([0.1, 0.2, 0.3]) == 60
    assert adaptive_timeout([5.0, 4.0, 6.0]) == 100


def mismatch_worker(rank: int, world: int) -> list[str]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.faults import watch
    watch().kill_after = 60   # let the blocked rank raise when rank 1's process ends (not end itself)
    out = []
    for layers in ([nn.Linear(4, 4) for _ in range(3 + rank)],                        # another depth
                   [nn.Linear(4, 4), nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 4)]):  # other shapes
        try:
            PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
            out.append("built")
        except ValueError as exc:
            out.append(str(exc))
    # the same model, another schedule or partition on one rank: named before any rank profiles or builds
    for kw in ({"schedule": "gpipe" if rank else "1f1b"}, {"partition": "uniform" if rank else "profile"}):
        try:
            PipelineEngine([nn.Linear(4, 4) for _ in range(4)], nn.functional.mse_loss,
                           lambda ps: torch.optim.SGD(ps, lr=0.1), sample=(torch.randn(2, 4), torch.randn(2, 4)),
                           **kw)
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_with_different_models_are_told_which_layer_differs() -> None:
    r0, r1 = run_distributed(mismatch_worker, 2, timeout=100)
    assert r0[:2] == r1[:2]
    assert r0[0].startswith("the ranks were given layer lists of different length: 3 on rank 0 but 4 on rank 1")
    assert r0[1].startswith("the ranks were given different models: layer 1 is Linear(weight (4, 4), bias (4,)) on "
                            "rank 0 but Linear(weight (5, 4), bias (5,)) on rank 1")
    assert r0[2:4] == r1[2:4] == [
        "the ranks were given different schedule: '1f1b' on rank 0 but 'gpipe' on rank 1; every rank must be "
        "started with the same settings",
        "the ranks were given different partition: 'profile' on rank 0 but 'uniform' on rank 1; every rank must be "
        "started with the same settings"]
    assert r1[4].startswith("LayerError: stage 1: layer 1 (Linear) cannot take its input (2, 6) float32: mat1 and "
                            "mat2 shapes cannot be multiplied"), r1[4]
    assert "(that input is the output of stage 0, whose last layer is layer 0)" in r1[4]
    assert r0[4].startswith("PeerFailed: error: rank 1 (position 1, replica 0, step 0) failed in F0: LayerError"), r0


def nan_worker(rank: int, world: int, policy: str, zero: bool = False, only: int | None = None) -> dict[str, Any]:
    from pipeengine.runtime.engine import NonFiniteError, PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                            topology=Topology(2, world // 2), microbatches=3, on_nonfinite=policy, grad_clip=1.0,
                            shard_optimizer=zero)
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)) for _ in range(3)] for _ in range(3)]
    if only is None or engine.replica == only:   # (``only``: in that replica's data alone)
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
def test_nan_in_one_microbatch_is_skipped_or_stops_naming_the_stage(world2: WorldPool) -> None:
    skip = world2.run(nan_worker, "skip", timeout=100)
    for r in skip:
        assert r["out"] == [(False, False, True), (True, True, False), (False, False, True)], r
        assert r["unchanged"] == [False, True, False]   # step 1 left every parameter bitwise unchanged
        assert r["skipped"] == 1 and r["steps"] == [2] * len(r["steps"])   # AdamW stepped twice, not three times
    stop = world2.run(nan_worker, "stop", timeout=100)
    for r in stop:
        assert r["out"][0] == (False, False, True) and len(r["out"]) == 2
        assert r["out"][1].startswith("step 1: loss nan, gradient norm nan: the first non-finite forward output came "
                                      "from stage 0 of replica 0 (layers 0..1, rank 0)"), r["out"][1]
        assert r["unchanged"] == [False, True]
    assert stop[0]["out"] == stop[1]["out"]   # the same decision and words on every rank


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if Poison.on else grad


class Poison(nn.Module):
    """Identity whose backward passes NaN on while ``Poison.on`` (the worker's step 1, its replay too)."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PoisonGrad.apply(x)


def backward_nan_worker(rank: int, world: int) -> dict[str, Any]:
    from pipeengine.runtime.engine import NonFiniteError, PipelineEngine
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
              nn.Sequential(Poison(), nn.Linear(6, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh())]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), microbatches=3,
                            partition=[0, 2, 4])
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)) for _ in range(3)] for _ in range(2)]
    engine.train_batch(iter(batches[0]))
    summed = [[len(x) for x in st.sums] for st in engine.stages]   # a finite step sums nothing it passes on
    before = [p.detach().clone() for p in engine.parameters]
    Poison.on = True
    try:
        engine.train_batch(iter(batches[1]))
        said = "no error"
    except NonFiniteError as exc:
        said = str(exc)
    finally:
        Poison.on = False
    return {"said": said, "summed": summed, "data": engine.step_data,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, engine.parameters))}


@pytest.mark.timeout(120)
def test_a_nan_made_by_a_backward_is_named_by_the_steps_replay(world2: WorldPool) -> None:
    """Steps run without a sum per tensor passed on; the one that stops runs again with them and names the stage
    whose backward made the NaN (its forward and loss finite), on every rank, the parameters unchanged."""
    for r in world2.run(backward_nan_worker, timeout=100):
        assert r["said"].startswith("step 1: loss ") and "gradient norm nan: the forward was finite" in r["said"], r
        assert ("the backward went non-finite first in stage 1 of replica 0 (layers 2..3, rank 1)") in r["said"], r
        assert r["summed"] == [[0, 0]], r["summed"]
        assert r["unchanged"] and r["data"] is None   # (the step's data is let go once the replay is done)


@pytest.mark.timeout(120)
def test_a_nan_in_one_replica_is_named_there_on_every_rank(world4: WorldPool) -> None:
    """Replica 1's data alone holds the NaN: every rank (rank 0's message is the one on screen) names replica 1's
    stage 0, not a stage of its own whose weight gradients the all-reduce made non-finite."""
    said = {r["out"][1] for r in world4.run(nan_worker, "stop", False, 1, timeout=100)}
    assert len(said) == 1 and said.pop().startswith(
        "step 1: loss nan, gradient norm nan: the first non-finite forward output came from stage 0 of replica 1 "
        "(layers 0..1, rank 1)")


@pytest.mark.timeout(120)
def test_a_skipped_step_leaves_zero_1_shards_and_parameters_unchanged(world4: WorldPool) -> None:
    for r in world4.run(nan_worker, "skip", True, timeout=100):   # pp 2 x dp 2, optimizer state sharded
        assert r["out"] == [(False, False, True), (True, True, False), (False, False, True)], r
        assert r["unchanged"] == [False, True, False] and r["skipped"] == 1
        assert r["steps"] == [2] * len(r["steps"]) and r["steps"], r   # every shard stepped twice


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


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_exception_in_stage_1_ends_every_rank_without_torchrun() -> None:
    procs = _spawn(3, "raise")
    try:
        _wait_for_step(procs[0], 1)
        for r in (0, 2):   # rank 1 raised and stays alive; its peers must not wait for it (nor for the group's
            procs[r].wait(timeout=30)   # 60 s timeout: how soon they end is benchmarks/faults.py's figure)
        errs = {r: procs[r].communicate(timeout=10)[1] for r in (0, 2)}
    finally:
        for p in procs:
            p.kill()
    assert [procs[r].returncode for r in (0, 2)] == [3, 3], errs
    # rank 0 shows rank 1's failure, once, with its traceback
    assert errs[0].count("error: rank 1 (position 1, replica 0, step 2) failed in F0: RuntimeError: injected "
                         "failure in Boom.forward\nTraceback (most recent call last):") == 1, errs[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stopped_rank_is_named_as_the_culprit() -> None:
    procs = _spawn(2, "stop", PE_TIMEOUT="4")
    try:
        _wait_for_step(procs[1], 2)
        procs[1].send_signal(signal.SIGSTOP)
        procs[0].wait(timeout=60)   # ended by the report after --timeout 4 s, not by the group's own timeout
        err = procs[0].communicate(timeout=10)[1]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3, err
    assert "pipeengine: wait-for report (a wait exceeded 4 s; 1 of 2 ranks answered)" in err, err
    assert f"rank 1 (pid {procs[1].pid} on {socket.gethostname()}): said nothing: stopped, dead or stuck outside " \
           "the engine" in err
    assert "likely culprit: rank 1 (said nothing)" in err
    assert err.count("pipeengine: wait-for report") == 2   # printed once, and carried by rank 0's exception


# ------------------------------------------------------------------ NCCL: the host polls, the watch decides

class NeverDone:
    """A CUDA event (or NCCL work) whose device never gets there: a peer that hangs."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        threading.Event().wait()   # blocks for good, as cudaEventSynchronize on a device that never gets there


class DeviceTensor:
    """What the host would read from a CUDA tensor (only its device matters before the poll)."""

    device = torch.device("cuda")

    def tolist(self) -> list[int]:
        raise AssertionError("read before the device got there: the host would block here for good")


def _watch(timeout: float) -> Any:
    import torch.distributed as dist

    from pipeengine.runtime.faults import Watch
    w = Watch(dist.HashStore(), 0, 2)   # rank 0 of two; rank 1 says nothing
    w.timeout = timeout
    w.event_factory = NeverDone
    return w


@pytest.mark.slow   # waits out a timeout: seconds
def test_a_device_read_that_never_completes_is_reported_like_a_gloo_wait() -> None:
    """On NCCL the host blocks only where it reads device values (a header, the step's signals, timings);
    each read polls under the watch's deadline, so --timeout and the wait-for report work there too."""
    from pipeengine.runtime.faults import WaitTimeout
    from pipeengine.runtime.transfer import P2PTimeout
    from pipeengine.schedule import Action
    w = _watch(0.5)
    t0 = time.monotonic()
    with pytest.raises(P2PTimeout) as exc:
        w.host_values(DeviceTensor(), (Action.parse("recvH0<1"),), [1], error=P2PTimeout)
    assert time.monotonic() - t0 < 5
    text = str(exc.value)
    assert text.startswith("rank 0: waits 0.5 s in recvH0<1 for rank(s) 1: no completion after 0.5 s"), text
    assert "rank 1: said nothing: stopped, dead or stuck outside the engine" in text
    with pytest.raises(WaitTimeout, match="waits .* s in the end-of-step all-reduce"):
        _watch(0.3).poll(NeverDone(), "the end-of-step all-reduce", [1])


def test_a_peer_failure_ends_a_device_wait_at_once() -> None:
    from pipeengine.runtime.faults import PeerFailed
    w = _watch(60)
    threading.Timer(0.2, lambda: setattr(w, "peer_failure", "error: rank 1 failed in F3: boom")).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailed, match="rank 1 failed in F3"):
        w.poll(NeverDone(), "the loss all-reduce", [1])
    assert time.monotonic() - t0 < 2


def test_the_nccl_flight_recorder_is_on_and_named_in_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeengine.runtime.hangs import enable_flight_recorder
    monkeypatch.setattr(os, "environ", dict(os.environ))   # what the recorder sets must not reach later tests
    for key in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.pop(key, None)
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "500"   # a user's own setting wins
    prefix = enable_flight_recorder()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    report = wait_for_report({}, 2, 5, recorder=prefix + "0")
    assert f"NCCL flight recorder: every rank's last collectives and p2p ops in {prefix}<rank>" in report


def test_the_flight_recorder_dumps_into_the_run_folder_unless_the_user_chose(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pipeengine.runtime.hangs import enable_flight_recorder, flight_recorder_into
    monkeypatch.setattr(os, "environ", dict(os.environ))   # what the recorder sets must not reach later tests
    for key in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                "TORCH_FR_DUMP_TEMP_FILE"):
        os.environ.pop(key, None)
    enable_flight_recorder()
    assert flight_recorder_into(str(tmp_path)) == str(tmp_path / "nccl_trace_rank_")
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = "/mine/trace_"   # the user's place is kept
    assert flight_recorder_into(str(tmp_path)) == "/mine/trace_"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = "/newer/fr_"             # torch's newer name, read first
    assert enable_flight_recorder() == "/newer/fr_" and flight_recorder_into(str(tmp_path)) == "/newer/fr_"


# ------------------------------------------------------------------ the store is not on the step's path

class CountingStore:
    """The process group's store, counting what is asked of it."""

    def __init__(self, store: Any) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return method(*args, **kwargs)
        return counted


def store_traffic(rank: int, world: int, steps: int) -> tuple[int, float]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.faults import watch
    from pipeengine.runtime.topology import Topology
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                            topology=Topology(4, 2), microbatches=4)
    w = watch()
    counting = CountingStore(w.store)
    w.store = counting
    try:
        data = [(torch.randn(2, 8), torch.randn(2, 8))] * 4
        t0 = time.monotonic()
        for _ in range(steps):
            engine.train_batch(iter(data))
        return counting.ops, time.monotonic() - t0
    finally:
        w.store = counting.store


@pytest.mark.slow
def test_store_traffic_per_rank_is_a_rate_not_a_per_step_cost(world8: WorldPool) -> None:
    """What each rank asks the store (the watcher's poll, twice a second) does not grow with steps (a stop
    request rides on the step's all-reduce) nor with the world size."""
    few, many = world8.run(store_traffic, 5, timeout=120), world8.run(store_traffic, 60, timeout=120)
    for (ops_few, secs_few), (ops_many, secs_many) in zip(few, many):
        assert ops_many <= 2 / 0.5 * secs_many + 2, (ops_many, secs_many)       # POLL = 0.5 s
        assert ops_many < 60 / 4, (ops_many, "ops for 60 steps")
    print("store ops per rank:", [f"{ops / steps:.2f}/step, {ops / secs:.1f}/s" for (ops, secs), steps in
                                  zip(many, [60] * 8)])


def test_a_rank_stopping_over_a_failure_waits_until_rank_0_printed_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher stops every rank once one exits: a rank ending over a published failure first waits (boundedly)
    for it to be printed; a report printed by a rank other than 0 is also left where launch/pipe.sh shows it."""
    import json
    import threading

    import torch.distributed as dist

    from pipeengine.runtime.faults import PREFIX, Watch
    store = dist.HashStore()
    rank0, rank1 = Watch(store, 0, 2), Watch(store, 1, 2)
    assert not rank1.wait_shown(5.0)                    # nothing published: no wait at all
    store.set(PREFIX + "failed", json.dumps({"rank": 1}))
    t0 = time.monotonic()
    assert not rank1.wait_shown(0.3) and time.monotonic() - t0 < 2   # rank 0 never printed: bounded
    threading.Timer(0.3, rank0.mark_shown).start()
    assert rank1.wait_shown(5.0)
    monkeypatch.setenv("PIPEENGINE_RANK_LOGS", str(tmp_path))
    rank1.print_once("report\nlikely culprit: rank 0")  # printed already (by rank 0): not again
    assert not list(tmp_path.iterdir())
    Watch(dist.HashStore(), 1, 2).print_once("report\nlikely culprit: rank 0")
    assert (tmp_path / "shown-by-rank1.txt").read_text() == "report\nlikely culprit: rank 0\n"


def test_a_broken_connection_names_the_rank_whose_process_ended(tmp_path: Path) -> None:
    """A worker killed with SIGKILL says nothing: the first rank whose connection to it breaks finds the rank whose
    process is gone (same host) and publishes that, so every rank names it, not the healthy peer it waited on."""
    import json

    import torch.distributed as dist

    from pipeengine.runtime.faults import PREFIX, Watch
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()   # a pid that has ended
    store = dist.HashStore()
    Watch(store, 0, 3)
    store.set(f"{PREFIX}where/1", f"pid {os.getpid()} on {socket.gethostname()}")   # alive
    store.set(f"{PREFIX}where/2", f"pid {dead.pid} on {socket.gethostname()}")
    w = Watch(store, 1, 3)
    w.context = "position 1, replica 0, step 7"
    text = w._gone("the data-parallel gradient all-reduce", "Connection reset by peer. This is typically ...")
    assert text == (f"error: rank 2 (pid {dead.pid} on {socket.gethostname()}) ended without a word (killed: "
                    f"SIGKILL, out of memory?); rank 1 (position 1, replica 0, step 7) lost its connection in the "
                    f"data-parallel gradient all-reduce: Connection reset by peer")
    assert json.loads(store.get(PREFIX + "failed"))["summary"] == text   # what every other rank will show
    assert Watch(store, 0, 3)._failure_text() == text


def _internal_failure(rank: int, world: int) -> str:
    import functools
    import json

    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.faults import PREFIX, watch
    from pipeengine.runtime.topology import Topology
    engine = PipelineEngine([nn.Linear(4, 4), nn.Linear(4, 4)], nn.functional.mse_loss,
                            lambda ps: torch.optim.SGD(ps, lr=0.1), topology=Topology(2, 1), microbatches=2)
    # torch raising under the engine's own call (as ZeRO-1's float index did), on both ranks: no rank blocks
    engine.grad_sync.finish = functools.partial(torch.empty(2).__getitem__, torch.tensor([0.5]))
    try:
        engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))] * 2))
    except IndexError:
        pass
    return str(json.loads(watch().store.get(PREFIX + "failed"))["summary"])   # what every rank is told


@pytest.mark.timeout(120)
def test_an_internal_error_names_where_in_the_engine_it_happened() -> None:
    said = run_distributed(_internal_failure, 2)   # fresh ranks: the failure stays in their fault channel
    assert said[0] == said[1] and re.fullmatch(
        r"error: rank [01] \(position [01], replica 0, step 0\) failed in the end-of-step gradient sync \(in "
        r"runtime/update\.py:\d+, finish\): IndexError: tensors used as indices must be long, int, byte or bool "
        r"tensors", said[0]), said[0]


@pytest.mark.slow   # waits out a timeout: seconds
def test_a_rank_silent_in_start_up_is_reported_and_a_slow_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the process group exists and through set-up, a peer that stopped counting alive (SIGSTOP, dead) is
    reported after ``timeout`` by the rank that looks at it, from the watcher thread (the main thread may be blocked
    in the group's creation for --collective-timeout); a peer that is merely slow keeps counting and is not."""
    import threading

    import torch.distributed as dist

    from pipeengine.runtime.faults import Watch
    stops: list[tuple[int, str]] = []
    stopped = threading.Event()
    monkeypatch.setattr(Watch, "_stop_process", lambda self, text: (stops.append((self.rank, text)), stopped.set()))
    alone = Watch(dist.HashStore(), 0, 2, starting="start-up: creating the process group")   # rank 1 never came
    alone.timeout = 0.5
    try:
        assert stopped.wait(15)
    finally:
        alone.started()
    rank, text = stops[0]
    assert rank == 0 and text.splitlines() == [
        "pipeengine: wait-for report (a wait exceeded 0.5 s; 1 of 2 ranks answered)",
        text.splitlines()[1], "  rank 1: said nothing: stopped, dead or stuck outside the engine",
        "  likely culprit: rank 1 (said nothing)"], text
    assert text.splitlines()[1].startswith("  rank 0: waits ") and \
        text.splitlines()[1].endswith(" s in start-up: creating the process group for rank(s) 1"), text
    stops.clear()
    store = dist.HashStore()
    pair = [Watch(store, r, 2, starting="set-up: loading the model") for r in (0, 1)]
    for w in pair:
        w.timeout = 1.0
    try:
        time.sleep(2.5)                         # both count alive: neither is reported, however long set-up takes
        pair[1].started()                       # rank 1 done with set-up (its count stops): no longer looked at
        time.sleep(2.0)
        assert stops == []
    finally:
        for w in pair:
            w.started()


_EXIT_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn
import pipeengine

cores = sorted(os.sched_getaffinity(0))
# one core and no forced GIL hand-off at the end: a Gloo thread alive at exit shows
os.sched_setaffinity(0, {cores[int(sys.argv[3]) % len(cores)]})
dist.init_process_group("gloo")
layers = [lambda: nn.Linear(8, 16), lambda: nn.Linear(16, 16), lambda: nn.Linear(16, 2)]
engine = pipeengine.PipelineEngine(layers, nn.functional.cross_entropy, lambda ps: torch.optim.AdamW(ps),
                                   topology=pipeengine.Topology(pp=2), microbatches=2)
data = [(torch.randn(4, 8), torch.randint(0, 2, (4,)))] * 2
engine.train_batch(iter(data) if engine.needs_data else None)
if sys.argv[1] == "with":
    with engine:
        engine.train_batch(iter(data) if engine.needs_data else None)
    try:
        engine.train_batch(iter(data))
    except RuntimeError as exc:
        print("after close:", exc, flush=True)
sys.setswitchinterval(5.0)
pipeengine.save_checkpoint(engine, sys.argv[2], step=1)   # its last collective's tensors die in a Gloo thread
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_script_ending_with_destroy_process_group_exits_0(tmp_path: Path) -> None:
    """The usual end of a torchrun script, with or without close() (``with engine:``), exits 0: no process group
    outlives destroy_process_group() (release.py, [Note: a clean exit]). Made likely to abort if one did: both ranks
    of a job on one core, no GIL hand-off at the end (it aborted in 7 of 8 runs before). The two jobs run at once,
    each on a core of its own."""
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    jobs = {how: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", str(script), how, str(tmp_path / how), str(core)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
            for core, how in enumerate(("destroy-only", "with"))}
    done: dict[str, tuple[int | None, str, str]] = {}
    deadline = time.monotonic() + 150
    try:
        for how, job in jobs.items():   # (each job's output is small: its pipes do not fill while the other runs)
            out, err = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done[how] = (job.returncode, out, err)
    finally:
        for job in jobs.values():   # torchrun and its ranks (a rank hung at exit would outlive its launcher)
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    failed = {how: (code, out[-2000:], err[-3000:]) for how, (code, out, err) in done.items()
              if code != 0 or "terminate called" in err}
    assert not failed, failed
    assert "after close: this PipelineEngine was closed" in done["with"][1], done["with"][1]


def _engines_one_after_another(rank: int, world: int) -> list[int]:
    """This process's thread count after each of five engines (pp 2, one with a tied pair: dp, pp and tie
    groups), each trained one step and closed, one of them by its ``with`` block."""
    from pipeengine import PipelineEngine, Topology

    def one(tied: bool) -> PipelineEngine:
        layers = [lambda: nn.Linear(4, 4) for _ in range(4)]
        engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                topology=Topology(pp=2), microbatches=2,
                                tied=[[(0, "weight"), (3, "weight")]] if tied else ())
        data = [(torch.randn(2, 4), torch.randn(2, 4))] * 2
        engine.train_batch(iter(data) if engine.needs_data else None)
        return engine

    counts = []
    for i in range(5):
        if i == 2:
            with one(tied=True):
                pass
        else:
            one(tied=i % 2 == 1).close()
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


@pytest.mark.timeout(120)
def test_closing_an_engine_frees_its_groups_threads(world2: WorldPool) -> None:
    """A process that builds engine after engine (a notebook, a sweep) does not pile up process groups: close()
    destroys the groups the engine made, and their Gloo threads end (two per group and peer; before, each engine
    left its groups registered in torch for good)."""
    for counts in world2.run(_engines_one_after_another):
        assert max(counts) <= counts[0], counts   # was 11, 20, 29, 38, 44


@pytest.mark.parametrize("world", [pytest.param(64, marks=pytest.mark.slow), 512])
def test_a_hang_report_costs_o_world_store_requests(world: int) -> None:
    """Every rank but one published its line (one is silent); the first rank to time out assembles the report from
    the count and one multi_get, the next rank takes its report: a few requests per rank, whatever the world."""
    from pipeengine.runtime.channel import FaultChannel
    import torch.distributed as dist
    store = CountingStore(dist.HashStore())
    for r in range(2, world):   # ranks 2.. saw the hang and published what they wait on
        FaultChannel(store, r, world)._publish({"rank": r, "context": "step 3", "state": "waits", "what": "F3",
                                                "peers": [(r + 1) % world], "secs": 1.0})
    store.ops = 0
    first, second = FaultChannel(store, 0, world), FaultChannel(store, 1, world)
    first.timeout = second.timeout = 2.0
    report = first._hang(first._line("waits", "the end-of-step all-reduce", [1], 2.0))
    assert f"rank {world - 1}" in report and "rank 1: said nothing" not in report.splitlines()[0]
    made = store.ops
    assert made <= 3 * world + 60, made        # checks, one multi_get per kind, the count polled for the grace
    store.ops = 0
    assert second._hang(second._line("waits", "F3", [0], 2.0)) == report
    assert store.ops <= 10, store.ops
