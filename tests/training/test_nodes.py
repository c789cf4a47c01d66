"""Two nodes on one machine: two ``launch/pipe.sh`` launchers meeting at torchrun's c10d rendezvous (node 0 hosts it).

A worker killed on the second node restarts the whole group on both nodes (``--max-restarts``), which resumes
from the newest checkpoint and ends with the uninterrupted run's loss; with ``NNODES=1:2`` the second node's
processes killed at once (a node gone for good) leave the first node to continue alone, re-planned for 2
processes from the newest checkpoint, with the losses of a run resumed at that size from the same checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from pipeengine.training.cli import parse_args
from pipeengine.training.trainer import run
from tests.harness import ROOT, WorldPool, free_port
from tests.training.test_checkpoint import _worker_pid

FLAGS = ["--model", "mlp", "--log-interval", "1", "--eval-interval", "0", "--timeline-interval", "0",
         "--partition", "uniform", "--keep", "0", "--pp", "2"]


def _two_nodes(tmp: Path, nnodes: str, steps: int, when: str,
               kill: Callable[[subprocess.Popen[str]], None]) -> tuple[list[str], list[int], float,
                                                                       list[tuple[float, int]]]:
    """Start node 0 and node 1 (2 processes each); when node 0 prints ``when``, ``kill(node 1's launcher)``. Returns
    both outputs, their exit codes, the kill's time and node 0's progress lines as (time, step)."""
    port = free_port()
    flags = [*FLAGS, "--steps", str(steps), "--save-interval", "4", "--max-restarts", "1",
             "--save-dir", str(tmp / "ck"), "--log-dir", str(tmp), "--run-name", "run"]
    procs: list[subprocess.Popen[str]] = []
    outs: list[list[str]] = [[], []]
    for node in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(ROOT), LOG_RANK="0", NNODES=nnodes, NODE_RANK=str(node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="60", RDZV_ID=f"test-{port}")
        procs.append(subprocess.Popen(["bash", str(ROOT / "launch" / "pipe.sh"), "2", "cpus", *flags], cwd=tmp,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    killed = [0.0]
    steps: list[tuple[float, int]] = []

    def read(node: int) -> None:
        assert procs[node].stdout is not None
        for line in procs[node].stdout:
            outs[node].append(line)
            if node == 0 and not killed[0] and when in line:
                kill(procs[1])
                killed[0] = time.monotonic()
            found = re.search(r"step (\d+)/", line) if node == 0 else None
            if found:   # (stdout and stderr reach us through separate pipes: only their own order holds)
                steps.append((time.monotonic(), int(found[1])))

    readers = [threading.Thread(target=read, args=(n,)) for n in (0, 1)]
    for t in readers:
        t.start()
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for t in readers:
            t.join(timeout=10)
    return ["".join(o) for o in outs], codes, killed[0], steps


def _the_node_dies(launcher: subprocess.Popen[str]) -> None:
    """Every process of the launcher's node at once, with SIGKILL (launcher, torchrun, workers): a node gone."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    node, grew = {launcher.pid}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in node} - node
        node |= more
        grew = bool(more)
    for pid in node:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    return run(parse_args(flags))


def _summary(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "run" / "summary.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_a_worker_killed_on_the_second_node_restarts_the_group_on_both(tmp_path: Path, world4: WorldPool) -> None:
    straight = world4.run(_train, [*FLAGS, "--steps", "40", "--log-dir", str(tmp_path), "--run-name", "straight"],
                          timeout=200)[0]
    outs, codes, killed, _ = _two_nodes(tmp_path, "2", 40, "step-00000008",
                                        lambda launcher: os.kill(_worker_pid(launcher.pid, "LOCAL_RANK=1"),
                                                                 signal.SIGKILL))
    assert killed and codes == [0, 0], (codes, outs[0][-3000:], outs[1][-3000:])
    assert "restart 1: resuming from " in outs[0], outs[0][-3000:]
    summary = _summary(tmp_path)
    assert summary["steps_done"] == 40 and summary["final_loss"] == straight["final_loss"], summary["final_loss"]


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_the_second_node_gone_for_good_leaves_the_first_to_continue_at_world_2(
        tmp_path: Path, world2: WorldPool) -> None:
    outs, codes, killed, steps = _two_nodes(tmp_path, "1:2", 60, "step-00000008", _the_node_dies)
    assert killed and codes[0] == 0, (codes, outs[0][-3000:])
    found = re.search(r"restart 1: resuming from (\S+step-(\d+))", outs[0])
    assert found, outs[0][-3000:]
    resumed = int(found[2])
    first = max(t for t, n in steps if n == resumed + 1)   # the restarted group's (the first may have run it too)
    done = max(n for t, n in steps if t < first)   # by the group that lost the node
    print(f"shrink: {first - killed:.1f} s from the kill to the first step at world 2; steps done {done}, "
          f"resumed at {resumed}: {done - resumed} lost")
    assert done - resumed <= 4   # at most the save interval
    summary = _summary(tmp_path)
    change = summary["world_change"]
    assert (change["from"], change["to"], change["pp"], change["dp"]) == (4, 2, 2, 1), change
    assert summary["first_step"] == resumed and change["microbatches"] == 8   # the same global batch
    assert "world      4 -> 2 processes at step" in outs[0]
    # a run resumed at world 2 from the same checkpoint computes the same losses
    ref = world2.run(_train, [*FLAGS, "--steps", "60", "--resume", found[1], "--log-dir", str(tmp_path),
                              "--run-name", "ref"], timeout=200)[0]
    assert ref["losses"] == summary["losses"], (ref["losses"][:3], summary["losses"][:3])
