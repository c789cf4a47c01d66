"""Letting go of torch.distributed: a closed engine destroys the process groups it made (its pipeline, data-parallel
and tie groups) and drops its references to the others, so that they are freed, with their Gloo threads, while
Python still runs.

[Note: a clean exit]
A Gloo group's worker threads stop only when its C++ object is freed (its ``shutdown()`` does nothing).
If one is still alive when the interpreter finalizes and then releases the last collective's tensors,
it needs the GIL; Python 3.11 ends such a thread with ``pthread_exit``, whose forced unwind passes a C++
destructor that may not throw: "terminate called without an active exception", SIGABRT (pytorch#38228).
So nothing may keep a group alive past ``dist.destroy_process_group()``: :meth:`PipelineEngine.close`
destroys the engine's groups and stops its fault watcher (which holds its group weakly), an atexit hook
closes the engines a script left open, and it unpins the default group torch itself keeps (see
:func:`_unpin_world`). A script ending with ``dist.destroy_process_group()`` then exits 0.

Destroying a subgroup is local to the rank (no collective), and torch's registry of groups holds each
one until then: a process that builds engine after engine (a notebook, a sweep, a test's pool of ranks)
would otherwise keep every engine's groups, two Gloo threads per group and peer, each waking now and then.
"""

from __future__ import annotations

import atexit
import sys
import types
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .engine import PipelineEngine

__all__ = ["opened", "release"]

_OPEN: weakref.WeakSet[PipelineEngine] = weakref.WeakSet()


def opened(engine: PipelineEngine) -> None:
    """``engine`` holds process groups until :func:`release` (or the exit)."""
    _OPEN.add(engine)


def release(engine: PipelineEngine) -> None:
    """Close ``engine`` (see the module note); later calls do nothing."""
    if engine.closed:
        return
    engine.closed = True
    _OPEN.discard(engine)
    if not any(e.watch is engine.watch for e in _OPEN):   # one watch per group, shared by its engines
        engine.watch.close()
    g = engine.groups                        # shared with local and consensus
    _destroy([g.dp_group, g.pp_group, *g.tie_groups.values()], engine.device)
    g.dp_group = g.pp_group = None
    g.tie_groups.clear()
    engine.ties.copies = [(mine, None, src) for mine, _, src in engine.ties.copies]
    engine.grad_sync.group = None            # ZeRO's too; the parameters' gradient hooks keep grad_sync
    engine.wire.group = engine.wire._pg = None


def _destroy(groups: list[Any], device: torch.device) -> None:
    """Destroy ``groups`` (this rank's own, made by build_groups), once the device finished what it queued on them;
    those destroyed already (``dist.destroy_process_group()`` before close) are skipped."""
    if not dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    registered = dist.distributed_c10d._world.pg_map   # no public "is this group still alive"
    for group in groups:
        if isinstance(group, dist.ProcessGroup) and group in registered and group is not dist.group.WORLD:
            dist.destroy_process_group(group)


@atexit.register
def _close_open() -> None:
    """Engines still open at exit (a script that only called ``dist.destroy_process_group()``): closed before the
    interpreter finalizes, which frees the process groups destroyed already."""
    for engine in list(_OPEN):
        release(engine)
    _unpin_world()


def _unpin_world() -> None:
    """Once no process group is initialized: let go of the one torch itself keeps. torch.distributed.nn.functional,
    when first imported after ``init_process_group`` (torch._dynamo imports it; an optimizer's constructor imports
    torch._dynamo), holds the default group of that moment as its functions' default ``group`` argument, so
    ``destroy_process_group()`` never frees it. None is what those defaults mean anyway (the default group)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None or dist.is_initialized():
        return
    for f in vars(functional).values():
        if isinstance(f, types.FunctionType) and f.__defaults__:
            f.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in f.__defaults__)
