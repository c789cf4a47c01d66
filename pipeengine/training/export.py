"""A checkpoint outside training (no process group): export the unsplit model's state_dict, or inspect it.

    python -m pipeengine.checkpoint inspect CKPT            # manifest, tensor count and bytes
    python -m pipeengine.checkpoint export CKPT OUT.pt      # one plain state_dict of the unsplit model

The export is a file for ``torch.load(..., weights_only=True)``, keyed as ``nn.Sequential(*layers)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from typing import Sequence

import torch

from .checks import output_problem
from .checkpoint import CheckpointError, dcp_failures, manifest, metadata, read_failure, resolve
from .checksums import changed_tensor, layout_error

__all__ = ["export", "describe", "main"]


def export(path: str, out: str) -> int:
    """Write the unsplit model's plain ``state_dict`` (keys ``<layer>.<name>``, as ``nn.Sequential(*layers)``)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    path = resolve(path)
    _check_output(out)
    md, info = metadata(path), manifest(path)
    why = layout_error(md, info, path, only="layers.")
    if why:
        raise CheckpointError(why)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith("layers.")}
    try:
        with warnings.catch_warnings():   # "loading in a single process": exactly the intent here
            warnings.simplefilter("ignore")
            dcp_load(sd, checkpoint_id=path, no_dist=True)
    except dcp_failures() as exc:
        raise CheckpointError(f"checkpoint {path!r} could not be read: {read_failure(exc)}") from None
    why = changed_tensor(sd, info.get("checksums"), path)
    if why:
        raise CheckpointError(why)
    plain = {k[len("layers."):]: v for k, v in sorted(sd.items(), key=lambda kv: _layer_order(kv[0]))}
    tmp = out + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            torch.save(plain, fh)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"cannot write {out!r}: {why}; give a writable path (a disk with room?)") from None
    return len(plain)


def _check_output(out: str) -> None:
    """The export's file can be written (checked before the checkpoint is read)."""
    problem = output_problem(out)
    if problem:
        raise CheckpointError(problem)


def _layer_order(key: str) -> tuple[int, str]:
    _, index, rest = key.split(".", 2)
    return int(index), rest


def describe(path: str) -> str:
    path = resolve(path)
    md = metadata(path)
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
