"""Running code on N Gloo ranks for a test: fresh processes, or a pool of worlds kept for the session.

Both start each rank with ``torch.set_num_threads(1)`` on a free port, give every call a hard
deadline (a deadlock fails the test, it never hangs the suite) and return the ranks' results.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import free_port, kill_tree, process_tree
from pipeengine.runtime import release

__all__ = ["free_port", "kill_tree", "process_tree", "run_distributed", "WorldPool", "pipe_sh", "pipe_sh_job",
           "pipe_sh_command", "start_pipe_sh_job", "python_cli", "on_a_terminal", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent


def _context() -> Any:
    """Processes forked from a server that imported torch once (a spawned rank spends seconds importing it).

    The server only imports; it runs no torch op and starts no thread pool, so its forks are clean. It imports
    ``torch._dynamo`` too: a torch optimizer's first ``add_param_group`` imports it (about 0.8 s here), which every
    forked rank building an optimizer would otherwise pay again.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pipeengine.runtime.engine",
                                "tests.harness"])
    return ctx


def _init(rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))


def _call(rank: int, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    """Run one task; its result by value (torch's queue would share tensor storage through a file
    descriptor that dies with this process, racing the parent's read), or its traceback."""
    try:
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        return "ok", buf.getvalue()
    except BaseException as exc:
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        torch.set_default_dtype(torch.float32)


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           queue: Any, pg_timeout: float, everyone_done: Any) -> None:
    try:
        _init(rank, world_size, port, pg_timeout)
        queue.put((rank, *_call(rank, world_size, fn, args)))
    except BaseException as exc:  # report every failure to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if rank == 0:   # it hosts the store: a rank still assembling a wait-for report must find it there
        everyone_done.wait(timeout=60)
    os._exit(0)     # no teardown of the group: the peers are leaving too (a closed connection is how a
    #                 blocked peer learns that this rank is gone), and Gloo's teardown would wait for them


def _collect(queue: Any, procs: list[Any], world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, tuple[str, Any]] = {}
    while len(results) < world_size:
        if not queue.empty():
            rank, status, value = queue.get()
            results[rank] = (status, value)
            continue
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(results))
            errors = {r: v for r, (s, v) in results.items() if s == "error"}
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s; errors from other ranks: "
                               f"{errors}")
        if all(not p.is_alive() for r, p in enumerate(procs) if r not in results) and queue.empty():
            time.sleep(0.2)   # (a rank that reported may still hold its result in the queue's pipe)
            if not queue.empty():
                continue
            missing = sorted(set(range(world_size)) - set(results))
            raise RuntimeError(f"ranks {missing} died without reporting (exit codes {[p.exitcode for p in procs]})")
        time.sleep(0.01)
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} failed ---\n{v}" for r, v in sorted(errors.items())))
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


def _stop(procs: list[Any], grace: float = 5.0) -> None:
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0,
                    pg_timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh Gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Raises ``RuntimeError`` with every
    failing rank's traceback if any rank fails, and ``TimeoutError`` if the ranks do not all
    finish within ``timeout`` seconds (the processes are then killed, never left hanging).
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    done = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout, done), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(queue, procs, world_size, timeout)
    finally:
        done.set()
        _stop(procs)


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any, pg_timeout: float) -> None:
    try:
        _init(rank, world_size, port, pg_timeout)
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        outcome = _call(rank, world_size, fn, args)
        _tidy()
        results.put((rank, *outcome))
    os._exit(0)   # no teardown of the group: the peers are leaving too, and Gloo's would wait for them


def _tidy() -> None:
    """What a task left behind in a pool's rank: its open engines closed (which destroys their groups), any other
    group it made destroyed, so that the rank's Gloo threads do not pile up over the session (two per group and
    peer, each waking now and then: hundreds of groups slowed every later test)."""
    for engine in list(release._OPEN):
        release.release(engine)
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.collect()
    gc.freeze()   # what survives (torch's modules, imported lazily by the first tasks) is never scanned again: a
    #               full collection over it cost 0.1-0.3 s per task and rank


class WorldPool:
    """``world_size`` Gloo ranks started once and reused for many calls (spawning is the slow part on 2 cores).

    Only for code that leaves the process group healthy: a call that fails or times out on any rank
    closes the pool (its ranks may be stuck in a collective, and the fault channel would carry the
    failure into the next call); the next call starts a fresh one.
    """

    def __init__(self, world_size: int, pg_timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = _context()
        self._results = ctx.SimpleQueue()
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, port, self._tasks[r], self._results,
                                                        self.pg_timeout), daemon=True)
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank of the pool; the results by rank (as run_distributed)."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        try:
            return _collect(self._results, self._procs, self.world_size, timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p, q in zip(self._procs, getattr(self, "_tasks", [])):
            if p.is_alive():
                q.put(None)
        _stop(self._procs, grace=2.0)
        self._procs = []


def pipe_sh(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``launch/pipe.sh args...`` as given (usage, argument checks)."""
    return subprocess.run(["bash", str(ROOT / "launch" / "pipe.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})), cwd=cwd)


def pipe_sh_command(tmp_path: Path, n: int, flags: tuple[str, ...],
                    env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of :func:`pipe_sh_job`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_RANK": "0", **(env or {})}
    cmd = ["bash", str(ROOT / "launch" / "pipe.sh"), str(n), "cpus", "--log-dir", str(tmp_path), "--run-name", "run",
           *flags]
    return cmd, full_env


def pipe_sh_job(tmp_path: Path, n: int, *flags: str, timeout: float = 240, env: dict[str, str] | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
    """The training job as a user runs it: ``launch/pipe.sh n cpus --log-dir tmp_path --run-name run flags...``."""
    cmd, full_env = pipe_sh_command(tmp_path, n, flags, env)
    proc = subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def start_pipe_sh_job(tmp_path: Path, n: int, *flags: str, env: dict[str, str] | None = None,
                      merge_stderr: bool = False) -> subprocess.Popen[str]:
    """:func:`pipe_sh_job` started in its own session, to be signalled (``os.killpg(proc.pid, ...)``).

    SIGINT is reset to its default first: a test run started in the background of a non-interactive
    shell inherits SIGINT ignored, and bash cannot trap a signal ignored at its start (pipe.sh would
    never see the Ctrl-C the test sends)."""
    cmd, full_env = pipe_sh_command(tmp_path, n, flags, env)
    return subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def python_cli(*args: str, code: str | None = None, timeout: float = 120,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m args...`` (or ``python -c code args...``) from the repository root."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def on_a_terminal(cmd: list[str], env: dict[str, str], cwd: Path, stderr_too: bool = False,
                  timeout: float = 100) -> tuple[int, str]:
    """Run ``cmd`` with its stdout (and stderr, if ``stderr_too``) on a pseudo-terminal; (exit status, text). A run
    that fails has its stderr (when not on the terminal) after the text, to say why."""
    import pty
    import select
    import tempfile
    master, slave = pty.openpty()
    errors = tempfile.TemporaryFile()   # (a file, not a pipe: nothing to drain while it runs)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=slave, stderr=slave if stderr_too else errors,
                            start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1.0)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:   # the terminal closed: every writer has exited
                break
            if not data:
                break
            chunks.append(data.decode())
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    errors.seek(0)
    stderr = errors.read().decode(errors="replace")
    errors.close()
    return proc.returncode, "".join(chunks) + (f"\n[stderr]\n{stderr}" if proc.returncode and stderr else "")
