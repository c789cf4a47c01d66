"""Checkpoints (saved training states) on torch.distributed.checkpoint: the file layout and the atomic save.

[Note: checkpoint layout]
A save directory holds one folder per checkpoint, ``step-00000100/``: the DCP files (``.metadata``
and one ``__<rank>_0.distcp`` shard per writing rank) and ``manifest.json`` (pp, dp, schedule,
chunks, partition bounds, precision, versions, step). What is saved is the engine's
``state_dict()``, keyed by global names that never name a rank or a stage (runtime/state.py), so
a checkpoint loads under any pp, dp, chunks or partition. Replicas (DP, tied copies) offer the
same keys and DCP writes each key once. A checkpoint is written as ``.tmp-step-…/`` and renamed
by rank 0 only after every rank finished and the manifest is in it: a folder named ``step-…`` is
complete; a ``.tmp-`` one is a crashed save, ignored (and reported) when looking for the latest, and
removed by the next save. Saving a step that exists moves the old folder aside (``.old-step-…``)
only for the rename. ``AsyncSaver`` writes the same layout from a background thread (DCP's
``async_save``); its checkpoint is published at the next save or ``finish()``. DCP's own
``.metadata`` is a pickle (torch's format, not ours): load checkpoints you trust. Outside training,
``python -m pipeengine.checkpoint`` inspects a checkpoint or exports the plain model (export.py).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..runtime.agree import on_every_rank, raise_if_any
from ..runtime.faults import watch
from ..runtime.logs import log
from .checksums import changed_tensor, checksums, gathered_checksums, layout_error

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine

__all__ = ["CheckpointError", "save", "AsyncSaver", "load", "latest", "resolve", "manifest", "complete_checkpoints",
           "metadata", "read_failure", "dcp_failures"]

MANIFEST = "manifest.json"
PREFIX, TMP, OLD = "step-", ".tmp-step-", ".old-step-"


def dcp_failures() -> tuple[type[BaseException], ...]:
    """What a DCP call may raise: any error, and its CheckpointException (a BaseException), every rank's failures
    gathered. Imported when needed: torch.distributed.checkpoint takes half a second to import (a rank's start)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or of another model; the message says which."""


def _manifest(engine: PipelineEngine, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        ours = version("pipeengine")
    except PackageNotFoundError:
        ours = "unknown"
    return {"format": 1, "step": step, "pp": engine.topology.pp, "dp": engine.topology.dp,
            "world_size": engine.topology.world_size, "schedule": engine.schedule.name,
            "chunks": engine.schedule.chunks, "microbatches": engine.microbatches, "bounds": engine.bounds,
            "num_layers": engine.num_layers, "precision": engine.precision, "zero": int(engine.zero is not None),
            "schedule_costs": None if engine.plan.costs is None else
            [engine.plan.costs.f, engine.plan.costs.b, engine.plan.costs.w],
            "versions": {"pipeengine": ours, "torch": torch.__version__},
            "saved": time.strftime("%Y-%m-%d %H:%M:%S"), **(extra or {})}


def _begin(engine: PipelineEngine, directory: str, step: int) -> tuple[str, str]:
    """Make the save's temporary folder (rank 0; an error is raised on every rank); (temporary, final)."""
    final = os.path.join(directory, f"{PREFIX}{step:08d}")
    tmp = os.path.join(directory, f"{TMP}{step:08d}")
    error = None
    if engine.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            for name in os.listdir(directory):   # a crashed save's leftovers (no save is in flight now)
                path = os.path.join(directory, name)
                if name.startswith(OLD) and not os.path.exists(os.path.join(directory, PREFIX + name[len(OLD):])):
                    os.replace(path, os.path.join(directory, PREFIX + name[len(OLD):]))   # a re-save died mid-swap
                elif name.startswith((TMP, OLD)):
                    shutil.rmtree(path, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as exc:
            error = f"cannot write checkpoints to {directory!r}: {exc.strerror or exc}; pass a writable --save-dir"
    raise_if_any(error, CheckpointError)
    return tmp, final


def _failed(tmp: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (f"saving {tmp!r} failed ({type(exc).__name__}: {text[0][:300] if text else ''}); the previous "
            f"checkpoints are intact (disk full or not writable?)")


def _publish(engine: PipelineEngine, tmp: str, final: str, info: dict[str, Any], keep: int | None,
             sums: dict[str, Any]) -> None:
    """After every rank wrote its shard: the manifest (with every rank's tensor checksums and every tensor's
    global shape), then one rename makes the checkpoint visible."""
    everyone = gathered_checksums(sums)   # also the barrier: every rank's write is done
    info = {**info, "checksums": everyone["checksums"], "shapes": everyone["shapes"]}
    error = None
    if engine.rank == 0:
        try:
            with open(os.path.join(tmp, MANIFEST), "w") as fh:
                json.dump(info, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())   # on disk before the rename makes the folder count as complete
            _fsync_dir(tmp)
            old = os.path.join(os.path.dirname(final), OLD + os.path.basename(final)[len(PREFIX):])
            if os.path.exists(final):   # the same step saved again: the old one stays complete (and found by
                os.replace(final, old)  # complete_checkpoints) until the new one has its name
            os.replace(tmp, final)
            _fsync_dir(os.path.dirname(final))   # the rename itself survives a power loss
            shutil.rmtree(old, ignore_errors=True)
            if keep is not None:
                for gone in complete_checkpoints(os.path.dirname(final))[:-keep] if keep > 0 else []:
                    shutil.rmtree(gone, ignore_errors=True)
        except OSError as exc:
            error = _failed(tmp, exc)
    raise_if_any(error, CheckpointError)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(path: str) -> bool:
    """A checkpoint folder counts as complete once its manifest holds something (it is written last)."""
    try:
        return os.path.getsize(os.path.join(path, MANIFEST)) > 0
    except OSError:
        return False


def _state(engine: PipelineEngine, step: int) -> dict[str, Any]:
    state = engine.state_dict()
    state["train.step"] = torch.tensor(step)
    return state


def save(engine: PipelineEngine, directory: str, step: int | None = None, *, keep: int | None = None,
         extra: dict[str, Any] | None = None) -> str:
    """Save the engine's state (collective: every rank calls it); return the checkpoint's folder.

    ``step``: the step it is saved as (default: the engine's ``step_count``). ``keep``: delete all but
    the newest ``keep`` complete checkpoints afterwards. ``extra``: more manifest fields (the trainer
    adds its model and config).
    """
    step = engine.step_count if step is None else step
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    tmp, final = _begin(engine, directory, step)
    state = _local(tmp, lambda: _state(engine, step))
    try:
        dcp_save(state, checkpoint_id=tmp)
    except dcp_failures() as exc:   # DCP raises every rank's write errors on all ranks
        raise CheckpointError(_failed(tmp, exc)) from None
    _publish(engine, tmp, final, _manifest(engine, step, extra), keep, checksums(state))
    return final


def _local(tmp: str, work: Any) -> Any:
    """``work()`` on every rank, a failure on one (host memory for the copy) raised on all before any
    rank enters DCP's collectives, where the others would wait for it."""
    return on_every_rank(work, catch=dcp_failures(), raise_as=CheckpointError,
                         describe=lambda exc: _failed(tmp, exc))


class AsyncSaver:
    """Saves that write in the background (DCP's ``async_save``) while training goes on.

    ``save`` copies this rank's state to host memory (the training step waits for that copy, and
    for the previous save if it is still writing) and returns; a thread writes the shards over a
    Gloo group of its own, so its collectives never interleave with the engine's (``timeout``:
    seconds they may wait). The checkpoint becomes visible (manifest, rename) as soon as every rank's
    write completed: ``poll()``, which the trainer calls at every step boundary, asks (one small
    all-reduce on a Gloo group of its own, only while a save is in flight); ``finish()`` (at the next
    save or the end) waits for it. Until then it is a ``.tmp-`` folder, ignored by ``latest``. Every
    rank calls these at the same points; create it on every rank at the same point (it makes groups).
    """

    def __init__(self, timeout: float = 600.0) -> None:
        from datetime import timedelta
        limit = timedelta(seconds=timeout)
        group, asking = dist.new_group(backend="gloo", timeout=limit), dist.new_group(backend="gloo", timeout=limit)
        assert isinstance(group, dist.ProcessGroup) and isinstance(asking, dist.ProcessGroup)   # every rank's
        self.group, self._asking = group, asking
        me = dist.get_rank()   # the poll waits on every other rank: watched as the engine's waits are
        self._peers = [r for r in range(dist.get_world_size()) if r != me]
        self._pending: tuple[Any, PipelineEngine, str, str, dict[str, Any], int | None, dict[str, Any]] | None = None

    def poll(self) -> str | None:
        """Make the save in flight visible if every rank's write has completed; its folder, else None."""
        if self._pending is None:
            return None
        done = torch.tensor([int(self._pending[0].done())])
        work = dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._asking, async_op=True)
        watch().wait(work, "the checkpoint's completion poll", self._peers)
        return self.finish() if int(done) else None

    def save(self, engine: PipelineEngine, directory: str, step: int | None = None, *, keep: int | None = None,
             extra: dict[str, Any] | None = None) -> str:
        from torch.distributed.checkpoint.state_dict_saver import async_save
        step = engine.step_count if step is None else step
        self.finish()
        tmp, final = _begin(engine, directory, step)

        def stage() -> tuple[Any, dict[str, str]]:   # copies, then a thread writes; the copy is what is summed
            state = _state(engine, step)
            return async_save(state, checkpoint_id=tmp, process_group=self.group), checksums(state)
        future, sums = _local(tmp, stage)
        self._pending = (future, engine, tmp, final, _manifest(engine, step, extra), keep, sums)
        return final

    def finish(self) -> str | None:
        """Wait for the save in flight (if any) and make it visible; its folder."""
        if self._pending is None:
            return None
        future, engine, tmp, final, info, keep, sums = self._pending
        self._pending = None
        on_every_rank(future.result, catch=dcp_failures(), raise_as=CheckpointError,
                      describe=lambda exc: _failed(tmp, exc))
        _publish(engine, tmp, final, info, keep, sums)
        return final


def complete_checkpoints(directory: str) -> list[str]:
    """Complete checkpoints in a save directory, oldest first (an ``.old-step-…`` one whose re-save died
    between the two renames counts: it is complete and nothing replaced it)."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    found = {n[len(PREFIX):]: n for n in names if n.startswith(PREFIX)}
    for n in names:
        if n.startswith(OLD):
            found.setdefault(n[len(OLD):], n)
    return [os.path.join(directory, found[k]) for k in sorted(found) if _complete(os.path.join(directory, found[k]))]


def latest(directory: str) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint or None, the partial ones, ignored: crashed saves, and ``step-`` folders
    without a manifest, e.g. an unfinished copy)."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    partial = [os.path.join(directory, n) for n in names if n.startswith(TMP)] + [
        os.path.join(directory, n) for n in names if n.startswith(PREFIX) and not _complete(os.path.join(directory, n))]
    done = complete_checkpoints(directory)
    return (done[-1] if done else None), partial


def resolve(path: str) -> str:
    """A checkpoint folder from a checkpoint folder or a save directory (its newest); CheckpointError if none."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a file; give a checkpoint folder (step-…) or a save directory")
    if os.path.exists(os.path.join(path, ".metadata")):
        if not _complete(path):
            raise CheckpointError(f"checkpoint {path!r} is incomplete (no {MANIFEST}, or an empty one: the save did "
                                  f"not finish)")
        return path
    found, partial = latest(path)
    if found is None:
        more = f" (only incomplete saves: {', '.join(os.path.basename(p) for p in partial)})" if partial else ""
        raise CheckpointError(f"{path!r} holds no complete checkpoint{more}")
    return found


def metadata(path: str) -> Any:
    """DCP's index of a checkpoint's tensors."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # a damaged .metadata: pickle, EOF or OS errors
        raise CheckpointError(f"checkpoint {path!r} is damaged: cannot read its .metadata ({type(exc).__name__}: "
                              f"{exc})") from None


def manifest(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            result = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} is damaged: cannot read its {MANIFEST} ({exc})") from None
    if not isinstance(result, dict):
        raise CheckpointError(f"checkpoint {path!r} is damaged: its {MANIFEST} is not a JSON object")
    return result


def _check(sd: dict[str, Any], md: Any, path: str) -> str | None:
    """Why ``sd`` cannot be loaded from metadata ``md``, or None."""
    for key, t in sd.items():
        meta = md.state_dict_metadata.get(key)
        if meta is None:
            return (f"checkpoint {path!r} has no {key} (the checkpoint is of another model: it has "
                    f"{sum(k.startswith('layers.') for k in md.state_dict_metadata)} model tensors)")
        size = tuple(getattr(meta, "size", ()))
        shape = tuple(getattr(t, "global_shape", getattr(t, "shape", ())))   # a ZeRO-1 part: its tensor's shape
        if isinstance(t, torch.Tensor) and size != shape:
            return f"checkpoint {path!r} has {key} of shape {size}, but the model's is {shape}"
    return None


def read_failure(exc: BaseException) -> str:
    """The first failure inside DCP's exception (every rank's, gathered), as ``Type: message`` on one line; a file
    that ended early or does not unpickle is said to be damaged (an OSError says its own cause)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    damaged = isinstance(exc, (EOFError, pickle.UnpicklingError)) or "unexpected end" in text.lower()
    return f"{type(exc).__name__}: {text}" + (" (a damaged or truncated file)" if damaged else "")


def load(engine: PipelineEngine, path: str) -> dict[str, Any]:
    """Load a checkpoint into the engine (collective); return its manifest. Any pp, dp, chunks, partition.

    RNG states are restored only when the checkpoint's world size equals this one's (a re-partitioned
    run has other ranks).
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    def read() -> tuple[str, Any, dict[str, Any]]:
        where = resolve(path)
        md, info = metadata(where), manifest(where)
        why = layout_error(md, info, where)
        if why:
            raise CheckpointError(f"{why}; resume from another checkpoint")
        return where, md, info

    path, md, info = on_every_rank(read, catch=(CheckpointError, OSError, ValueError), raise_as=CheckpointError)
    if not isinstance(info.get("checksums"), dict) and dist.get_rank() == 0:
        log.warning(f"note: checkpoint {path!r} carries no checksums in its {MANIFEST} (written before they existed, "
                    f"or the manifest was edited): its tensors are loaded unverified")
    saved = {k: (tuple(m.size), m.properties.dtype) if hasattr(m, "size") else None
             for k, m in md.state_dict_metadata.items()}
    sd = engine.loadable_state_dict(saved, restore_rng=info.get("world_size") == engine.topology.world_size)
    raise_if_any(_check(sd, md, path), CheckpointError)
    try:
        dcp_load(sd, checkpoint_id=path)
    except dcp_failures() as exc:  # DCP gathers every rank's read errors, raises them on all
        raise CheckpointError(f"checkpoint {path!r} could not be read: {read_failure(exc)}") from None
    as_saved = {k: v for k, v in sd.items()   # read in the dtype it was written in: comparable with its checksum
                if isinstance(v, torch.Tensor) and (saved.get(k) or (0, None))[1] == v.dtype}
    raise_if_any(changed_tensor(as_saved, info.get("checksums"), path), CheckpointError)
    engine.load_state_dict(sd, fp16_scale=info.get("precision") == "fp16")
    info["step"] = int(sd["train.step"])
    info["path"] = path
    return info
