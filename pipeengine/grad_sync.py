"""Gradient synchronisation: bucketed async DP all-reduce, buffer broadcast, global grad norm and clipping."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .faults import Watch

__all__ = ["GradSync", "broadcast_buffers", "grad_sq_norm", "clip_grad_norm"]


class GradSync:
    """Mean of gradients over a stage's DP group, in flat buckets, started asynchronously.

    ``start()`` is called right after the rank's last backward of a step so the all-reduce overlaps
    the other stages' cooldown; ``finish()`` waits and writes the means back into ``param.grad``.
    One all-reduce per bucket (per dtype, up to ``bucket_mb`` MiB), never one per parameter.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int, watcher: Watch,
                 peers: Sequence[int] = (), bucket_mb: float = 25.0) -> None:
        self.group = group
        self.size = size
        self.watch = watcher     # times the waits (faults.py)
        self.peers = list(peers)  # the other ranks of the group (named when a wait times out)
        self.buckets: list[list[nn.Parameter]] = []
        limit = int(bucket_mb * 2**20)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        for ps in by_dtype.values():
            bucket: list[nn.Parameter] = []
            nbytes = 0
            for p in ps:
                if bucket and nbytes + p.numel() * p.element_size() > limit:
                    self.buckets.append(bucket)
                    bucket, nbytes = [], 0
                bucket.append(p)
                nbytes += p.numel() * p.element_size()
            if bucket:
                self.buckets.append(bucket)
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, Any]] = []

    def start(self) -> None:
        if self.size == 1 or self._pending:
            return
        for bucket in self.buckets:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in bucket])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((bucket, flat, work))

    def finish(self) -> None:
        if self.size == 1:
            return
        if not self._pending:
            self.start()
        for bucket, flat, work in self._pending:
            self.watch.wait(work, "the data-parallel gradient all-reduce", self.peers, cuda=flat.is_cuda)
            flat /= self.size
            offset = 0
            for p in bucket:
                n = p.numel()
                view = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n
        self._pending.clear()


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int, group: Any,
                      wait: Callable[[Any], None] | None = None) -> None:
    """Give every DP replica replica ``src``'s buffers (BatchNorm statistics), as DDP does; one flat
    broadcast per dtype (``wait``: how to wait for it, default blocking)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for bs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bs])
            work: Any = dist.broadcast(flat, src=src, group=group, async_op=True)
            wait(work) if wait is not None else work.wait()
            offset = 0
            for b in bs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def grad_sq_norm(params: Sequence[nn.Parameter], skip: set[int] | None = None) -> torch.Tensor:
    """Sum of the squared gradient norms of ``params`` except ``skip`` (ids), float64, on their device.

    Per-tensor norms in the gradients' own dtype (one fused kernel, no float64 copies), combined in
    float64. The engine all-reduces the sums over the pipeline, leaving out tied copies that another
    rank counts (``skip``), so every logical parameter is counted once.
    """
    grads = [p.grad.detach() for p in params if p.grad is not None and id(p) not in (skip or ())]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=next((p.device for p in params), torch.device("cpu")))
    return torch.stack([n.double() for n in torch._foreach_norm(grads)]).pow(2).sum()


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float | None, norm: float) -> None:
    """Scale the gradients so that their global norm ``norm`` becomes at most ``max_norm`` (None: leave them)."""
    if max_norm is not None and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
