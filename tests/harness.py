"""Spawn N Gloo ranks on CPU for a test, with a free port and a hard timeout."""

from __future__ import annotations

import io
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           queue: Any, pg_timeout: float) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        # by value: torch's queue would share tensor storage through a file descriptor that dies
        # with this process, racing the parent's read
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report every failure to the parent, then re-raise
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0,
                    pg_timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Raises ``RuntimeError`` with every
    failing rank's traceback if any rank fails, and ``TimeoutError`` if the ranks do not all
    finish within ``timeout`` seconds (the processes are then killed, never left hanging).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, pg_timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    import time
    deadline = time.monotonic() + timeout
    results: dict[int, tuple[str, Any]] = {}
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, status, value = queue.get()
                results[rank] = (status, value)
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                errors = {r: v for r, (s, v) in results.items() if s == "error"}
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s; "
                                   f"errors from other ranks: {errors}")
            if all(not p.is_alive() for p in procs) and queue.empty():
                missing = sorted(set(range(world_size)) - set(results))
                raise RuntimeError(f"ranks {missing} died without reporting (exit codes "
                                   f"{[p.exitcode for p in procs]})")
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} failed ---\n{v}" for r, v in sorted(errors.items())))
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]
