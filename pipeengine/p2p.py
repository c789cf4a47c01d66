"""Paired point-to-point transfers between stages: batched isend/irecv, shape headers, tags, timeouts.

[Note: header handshake]
A receiver must allocate buffers before it can post a receive, so the first transfer of a stream
carries a header: a fixed-size int64 tensor ``[count, (dtype code, requires_grad, ndim, dims...)*]``
(no pickled objects on the wire). A send posts its header and payload together. A receive that
needs a header posts only the header receive; its payload receive is posted when its shapes are
first needed (``PendingRecv.metas`` / ``wait()``). Nothing in ``post()`` blocks, so every op stays
atomic as in the schedule simulator: blocking a whole batch on its headers would make one op's
payload wait for another op's header, a dependency the schedule never had (it deadlocked
forward-only interleaved schedules). Backends that match by per-peer order (NCCL) resolve a
deferred receive before any later receive from the same peer is posted, so both sides keep the
same per-peer sequence.

[Note: tags]
Gloo matches messages by (peer, tag); NCCL ignores tags and matches by per-peer order, which the
schedule's paired order guarantees. Each transfer carries the caller's tag ``t`` (``0 <= t < 2**24``):
the header uses ``16 t``, tensor ``i`` of a tuple ``16 t + 1 + i`` (so at most 15 tensors). On Gloo a
receive posted out of order therefore waits (and times out, naming itself) instead of silently
taking another transfer's data.

[Note: posting a batch]
A batch's sends are posted before its receives (the order among sends, and among receives, is
kept, so is each direction's per-peer order). Where order matters (``ordered``: NCCL) the batch
is one coalesced ``batch_isend_irecv``; on Gloo every op is independent and is started directly
on the process group, which is cheaper per op.
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
    """A posted receive: ``metas`` (waits for the header if there is one), ``wait()`` returns the tensors."""

    def __init__(self, op: RecvOp, post_payload: Any, timeout: float) -> None:
        self.op = op
        self.timeout = timeout
        self._post_payload = post_payload      # callable(PendingRecv) posting the payload irecvs
        self._metas: tuple[TensorMeta, ...] | None = op.metas
        self.header_buf: torch.Tensor | None = None
        self.header_works: list[Any] = []
        self.buffers: tuple[torch.Tensor, ...] | None = None
        self.works: list[Any] = []
        self._done = False

    @property
    def metas(self) -> tuple[TensorMeta, ...]:
        """Shapes and dtypes; waits for the header (and then posts the payload receive) if needed."""
        if self._metas is None:
            assert self.header_buf is not None
            _wait(self.header_works, self.timeout, f"{self.op.label} (shape header)", self.op.peer)
            self._metas = decode_header(self.header_buf)
        if self.buffers is None:
            self._post_payload(self)
        return self._metas

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until every tensor arrived (P2PTimeout names the op); may be called again."""
        self.metas  # noqa: B018  (posts the payload receive if the header just arrived)
        assert self.buffers is not None
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

    def __init__(self, device: torch.device, timeout: float = 300.0, group: Any = None,
                 ordered: bool | None = None) -> None:
        self.device = device
        self.timeout = timeout
        self.group = group
        # Gloo matches by tag; NCCL (and anything else) by per-peer order
        if ordered is None:
            ordered = not (dist.is_initialized() and dist.get_backend(group) == "gloo")
        self.ordered = ordered
        self._deferred: list[PendingRecv] = []
        self._group_rank: dict[int, int] = {}   # global peer -> its rank in the group

    def _check(self, op: SendOp | RecvOp) -> None:
        if not 0 <= op.tag < MAX_TAG:
            raise ValueError(f"{op.label}: tag {op.tag} is outside 0..{MAX_TAG - 1}")
        if isinstance(op, RecvOp) and (op.metas is None) != op.header:
            raise ValueError(f"{op.label}: a receive needs either a header or known metas, not both/neither")

    def _post_payload(self, pending: PendingRecv) -> None:
        metas = pending._metas
        assert metas is not None
        bufs = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
        pending.buffers = bufs
        if pending in self._deferred:
            self._deferred.remove(pending)
        if bufs:
            pending.works = self._issue([(False, b, pending.op.peer, pending.op.tag * 16 + 1 + i)
                                         for i, b in enumerate(bufs)])
        else:
            pending._done = True

    def _issue(self, ops: list[tuple[bool, torch.Tensor, int, int]]) -> list[Any]:
        """Start ``ops`` given as (is_send, tensor, global peer, wire tag); one work per op, or one for all.

        Where order matters (NCCL) they go out as one coalesced ``batch_isend_irecv``. Gloo matches
        by tag and runs every op on its own, so there each op is started directly on the process
        group, skipping ``P2POp`` and the coalescing manager: that posts one send in about a third
        less time than ``batch_isend_irecv`` on the 2-core test machine (``benchmarks/overhead.py``).
        """
        if self.ordered:
            return list(dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer, self.group,
                                                           tag) for send, t, peer, tag in ops]))
        pg: Any = self.group if self.group is not None else dist.group.WORLD
        works = []
        for send, t, peer, tag in ops:
            if peer not in self._group_rank:
                self._group_rank[peer] = dist.get_group_rank(pg, peer)
            works.append((pg.send if send else pg.recv)([t], self._group_rank[peer], tag))
        return works

    def post(self, ops: Sequence[SendOp | RecvOp]) -> PendingBatch:
        """Post every op of a batch without blocking (see [Note: header handshake]).

        Sends go first, so a peer waiting on this rank's output gets it before this rank spends
        time posting its receives; the order among sends and among receives is kept, and with it
        the per-peer order of each direction that NCCL matches by.
        """
        for op in ops:
            self._check(op)
        sends = [op for op in ops if isinstance(op, SendOp)]
        ops = [*sends, *(op for op in ops if isinstance(op, RecvOp))]
        tensors = {id(op): tuple(t.detach().to(self.device).contiguous() for t in op.tensors) for op in sends}
        recvs: list[PendingRecv] = []
        send_works: list[tuple[SendOp, list[Any]]] = []
        p2p_ops: list[tuple[bool, torch.Tensor, int, int]] = []
        owners: list[PendingRecv | tuple[SendOp, list[Any]] | tuple[PendingRecv, str]] = []

        def flush() -> None:
            if p2p_ops:
                works = _per_op(self._issue(p2p_ops), len(p2p_ops))
                for owner, w in zip(owners, works):
                    if isinstance(owner, PendingRecv):
                        owner.works.extend(w)
                    elif isinstance(owner[0], SendOp):
                        owner[1].extend(w)
                    else:
                        owner[0].header_works.extend(w)
            p2p_ops.clear()
            owners.clear()

        for i, op in enumerate(ops):
            if self.ordered:   # keep the per-peer receive order: resolve deferred receives from this peer
                for pending in [d for d in self._deferred if d.op.peer == op.peer and isinstance(op, RecvOp)]:
                    flush()
                    pending.metas  # noqa: B018
            if isinstance(op, SendOp):
                entry: tuple[SendOp, list[Any]] = (op, [])
                send_works.append(entry)
                if op.header:
                    hdr = encode_header([TensorMeta.of(t) for t in op.tensors], self.device)
                    tensors[id(op)] = tensors[id(op)] + (hdr,)   # keep the header alive too
                    p2p_ops.append((True, hdr, op.peer, op.tag * 16))
                    owners.append(entry)
                for j, t in enumerate(tensors[id(op)][:len(op.tensors)]):
                    p2p_ops.append((True, t, op.peer, op.tag * 16 + 1 + j))
                    owners.append(entry)
                continue
            pending = PendingRecv(op, self._post_payload, self.timeout)
            recvs.append(pending)
            if op.header:
                pending.header_buf = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
                p2p_ops.append((False, pending.header_buf, op.peer, op.tag * 16))
                owners.append((pending, "header"))
                self._deferred.append(pending)
                if self.ordered and any(isinstance(o, RecvOp) and o.peer == op.peer for o in ops[i + 1:]):
                    flush()
                    pending.metas  # noqa: B018
                continue
            assert op.metas is not None
            pending.buffers = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in op.metas)
            for j, b in enumerate(pending.buffers):
                p2p_ops.append((False, b, op.peer, op.tag * 16 + 1 + j))
                owners.append(pending)
            if not pending.buffers:
                pending._done = True
        flush()
        return PendingBatch(recvs, send_works, self.timeout, keep=tensors)
