"""A checksum and a shape per tensor in every checkpoint: a load names the tensor that changed or does not add up.

Every rank sums the tensors of its state at save time (CRC-32 of dtype, shape and bytes); rank 0 gathers them
into the manifest (``checksums``: key -> 8 hex digits), with every tensor's global shape (``shapes``). A load
sums what it read, for every key it read in the saved dtype, and compares: the same logical tensors whatever
pp x dp saved or loads them. A ZeRO-1 replica's part of an optimizer state tensor (DCP shards with global
offsets, runtime/zero.py) has no sum of its own; its shape is the whole tensor's, and :func:`layout_error`
checks that the parts DCP holds cover it exactly.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from ..runtime.agree import gathered
from ..runtime.tensors import crc32

__all__ = ["checksums", "gathered_checksums", "changed_tensor", "layout_error"]


def checksums(state: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's tensors' checksums and global shapes, by state key."""
    return {"checksums": {k: f"{crc32(v):08x}" for k, v in state.items() if isinstance(v, torch.Tensor)
                          and not _part(v)},
            "shapes": {k: list(getattr(v, "global_shape", v.shape)) for k, v in state.items()
                       if isinstance(v, torch.Tensor)}}


def _part(t: torch.Tensor) -> bool:
    return hasattr(t, "global_offsets")


def gathered_checksums(local: dict[str, Any]) -> dict[str, Any]:
    """Every rank's :func:`checksums` merged (collective; replicas hold equal tensors, the first rank's entry
    stays)."""
    merged: dict[str, dict[str, Any]] = {"checksums": {}, "shapes": {}}
    for sums in gathered(local, None):
        for kind, values in sums.items():
            for key, value in values.items():
                merged[kind].setdefault(key, value)
    return merged


# optimizer state that is per element (shaped like its parameter) in the optimizers ZeRO-1 shards (zero.py)
PER_ELEMENT = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                         "grad_avg", "exp_inf"})


def layout_error(md: Any, info: Mapping[str, Any], path: str, only: str = "") -> str | None:
    """Why the tensors DCP's metadata ``md`` describes do not add up, or None: a tensor whose pieces (offsets,
    sizes) leave part of it out, overlap or reach outside it; a shape other than the manifest's (``info``:
    the manifest) or, for a per-element optimizer state, other than its parameter's; a tensor the manifest
    lists that is missing. ``only``: check the keys starting with it (an export reads ``layers.``)."""
    tensors = {k: m for k, m in md.state_dict_metadata.items() if hasattr(m, "chunks") and k.startswith(only)}
    for key, meta in tensors.items():
        why = _pieces_error(tuple(meta.size), [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks])
        if why:
            return f"checkpoint {path!r} does not add up: {key} of shape {tuple(meta.size)} {why}"
    shapes = info.get("shapes")
    if isinstance(shapes, dict):
        for key, shape in shapes.items():
            if not key.startswith(only):
                continue
            if key not in tensors:
                return f"checkpoint {path!r} does not add up: its manifest lists {key}, which its files do not hold"
            if list(tensors[key].size) != list(shape):
                return (f"checkpoint {path!r} does not add up: {key} was written as {tuple(tensors[key].size)}, but "
                        f"its manifest says {tuple(shape)} (a part written as the whole?)")
    for key, meta in tensors.items():
        owner, _, name = key[len("optim."):].rpartition(".")
        param = tensors.get(owner) if key.startswith("optim.") and name in PER_ELEMENT else None
        if param is not None and tuple(meta.size) != tuple(param.size):
            return (f"checkpoint {path!r} does not add up: {key} is {tuple(meta.size)} but its parameter is "
                    f"{tuple(param.size)} (a part written as the whole?)")
    return None


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _pieces_error(size: tuple[int, ...], pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why ``pieces`` (offsets, sizes) do not cover a tensor of ``size`` exactly once, or None."""
    for offsets, sizes in pieces:
        if len(offsets) != len(size) or any(o < 0 or o + z > d for o, z, d in zip(offsets, sizes, size)):
            return f"has a piece at {list(offsets)} of {list(sizes)} outside it"
    for i, (a_off, a_size) in enumerate(pieces):
        for b_off, b_size in pieces[i + 1:]:
            if all(ao < bo + bz and bo < ao + az for ao, az, bo, bz in zip(a_off, a_size, b_off, b_size)):
                return f"has pieces at {list(a_off)} and {list(b_off)} that overlap"
    covered = sum(_numel(z) for _, z in pieces)
    if covered != _numel(size):
        return f"has pieces covering {covered} of its {_numel(size)} elements (a writer's part is missing)"
    return None


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
