"""Checkpoints on torch.distributed.checkpoint: keyed by global layer names, atomic, re-partitionable; export, inspect.

    python -m pipeengine.checkpoint inspect CKPT            # manifest, tensor count and bytes
    python -m pipeengine.checkpoint export CKPT OUT.pt      # one plain state_dict of the unsplit model

[Note: checkpoint layout]
A save directory holds one folder per checkpoint, ``step-00000100/``: the DCP files (``.metadata``
and one ``__<rank>_0.distcp`` shard per writing rank) and ``manifest.json`` (pp, dp, schedule,
chunks, partition bounds, precision, versions, step). Keys never name a rank or a stage:

    layers.<global layer index>.<name>           parameters and buffers (``layers.7.qkv.weight``)
    optim.layers.<i>.<name>.<state>              optimizer state of that parameter (``...exp_avg``)
    train.step, train.loss_scale, .good_steps    where training stands (data and LR follow the step)
    rng.rank<r>.cpu / .cuda                      every rank's RNG state (restored when the world matches)

so a checkpoint loads under any pp, dp, chunks or partition. Replicas (DP, tied copies) offer the
same keys and DCP writes each key once. A checkpoint is written as ``.tmp-step-…/`` and renamed
by rank 0 only after every rank finished and the manifest is in it: a folder named ``step-…`` is
complete; a ``.tmp-`` one is a crashed save, ignored (and reported) when looking for the latest, and
removed by the next save. Saving a step that exists moves the old folder aside (``.old-step-…``)
only for the rename. ``AsyncSaver`` writes the same layout from a background thread (DCP's
``async_save``); its checkpoint is published at the next save or ``finish()``.
Tensors are read by DCP; ``export`` writes a file for ``torch.load(..., weights_only=True)``. DCP's
own ``.metadata`` is a pickle (torch's format, not ours): load checkpoints you trust.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

if TYPE_CHECKING:
    from .engine import PipelineEngine

__all__ = ["CheckpointError", "save", "AsyncSaver", "load", "latest", "resolve", "export", "main"]

MANIFEST = "manifest.json"
PREFIX, TMP, OLD = "step-", ".tmp-step-", ".old-step-"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or of another model; the message says which."""


def _model_entries(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by global key (detached views: loading writes into them)."""
    out: dict[str, torch.Tensor] = {}
    for ch in engine.chunks:
        start = engine.bounds[ch.stage]
        for j, layer in enumerate(ch.module.layers):
            for name, t in layer.state_dict(keep_vars=True).items():
                out[f"layers.{start + j}.{name}"] = t.detach()
    return out


def _param_keys(engine: PipelineEngine) -> dict[int, str]:
    """Parameter id -> its first global key (a tied parameter's copies share one optimizer state)."""
    keys: dict[int, str] = {}
    for ch in engine.chunks:
        start = engine.bounds[ch.stage]
        for j, layer in enumerate(ch.module.layers):
            for name, p in layer.named_parameters(remove_duplicate=False):
                keys.setdefault(id(p), f"layers.{start + j}.{name}")
    return keys


def _state(engine: PipelineEngine, step: int) -> dict[str, Any]:
    sd: dict[str, Any] = dict(_model_entries(engine))
    keys = _param_keys(engine)
    for p in engine.parameters:
        for name, value in engine.optimizer.state.get(p, {}).items():
            sd[f"optim.{keys[id(p)]}.{name}"] = value
    sd["train.step"] = torch.tensor(step)
    sd["train.loss_scale"] = torch.tensor(engine.loss_scale.value, dtype=torch.float64)
    sd["train.good_steps"] = torch.tensor(engine.loss_scale.good_steps)
    sd[f"rng.rank{engine.rank}.cpu"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        sd[f"rng.rank{engine.rank}.cuda"] = torch.cuda.get_rng_state(engine.device)
    return sd


def _manifest(engine: PipelineEngine, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        ours = version("pipeengine")
    except PackageNotFoundError:
        ours = "unknown"
    return {"format": 1, "step": step, "pp": engine.topology.pp, "dp": engine.topology.dp,
            "world_size": engine.topology.world_size, "schedule": engine.schedule.name,
            "chunks": engine.schedule.chunks, "microbatches": engine.microbatches, "bounds": engine.bounds,
            "num_layers": engine.num_layers, "precision": engine.precision,
            "schedule_costs": None if engine.schedule_costs is None else
            [engine.schedule_costs.f, engine.schedule_costs.b, engine.schedule_costs.w],
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
    _agree(error)
    return tmp, final


def _failed(tmp: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (f"saving {tmp!r} failed ({type(exc).__name__}: {text[0][:300] if text else ''}); the previous "
            f"checkpoints are intact (disk full or not writable?)")


def _publish(engine: PipelineEngine, tmp: str, final: str, info: dict[str, Any], keep: int | None) -> None:
    """After every rank wrote its shard: the manifest, then one rename makes the checkpoint visible."""
    dist.barrier()
    error = None
    if engine.rank == 0:
        try:
            with open(os.path.join(tmp, MANIFEST), "w") as fh:
                json.dump(info, fh, indent=1)
            old = os.path.join(os.path.dirname(final), OLD + os.path.basename(final)[len(PREFIX):])
            if os.path.exists(final):   # the same step saved again: the old one stays complete (and found by
                os.replace(final, old)  # complete_checkpoints) until the new one has its name
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            if keep is not None:
                for gone in complete_checkpoints(os.path.dirname(final))[:-keep] if keep > 0 else []:
                    shutil.rmtree(gone, ignore_errors=True)
        except OSError as exc:
            error = _failed(tmp, exc)
    _agree(error)


def save(engine: PipelineEngine, directory: str, step: int, *, keep: int | None = None,
         extra: dict[str, Any] | None = None) -> str:
    """Save this step's state (collective: every rank calls it); return the checkpoint's folder.

    ``keep``: delete all but the newest ``keep`` complete checkpoints afterwards. ``extra``: more
    manifest fields (the trainer adds its model and config).
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    tmp, final = _begin(engine, directory, step)
    state = _local(tmp, lambda: _state(engine, step))
    try:
        dcp_save(state, checkpoint_id=tmp)
    except (Exception, CheckpointException) as exc:   # DCP raises every rank's write errors on all ranks
        raise CheckpointError(_failed(tmp, exc)) from None
    _publish(engine, tmp, final, _manifest(engine, step, extra), keep)
    return final


def _local(tmp: str, work: Any) -> Any:
    """``work()`` on every rank, a failure on one (host memory for the copy) raised on all before any
    rank enters DCP's collectives, where the others would wait for it."""
    result, error = None, None
    try:
        result = work()
    except (Exception, CheckpointException) as exc:
        error = _failed(tmp, exc)
    _agree(error)
    return result


class AsyncSaver:
    """Saves that write in the background (DCP's ``async_save``) while training goes on.

    ``save`` copies this rank's state to host memory (the training step waits for that copy, and
    for the previous save if it is still writing) and returns; a thread writes the shards over a
    Gloo group of its own, so its collectives never interleave with the engine's (``timeout``:
    seconds they may wait). The checkpoint becomes visible (manifest, rename) at the next ``save``
    or at ``finish()``, which every rank calls at the same point: until then it is a ``.tmp-``
    folder, ignored by ``latest``. Create it on every rank at the same point (it makes a group).
    """

    def __init__(self, timeout: float = 600.0) -> None:
        from datetime import timedelta
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        assert isinstance(group, dist.ProcessGroup)   # every rank is a member
        self.group = group
        self._pending: tuple[Any, PipelineEngine, str, str, dict[str, Any], int | None] | None = None

    def save(self, engine: PipelineEngine, directory: str, step: int, *, keep: int | None = None,
             extra: dict[str, Any] | None = None) -> str:
        from torch.distributed.checkpoint.state_dict_saver import async_save
        self.finish()
        tmp, final = _begin(engine, directory, step)
        future = _local(tmp, lambda: async_save(_state(engine, step), checkpoint_id=tmp,
                                                process_group=self.group))   # copies, then a thread writes
        self._pending = (future, engine, tmp, final, _manifest(engine, step, extra), keep)
        return final

    def finish(self) -> str | None:
        """Wait for the save in flight (if any) and make it visible; its folder."""
        if self._pending is None:
            return None
        future, engine, tmp, final, info, keep = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:
            error = _failed(tmp, exc)
        _agree(error)
        _publish(engine, tmp, final, info, keep)
        return final


def _agree(error: str | None) -> None:
    """Raise the first rank's error on every rank (a check that fails on one rank must not hang the others)."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


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
    return [os.path.join(directory, found[k]) for k in sorted(found)
            if os.path.exists(os.path.join(directory, found[k], MANIFEST))]


def latest(directory: str) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint or None, the partial ones: crashed saves, ignored)."""
    partial = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                     if n.startswith(TMP)) if os.path.isdir(directory) else []
    done = complete_checkpoints(directory)
    return (done[-1] if done else None), partial


def resolve(path: str) -> str:
    """A checkpoint folder from a checkpoint folder or a save directory (its newest); CheckpointError if none."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a file; give a checkpoint folder (step-…) or a save directory")
    if os.path.exists(os.path.join(path, ".metadata")):
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise CheckpointError(f"checkpoint {path!r} is incomplete (no {MANIFEST}: the save did not finish)")
        return path
    found, partial = latest(path)
    if found is None:
        more = f" (only incomplete saves: {', '.join(os.path.basename(p) for p in partial)})" if partial else ""
        raise CheckpointError(f"{path!r} holds no complete checkpoint{more}")
    return found


def _metadata(path: str) -> Any:
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
        if isinstance(t, torch.Tensor) and size != tuple(t.shape):
            return f"checkpoint {path!r} has {key} of shape {size}, but the model's is {tuple(t.shape)}"
    return None


def load(engine: PipelineEngine, path: str) -> dict[str, Any]:
    """Load a checkpoint into the engine (collective); return its manifest. Any pp, dp, chunks, partition.

    RNG states are restored only when the checkpoint's world size equals this one's (a re-partitioned
    run has other ranks).
    """
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    error, info, md = None, {}, None
    try:
        path = resolve(path)
        md = _metadata(path)
        info = manifest(path)
    except (CheckpointError, OSError, ValueError) as exc:
        error = str(exc)
    _agree(error)
    assert md is not None
    sd: dict[str, Any] = dict(_model_entries(engine))
    keys = _param_keys(engine)
    saved: dict[str, dict[str, str]] = {}   # parameter key -> state name -> checkpoint key (one pass)
    for key in md.state_dict_metadata:
        if key.startswith("optim."):
            param_key, _, name = key[len("optim."):].rpartition(".")
            saved.setdefault(param_key, {})[name] = key
    aliases = {f"layers.{i}.{n}": [f"layers.{j}.{m}" for j, m in tie] for tie in engine.ties.tied for i, n in tie}
    optim: dict[int, dict[str, str]] = {}   # param id -> state name -> key
    for p in engine.parameters:
        # a tied parameter's state may have been saved under another copy's key (another partition)
        found = next((saved[k] for k in [keys[id(p)], *aliases.get(keys[id(p)], [])] if k in saved), {})
        optim[id(p)] = found
        for name, key in found.items():
            meta = md.state_dict_metadata[key]
            sd[key] = (torch.empty(tuple(meta.size), dtype=meta.properties.dtype,
                                   device="cpu" if name == "step" else p.device) if hasattr(meta, "size") else None)
    sd["train.step"] = torch.tensor(0)
    sd["train.loss_scale"] = torch.tensor(1.0, dtype=torch.float64)
    if "train.good_steps" in md.state_dict_metadata:
        sd["train.good_steps"] = torch.tensor(0)
    same_world = info.get("world_size") == engine.topology.world_size
    rng_keys = [k for k in md.state_dict_metadata if k.startswith(f"rng.rank{engine.rank}.")] if same_world else []
    for k in rng_keys:
        sd[k] = torch.empty(tuple(md.state_dict_metadata[k].size), dtype=torch.uint8)
    _agree(_check(sd, md, path))
    try:
        dcp_load(sd, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # DCP gathers every rank's read errors, raises them on all
        raise CheckpointError(f"checkpoint {path!r} could not be read (damaged or truncated file?): "
                              f"{str(exc).splitlines()[0][:300]}") from None
    for p in engine.parameters:
        if optim[id(p)]:
            engine.optimizer.state[p] = {name: sd[key] for name, key in optim[id(p)].items()}
    if engine.loss_scale.enabled and info.get("precision") == "fp16":   # else the scale starts afresh
        engine.loss_scale.value = float(sd["train.loss_scale"])
        engine.loss_scale.good_steps = int(sd.get("train.good_steps", 0))
    for k in rng_keys:
        if k.endswith(".cpu"):
            torch.set_rng_state(sd[k])
        elif engine.device.type == "cuda":
            torch.cuda.set_rng_state(sd[k], engine.device)
    info["step"] = int(sd["train.step"])
    info["path"] = path
    return info


# ------------------------------------------------------------------ export and inspect (no process group)

def export(path: str, out: str) -> int:
    """Write the unsplit model's plain ``state_dict`` (keys ``<layer>.<name>``, as ``nn.Sequential(*layers)``)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    path = resolve(path)
    md = _metadata(path)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith("layers.")}
    try:
        with warnings.catch_warnings():   # "loading in a single process": exactly the intent here
            warnings.simplefilter("ignore")
            dcp_load(sd, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path!r} could not be read (damaged or truncated file?): "
                              f"{str(exc).splitlines()[0][:300]}") from None
    plain = {k[len("layers."):]: v for k, v in sorted(sd.items(), key=lambda kv: _layer_order(kv[0]))}
    tmp = out + ".tmp"
    torch.save(plain, tmp)
    os.replace(tmp, out)
    return len(plain)


def _layer_order(key: str) -> tuple[int, str]:
    _, index, rest = key.split(".", 2)
    return int(index), rest


def describe(path: str) -> str:
    path = resolve(path)
    md = _metadata(path)
    tensors = [m for m in md.state_dict_metadata.values() if hasattr(m, "size")]
    nbytes = sum(torch.Size(m.size).numel() * torch.empty((), dtype=m.properties.dtype).element_size()
                 for m in tensors)
    model = [k for k in md.state_dict_metadata if k.startswith("layers.")]
    return "\n".join([f"checkpoint {path}", json.dumps(manifest(path), indent=1),
                      f"{len(tensors)} tensors ({len(model)} model, "
                      f"{sum(k.startswith('optim.') for k in md.state_dict_metadata)} optimizer), "
                      f"{nbytes / 2**20:,.1f} MiB"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeengine.checkpoint", description=(
        "Inspect a pipeengine checkpoint or export its model as one plain state_dict."))
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="print the manifest, tensor count and bytes")
    i.add_argument("ckpt", help="a checkpoint folder (step-…) or a save directory (its newest checkpoint)")
    e = sub.add_parser("export", help="write the unsplit model's state_dict (load it into nn.Sequential(*layers))")
    e.add_argument("ckpt", help="a checkpoint folder (step-…) or a save directory (its newest checkpoint)")
    e.add_argument("out", help="the .pt file to write (torch.load(..., weights_only=True) reads it)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "inspect":
            print(describe(a.ckpt))
        else:
            n = export(a.ckpt, a.out)
            print(f"wrote {n} tensors to {a.out}")
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
