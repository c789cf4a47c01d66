"""The save directory: one folder every node sees, and one run saving into it at a time."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch.distributed as dist

from ..runtime.agree import on_every_rank
from .checkpoint import CheckpointError

__all__ = ["check_shared"]


def check_shared(directory: str, flag: str = "--save-dir", claim: bool = False) -> None:
    """Every node sees the same ``directory`` (collective): rank 0 writes a probe file there, the first
    rank of every node reads it back. Checkpoints need that (rank 0 alone renames and prunes); a folder
    that is local to each node (or a relative path) fails here, on every rank, before any step. ``claim``:
    rank 0 also takes the folder's lock for this process's life (two runs saving into one folder would
    prune and overwrite each other's checkpoints)."""
    import socket
    import uuid
    token = uuid.uuid4().hex if dist.get_rank() == 0 else ""
    probe = os.path.join(directory, f".probe-{token}")
    if dist.get_rank() == 0:
        on_every_rank(lambda: _prepare(directory, probe, token, flag, claim), raise_as=CheckpointError)
    else:
        on_every_rank(lambda: None, raise_as=CheckpointError)
    names: list[Any] = [probe]
    dist.broadcast_object_list(names, src=0)

    def read() -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        try:
            with open(names[0]) as fh:
                ok = fh.read() == os.path.basename(names[0])[len(".probe-"):]
        except OSError:
            ok = False
        if not ok:
            raise CheckpointError(f"{flag} {directory!r} is not one folder for every node: node {socket.gethostname()} "
                                  f"(rank {dist.get_rank()}) does not see the file rank 0 wrote in it; give a path on "
                                  f"a filesystem every node shares (NFS, Lustre, ...), as an absolute path")

    try:
        on_every_rank(read, raise_as=CheckpointError)
    finally:
        if dist.get_rank() == 0:
            with contextlib.suppress(OSError):
                os.remove(probe)


_CLAIMED: dict[str, Any] = {}


def _claim(directory: str, flag: str) -> None:
    """Lock ``directory/.lock`` (flock) for this process's life; CheckpointError naming its holder if taken."""
    import fcntl
    import socket
    path = os.path.abspath(directory)
    if path in _CLAIMED:
        return
    try:
        os.makedirs(path, exist_ok=True)
        fh = open(os.path.join(path, ".lock"), "a+")
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {directory!r}: {exc.strerror or exc}; pass a writable "
                              f"{flag}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise CheckpointError(f"{flag} {directory!r} is in use by another run ({holder}); give each run its own "
                              f"{flag}") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    fh.flush()
    _CLAIMED[path] = fh


def _write_probe(directory: str, probe: str, token: str, flag: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write(token)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {directory!r}: {exc.strerror or exc}; pass a writable "
                              f"{flag}") from None


def _prepare(directory: str, probe: str, token: str, flag: str, claim: bool) -> None:
    if claim:
        _claim(directory, flag)
    _write_probe(directory, probe, token, flag)
