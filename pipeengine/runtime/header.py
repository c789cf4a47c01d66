"""The header that starts a forward stream on the wire: the tensors a stage passes on, and each microbatch's shape.

Header: int64 ``[packed, count, (dtype code, ndim, dims...)*]`` padded to ``HEADER_LEN``;
``packed``: the stage returned a tuple (a tuple again on the other side, as in ``nn.Sequential``);
then the step's shape table ``[d, (dims of microbatch k's input)*]`` (``RAGGED_DIMS`` entries each; ``d``
0: every microbatch has one shape), see [Note: ragged microbatches].

[Note: ragged microbatches]
Microbatches of one step may have shapes of their own (documents of different lengths): the
first stage knows every microbatch's input shape before the step starts, and the header it sends
anyway carries them, each stage's header passing the table on. A tensor between stages whose
leading dimensions are the stream's first microbatch's input shape has, for microbatch k, microbatch
k's input shape there instead (``follow``); any other keeps its shape. Both sides derive every
buffer's shape so, the sender checks each output against it: no message and no host read more than
with fixed shapes. Gradients have the shapes of what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .device import constant

__all__ = ["TensorMeta", "Table", "Tensors", "HEADER_LEN", "RAGGED_DIMS", "MAX_TENSORS", "DTYPES", "describe",
           "header_length", "shape_table", "follow", "encode_header", "decode_header", "flatten"]

HEADER_LEN = 64       # the tensors' part; the shape table follows (header_length)
RAGGED_DIMS = 4       # a ragged input has at most this many dimensions
MAX_TENSORS = 15
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def describe(metas: Sequence[TensorMeta]) -> str:
    """``float32[4, 8], int64[4]``: shapes with their dtypes, as error messages show them."""
    return ", ".join(f"{str(m.dtype).replace('torch.', '')}{list(m.shape)}" for m in metas) or "nothing"


Table = tuple[tuple[int, ...], ...]   # each microbatch's input shape (None: one shape for all)


def header_length(microbatches: int) -> int:
    return HEADER_LEN + 1 + RAGGED_DIMS * microbatches


def shape_table(inputs: Sequence[Any]) -> Table | None:
    """Each microbatch's input shape (its first tensor's), or None when they are all one shape (or the inputs hold
    no tensor: a rank that reads only targets)."""
    firsts = [x if isinstance(x, torch.Tensor) else next((t for t in x if isinstance(t, torch.Tensor)), None)
              if isinstance(x, (tuple, list)) else None for x in inputs]
    if any(t is None for t in firsts):
        return None
    shapes = tuple(tuple(t.shape) for t in firsts if t is not None)
    if len(set(shapes)) <= 1:
        return None
    if len({len(s) for s in shapes}) > 1 or len(shapes[0]) > RAGGED_DIMS:
        raise ValueError(f"the microbatches' inputs have shapes {', '.join(str(list(s)) for s in shapes)}: shapes "
                         f"may change between the microbatches of a step only in size, with one number of "
                         f"dimensions (at most {RAGGED_DIMS})")
    return shapes


def follow(metas: Sequence[TensorMeta], table: Table | None, first: int, mb: int) -> tuple[TensorMeta, ...]:
    """The shapes for microbatch ``mb`` of a stream announced for microbatch ``first`` ([Note: ragged microbatches])."""
    if table is None or mb == first:
        return tuple(metas)
    base, mine = table[first], table[mb]
    return tuple(TensorMeta(mine + m.shape[len(base):], m.dtype) if m.shape[:len(base)] == base else m
                 for m in metas)


def encode_header(packed: bool, metas: Sequence[TensorMeta], device: torch.device | None = None,
                  table: Table | None = None, microbatches: int = 0) -> torch.Tensor:
    """The fixed-size int64 header announcing a stream's tensors (and the step's shape table)."""
    if len(metas) > MAX_TENSORS:
        raise ValueError(f"a stage may pass at most {MAX_TENSORS} tensors to the next one (got {len(metas)}); "
                         f"pack them into fewer tensors")
    out = [int(packed), len(metas)]
    for m in metas:
        if m.dtype not in DTYPES:
            raise TypeError(f"cannot send dtype {m.dtype} between stages; supported: "
                            f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)}")
        out += [DTYPES.index(m.dtype), len(m.shape), *m.shape]
    if len(out) > HEADER_LEN:
        raise ValueError(f"the shapes {describe(metas)} need a {len(out)}-entry header, more than "
                         f"{HEADER_LEN}; pass fewer or lower-rank tensors between stages")
    out += [0] * (HEADER_LEN - len(out))
    tdim = len(table[0]) if table else 0
    out += [tdim, *(d for s in (table or ()) for d in s + (0,) * (RAGGED_DIMS - tdim))]
    assert len(out) <= header_length(microbatches), "a shape table longer than the step's microbatches"
    out += [0] * (header_length(microbatches) - len(out))
    return constant(out, torch.int64, device or torch.device("cpu"))


def decode_header(values: Sequence[int]) -> tuple[bool, tuple[TensorMeta, ...], Table | None]:
    """What a header announces (``values``: the received header tensor's values): packed, metas, shape table."""
    h = [int(x) for x in values]
    tdim = h[HEADER_LEN] if len(h) > HEADER_LEN else 0
    if not 0 <= tdim <= RAGGED_DIMS:
        raise ValueError(f"corrupt header: a shape table of {tdim} dimensions")
    table = tuple(tuple(h[i:i + tdim]) for i in range(HEADER_LEN + 1, len(h), RAGGED_DIMS)) if tdim else None
    if h[0] not in (0, 1) or not 0 <= h[1] <= MAX_TENSORS:
        raise ValueError(f"corrupt header {h[:4]}...: the peer sent something else (schedules out of order?)")
    metas, i = [], 2
    for _ in range(h[1]):
        code, ndim = h[i], h[i + 1]
        if not 0 <= code < len(DTYPES) or ndim < 0 or i + 2 + ndim > HEADER_LEN:
            raise ValueError(f"corrupt header entry at {i}: {h[i:i + 2]}")
        metas.append(TensorMeta(tuple(h[i + 2:i + 2 + ndim]), DTYPES[code]))
        i += 2 + ndim
    return bool(h[0]), tuple(metas), table


def flatten(value: Any) -> tuple[bool, Tensors]:
    """(packed, tensors) of what a stage returned: a Tensor, or a tuple/list of Tensors."""
    if isinstance(value, torch.Tensor):
        return False, (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return True, tuple(value)
    inner = [type(t).__name__ for t in value] if isinstance(value, (tuple, list)) else ""
    raise TypeError(f"a stage may pass on only a Tensor or a tuple of Tensors, got {type(value).__name__}{inner}")
