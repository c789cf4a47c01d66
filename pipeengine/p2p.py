"""Paired point-to-point transfers between stages: batched isend/irecv, shape headers, tags, timeouts.

[Note: header handshake]
A receiver must allocate buffers before it can post a receive, so the first transfer of a stream
carries a header: a fixed-size int64 tensor ``[count, (dtype code, requires_grad, ndim, dims...)*]``
(no pickled objects on the wire). ``post()`` runs two phases: all header ops of the batch in one
``batch_isend_irecv`` (waited, so the shapes are known), then all payload ops in a second one (not
waited: the caller waits for a receive right before its consumer). Both ends run both phases for
their paired batches, so the per-peer op order is the same on both sides.

[Note: tags]
Gloo matches messages by (peer, tag); NCCL ignores tags and matches by per-peer order, which the
schedule's paired order guarantees. Each transfer carries the caller's tag ``t`` (``0 <= t < 2**24``):
the header uses ``16 t``, tensor ``i`` of a tuple ``16 t + 1 + i`` (so at most 15 tensors). On Gloo a
receive posted out of order therefore waits (and times out, naming itself) instead of silently
taking another transfer's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["P2PTimeout", "TensorMeta", "SendOp", "RecvOp", "PendingRecv", "PendingBatch", "P2P",
           "encode_header", "decode_header", "HEADER_LEN", "MAX_TAG"]

HEADER_LEN = 64
MAX_TAG = 2**24
MAX_TENSORS = 15
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class P2PTimeout(RuntimeError):
    """A transfer did not complete in time; the message names the op, the peer and the wait."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad))


@dataclass(frozen=True)
class SendOp:
    peer: int                              # global rank
    tag: int
    tensors: tuple[torch.Tensor, ...]
    header: bool
    label: str


@dataclass(frozen=True)
class RecvOp:
    peer: int                              # global rank
    tag: int
    metas: tuple[TensorMeta, ...] | None   # None: learn them from the header (header must be True)
    header: bool
    label: str


def encode_header(metas: Sequence[TensorMeta], device: torch.device | None = None) -> torch.Tensor:
    """The fixed-size int64 header describing ``metas``."""
    if len(metas) > MAX_TENSORS:
        raise ValueError(f"a stage may pass at most {MAX_TENSORS} tensors to the next one (got {len(metas)}); "
                         f"pack them into fewer tensors")
    out = [len(metas)]
    for m in metas:
        if m.dtype not in DTYPES:
            raise TypeError(f"cannot send dtype {m.dtype} between stages; supported: "
                            f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)}")
        out += [DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(out) > HEADER_LEN:
        raise ValueError(f"the shapes {[m.shape for m in metas]} need a {len(out)}-entry header, more than "
                         f"{HEADER_LEN}; pass fewer or lower-rank tensors between stages")
    return torch.tensor(out + [0] * (HEADER_LEN - len(out)), dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[TensorMeta, ...]:
    h = [int(x) for x in header.tolist()]
    if not 0 <= h[0] <= MAX_TENSORS:
        raise ValueError(f"corrupt header: {h[0]} tensors")
    metas, i = [], 1
    for _ in range(h[0]):
        code, grad, ndim = h[i], h[i + 1], h[i + 2]
        if not 0 <= code < len(DTYPES) or ndim < 0 or i + 3 + ndim > HEADER_LEN:
            raise ValueError(f"corrupt header entry at {i}: {h[i:i + 3]}")
        metas.append(TensorMeta(tuple(h[i + 3:i + 3 + ndim]), DTYPES[code], bool(grad)))
        i += 3 + ndim
    return tuple(metas)


def _wait(works: Sequence[Any], timeout: float, label: str, peer: int) -> None:
    for w in works:
        try:
            ok = w.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise P2PTimeout(f"{label}: no completion after {timeout:g} s with peer rank {peer} "
                             f"(the peer probably did not post the matching op: schedules out of order, "
                             f"or the peer failed): {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
        if ok is False:
            raise P2PTimeout(f"{label}: no completion after {timeout:g} s with peer rank {peer}")


def _per_op(works: list[Any], n: int) -> list[list[Any]]:
    """Gloo returns one work per op; NCCL's coalesced batch returns one work for them all."""
    if len(works) == n:
        return [[w] for w in works]
    return [works] * n


class PendingRecv:
    """A posted receive: ``metas`` are known at once, ``wait()`` returns the tensors."""

    def __init__(self, op: RecvOp, metas: tuple[TensorMeta, ...], buffers: tuple[torch.Tensor, ...],
                 timeout: float) -> None:
        self.op = op
        self.metas = metas
        self.buffers = buffers
        self.works: list[Any] = []
        self.timeout = timeout
        self._done = False

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until every tensor arrived (P2PTimeout names the op); may be called again."""
        if not self._done:
            _wait(self.works, self.timeout, self.op.label, self.op.peer)
            self._done = True
        return self.buffers


class PendingBatch:
    """A posted batch: its receives in op order, and its sends (kept alive until ``wait_sends``)."""

    def __init__(self, recvs: list[PendingRecv], sends: list[tuple[SendOp, list[Any]]], timeout: float,
                 keep: Any = None) -> None:
        self.recvs = recvs
        self._sends = sends
        self.timeout = timeout
        self._keep = keep   # the contiguous send buffers: alive until the sends completed

    def wait_sends(self) -> None:
        for op, works in self._sends:
            _wait(works, self.timeout, op.label, op.peer)
        self._sends = []
        self._keep = None


class P2P:
    """Posts batches of sends/receives between global ranks on ``device`` (CUDA for NCCL, CPU for Gloo)."""

    def __init__(self, device: torch.device, timeout: float = 300.0, group: Any = None) -> None:
        self.device = device
        self.timeout = timeout
        self.group = group

    def _check(self, op: SendOp | RecvOp) -> None:
        if not 0 <= op.tag < MAX_TAG:
            raise ValueError(f"{op.label}: tag {op.tag} is outside 0..{MAX_TAG - 1}")
        if isinstance(op, RecvOp) and (op.metas is None) != op.header:
            raise ValueError(f"{op.label}: a receive needs either a header or known metas, not both/neither")

    def post(self, ops: Sequence[SendOp | RecvOp]) -> PendingBatch:
        if not ops:
            return PendingBatch([], [], self.timeout)
        for op in ops:
            self._check(op)
        sends = [op for op in ops if isinstance(op, SendOp)]
        tensors = {id(op): tuple(t.detach().to(self.device).contiguous() for t in op.tensors) for op in sends}
        # phase 1: headers
        hdr_ops: list[dist.P2POp] = []
        hdr_meta: list[tuple[SendOp | RecvOp, torch.Tensor]] = []
        for op in ops:
            if not op.header:
                continue
            if isinstance(op, SendOp):
                buf = encode_header([TensorMeta.of(t) for t in op.tensors], self.device)
                hdr_ops.append(dist.P2POp(dist.isend, buf, op.peer, self.group, op.tag * 16))
            else:
                buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
                hdr_ops.append(dist.P2POp(dist.irecv, buf, op.peer, self.group, op.tag * 16))
            hdr_meta.append((op, buf))
        learned: dict[int, tuple[TensorMeta, ...]] = {}
        if hdr_ops:
            works = _per_op(list(dist.batch_isend_irecv(hdr_ops)), len(hdr_ops))
            for (op, buf), w in zip(hdr_meta, works):
                _wait(w, self.timeout, f"{op.label} (shape header)", op.peer)
                if isinstance(op, RecvOp):
                    learned[id(op)] = decode_header(buf)
        # phase 2: payloads
        pay_ops: list[dist.P2POp] = []
        owners: list[SendOp | PendingRecv] = []
        recvs: list[PendingRecv] = []
        for op in ops:
            if isinstance(op, SendOp):
                for i, t in enumerate(tensors[id(op)]):
                    pay_ops.append(dist.P2POp(dist.isend, t, op.peer, self.group, op.tag * 16 + 1 + i))
                    owners.append(op)
            else:
                metas = learned[id(op)] if op.header else op.metas
                assert metas is not None
                bufs = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
                pending = PendingRecv(op, metas, bufs, self.timeout)
                recvs.append(pending)
                for i, b in enumerate(bufs):
                    pay_ops.append(dist.P2POp(dist.irecv, b, op.peer, self.group, op.tag * 16 + 1 + i))
                    owners.append(pending)
        send_works: dict[int, tuple[SendOp, list[Any]]] = {id(op): (op, []) for op in sends}
        if pay_ops:
            works = _per_op(list(dist.batch_isend_irecv(pay_ops)), len(pay_ops))
            for owner, w in zip(owners, works):
                if isinstance(owner, PendingRecv):
                    owner.works.extend(w)
                else:
                    send_works[id(owner)][1].extend(w)
        for pending in recvs:
            if not pending.buffers:
                pending._done = True
        return PendingBatch(recvs, list(send_works.values()), self.timeout, keep=tensors)
