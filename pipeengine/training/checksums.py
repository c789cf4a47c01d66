"""A checksum per tensor in every checkpoint: a load names the tensor whose bytes changed after it was written.

Every rank sums the tensors of its state at save time (CRC-32 of dtype, shape and bytes); rank 0 gathers them
into the manifest (``checksums``: key -> 8 hex digits). A load sums what it read, for every key it read in the
saved dtype, and compares: the same logical tensors whatever pp x dp saved or loads them. A ZeRO-1 replica's
part of an optimizer state tensor (DCP shards with global offsets, runtime/zero.py) has no sum of its own.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from ..runtime.agree import gathered
from ..runtime.tensors import crc32

__all__ = ["checksums", "gathered_checksums", "changed_tensor"]


def checksums(state: Mapping[str, Any]) -> dict[str, str]:
    """This rank's tensors' checksums, by state key."""
    return {k: f"{crc32(v):08x}" for k, v in state.items() if isinstance(v, torch.Tensor) and not _part(v)}


def _part(t: torch.Tensor) -> bool:
    return hasattr(t, "global_offsets")


def gathered_checksums(local: dict[str, str]) -> dict[str, str]:
    """Every rank's checksums merged (collective; replicas hold equal tensors, the first rank's entry stays)."""
    merged: dict[str, str] = {}
    for sums in gathered(local, None):
        for key, value in sums.items():
            merged.setdefault(key, value)
    return merged


def changed_tensor(state: Mapping[str, Any], saved: Any, path: str) -> str | None:
    """Why a tensor read from checkpoint ``path`` is not what was written (``saved``: the manifest's checksums),
    or None. Tensors read into another dtype than saved, and checkpoints without checksums, are not compared."""
    if not isinstance(saved, dict):
        return None
    for key, value in state.items():
        want = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(want, str) and not _part(value):
            got = f"{crc32(value):08x}"
            if got != want:
                return (f"checkpoint {path!r} is damaged: {key} does not match its checksum (written {want}, read "
                        f"{got}): the file changed after it was saved; resume from another checkpoint")
    return None
