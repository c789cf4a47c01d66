"""Gradient synchronisation: bucketed async DP all-reduce, tied-weight sums, global grad norm."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradSync", "sync_tied", "broadcast_buffers", "clip_grad_norm"]


class GradSync:
    """Mean of gradients over a stage's DP group, in flat buckets, started asynchronously.

    ``start()`` is called right after the rank's last backward of a step so the all-reduce overlaps
    the other stages' cooldown; ``finish()`` waits and writes the means back into ``param.grad``.
    One all-reduce per bucket (per dtype, up to ``bucket_mb`` MiB), never one per parameter.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int,
                 bucket_mb: float = 25.0, timeout: float = 300.0) -> None:
        self.group = group
        self.size = size
        self.timeout = timeout
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
            try:   # on CUDA the stream waits, not the host; NCCL's watchdog enforces the group's timeout
                work.wait() if flat.is_cuda else work.wait(timeout=timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                raise TimeoutError(f"data-parallel gradient all-reduce did not finish within {self.timeout:.0f} s "
                                   f"(a replica of this stage is stuck or died): {exc}") from exc
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


def sync_tied(param: nn.Parameter, group: Any) -> None:
    """Sum the gradients of one logical parameter held as copies on the ranks of ``group``.

    Every copy then holds the full gradient, so identical optimizer steps keep the copies
    bit-identical.
    """
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    dist.all_reduce(param.grad, group=group)


def broadcast_buffers(buffers: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Give every DP replica replica ``src``'s buffers (BatchNorm statistics), as DDP does; one flat
    broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for bs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bs])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for b in bs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float | None, group: Any,
                   skip: set[int] | None = None, carry: float = 0.0) -> tuple[float, float]:
    """Global L2 norm of all gradients of the pipeline, and clip them to ``max_norm`` (if given).

    Each rank sums the squares of its own parameters' gradients, excluding ``skip`` (ids of
    tied copies that another rank counts), so every logical parameter is counted exactly once;
    the sums are all-reduced over the pipeline ``group``. DP replicas hold equal gradients after
    the DP all-reduce, so the norm is the same on every rank. ``carry`` rides along in the same
    all-reduce (the engine sends the step's loss this way: one collective at the end of a step
    instead of two); returns ``(norm, sum of carry over the group)``.
    """
    skip = skip or set()
    device = next((p.device for p in params), torch.device("cpu"))
    total = torch.zeros(2, dtype=torch.float64, device=device)
    grads = [p.grad.detach() for p in params if p.grad is not None and id(p) not in skip]
    if grads:
        # per-tensor norms in the gradients' own dtype (one fused kernel, no float64 copies),
        # combined in float64
        norms = torch._foreach_norm(grads)
        total[0] = torch.stack([n.double() for n in norms]).pow(2).sum()
    total[1] = carry
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    norm = math.sqrt(float(total[0]))
    if max_norm is not None and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm, float(total[1])
