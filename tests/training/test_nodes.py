"""Two nodes on one machine: two ``launch/pipe.sh`` launchers meeting at torchrun's c10d rendezvous (node 0 hosts it).

One elastic job (``NNODES=1:2``, 2 processes per node, pp 2 x dp 2), two failures:

1. a worker killed on the second node: torchrun restarts the whole group on both nodes (``--max-restarts``;
   the first node's own workers were fine), which resumes from the newest checkpoint; its next checkpoint is
   bitwise the uninterrupted run's;
2. later the second node gone for good (every process of it SIGKILLed at once): the first node continues
   alone, re-planned for 2 processes (pp 2 x dp 1, twice the microbatches) from the newest checkpoint, with
   the losses of a run resumed at that size from the same checkpoint.
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
import torch

from pipeengine.training.cli import parse_args
from pipeengine.training.export import export
from pipeengine.training.trainer import run
from tests.harness import ROOT, WorldPool, free_port, kill_tree
from tests.training.test_checkpoint import _worker_pid

FLAGS = ["--model", "mlp", "--log-interval", "1", "--eval-interval", "0", "--timeline-interval", "0",
         "--partition", "uniform", "--keep", "0", "--pp", "2", "--save-interval", "4"]
STEPS = 28   # kills after the checkpoints of steps 8 and 20 (saved every 4), then 8 steps at world 2
Kill = tuple[str, Callable[[subprocess.Popen[str]], None]]   # (when node 0 prints this, do this to node 1)


def _two_nodes(tmp: Path, nnodes: str, steps: int,
               kills: list[Kill]) -> tuple[str, list[int], list[float], list[tuple[float, int]]]:
    """Start node 0 and node 1 (2 processes each) and do ``kills`` in order to node 1's launcher. Returns node 0's
    output, both exit codes, when each kill happened and node 0's progress lines as (time, step)."""
    port = free_port()
    flags = [*FLAGS, "--steps", str(steps), "--max-restarts", "2", "--save-dir", str(tmp / "ck"), "--log-dir",
             str(tmp), "--run-name", "run"]
    procs = []
    for node in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(ROOT), LOG_RANK="0", NNODES=nnodes, NODE_RANK=str(node),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="60", RDZV_ID=f"test-{port}",
                   LAST_CALL="1", RDZV_CONF="keep_alive_interval=1,heartbeat_timeout=3")   # a lost node, noticed fast
        procs.append(subprocess.Popen(["bash", str(ROOT / "launch" / "pipe.sh"), "2", "cpus", *flags], cwd=tmp,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    out: list[str] = []
    killed: list[float] = []
    steps: list[tuple[float, int]] = []

    def read() -> None:   # node 0's output (node 1's is drained, unread)
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            out.append(line)
            if len(killed) < len(kills) and kills[len(killed)][0] in line:
                kills[len(killed)][1](procs[1])
                killed.append(time.monotonic())
            found = re.search(r"step (\d+)/", line)
            if found:   # (stdout and stderr reach us through separate pipes: only their own order holds)
                steps.append((time.monotonic(), int(found[1])))

    readers = [threading.Thread(target=read), threading.Thread(target=procs[1].communicate)]
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
    return "".join(out), codes, killed, steps


def _kill_a_worker(launcher: subprocess.Popen[str]) -> None:
    os.kill(_worker_pid(launcher.pid, "LOCAL_RANK=1"), signal.SIGKILL)


def _the_node_dies(launcher: subprocess.Popen[str]) -> None:
    """Every process of the launcher's node at once, with SIGKILL (launcher, torchrun, workers): a node gone."""
    kill_tree(launcher.pid)


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    return run(parse_args(flags))


@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_a_worker_killed_restarts_both_nodes_and_a_node_gone_for_good_leaves_the_other_at_world_2(
        tmp_path: Path, world2: WorldPool, world4: WorldPool) -> None:
    straight = tmp_path / "straight"   # the uninterrupted run at world 4, its step-20 checkpoint
    world4.run(_train, [*FLAGS, "--steps", str(STEPS), "--save-dir", str(straight), "--log-dir", str(tmp_path),
                        "--run-name", "straight"], timeout=200)
    out, codes, killed, steps = _two_nodes(tmp_path, "1:2", STEPS, [("step-00000008", _kill_a_worker),
                                                                    ("step-00000020", _the_node_dies)])
    assert len(killed) == 2 and codes[0] == 0, (codes, killed, out[-3000:])
    # 1. both nodes restarted from step 8 (node 0's own workers were fine); step 20 as if nothing happened
    restarts = re.findall(r"restart \d+: resuming from (\S+step-(\d+))", out)   # (torchrun's counts are per node)
    assert len(restarts) == 2 and restarts[0][1] == "00000008", (restarts, out[-3000:])
    export(str(straight / "step-00000020"), str(tmp_path / "a.pt"))
    export(str(tmp_path / "ck" / "step-00000020"), str(tmp_path / "b.pt"))
    a, b = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # 2. node 1 gone: node 0 alone from the newest checkpoint, re-planned; the figures the note quotes
    path, resumed = restarts[1][0], int(restarts[1][1])
    first = max(t for t, n in steps if n == resumed + 1)   # the restarted group's (the last may have run it too)
    done = max(n for t, n in steps if t < first)            # by the group that lost the node
    print(f"shrink: {first - killed[1]:.1f} s from the kill to the first step at world 2; steps done {done}, "
          f"resumed at {resumed}: {done - resumed} lost")
    assert done - resumed <= 4   # at most the save interval
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    change = summary["world_change"]
    assert (change["from"], change["to"], change["pp"], change["dp"]) == (4, 2, 2, 1), change
    assert summary["first_step"] == resumed and change["microbatches"] == 8   # the same global batch
    assert "world      4 -> 2 processes at step" in out
    # a run resumed at world 2 from the same checkpoint computes the same losses
    ref = world2.run(_train, [*FLAGS, "--steps", str(STEPS), "--resume", path, "--log-dir", str(tmp_path),
                              "--run-name", "ref"], timeout=200)[0]
    assert ref["losses"] == summary["losses"], (ref["losses"][:3], summary["losses"][:3])
