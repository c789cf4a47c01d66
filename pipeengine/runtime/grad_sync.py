"""Gradient synchronisation: bucketed async DP all-reduce, buffer broadcast, clipping to the global norm."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule import Action, Step
from .faults import Watch

__all__ = ["GradSync", "final_gradients", "broadcast_buffers", "clip_grad_norm"]


class GradSync:
    """Sum of gradients over a stage's DP group, in flat buckets that start while backward still runs (each
    microbatch's loss is already divided by the step's microbatches over every replica: the sum is the mean
    over the global batch, also when replicas take uneven shares, [Note: uneven replicas] in update.py).

    [Note: gradient all-reduce inside backward]
    The gradients live in one contiguous buffer per bucket: ``prepare()`` (each train step, instead
    of ``zero_grad``) zeroes the buffers and makes every ``param.grad`` a view of its bucket, so
    autograd accumulates in place and nothing is copied. Buckets hold parameters in reverse order
    (backward produces the last layers' gradients first), per dtype, up to ``bucket_mb`` MiB.
    The engine ``arm()``s a parameter just before the backward that accumulates its last gradient
    of the step (its stage's last B, or W when backward is split). Its post-accumulate-grad hook
    then counts it; a bucket whose parameters are all final is all-reduced at once,
    asynchronously, always in bucket order (every replica posts the same collectives in the same
    order, as NCCL requires). ``start()`` after the rank's last backward posts the buckets still
    waiting (parameters that got no gradient), ``finish()`` waits for them. The
    values are those of an all-reduce at the end of the step, bit for bit: only the time changes.
    ``overlap=False`` posts every bucket in ``start()``.

    The engine overlaps on CUDA only: on CPU with Gloo, where the ranks' compute already takes every
    core, it gained nothing when measured (benchmarks/README.md, "Gradient all-reduce inside backward
    on CPU").

    [Note: a parameter without a gradient]
    Each bucket ends in one flag per parameter, set by its post-accumulate-grad hook and summed by
    the same all-reduce: a parameter that got no gradient on any replica (a conditionally used
    expert, an unused head) gets ``grad = None`` after the sync, as ``zero_grad(set_to_none=True)``
    leaves it without DP, so the optimizer skips it (no weight decay, no moment update) at every dp.

    ``shard`` (ZeRO-1, zero.py): this replica's index in the group. Every bucket is then padded to a
    multiple of ``size`` and split into ``size`` equal shards; a bucket is reduce-scattered
    (``reduce_scatter_single`` into this replica's shard of it, in place) instead of all-reduced, except
    the buckets of ``whole`` parameters (tied copies, summed over their tie afterwards), which are
    all-reduced. The flags then sit in ``got`` (one per parameter, in bucket order), summed by the
    sharded optimizer's own small all-reduce (zero.py).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int, watcher: Watch,
                 peers: Sequence[int] = (), bucket_mb: float = 25.0, overlap: bool = True, shard: int | None = None,
                 whole: frozenset[int] = frozenset()) -> None:
        self.group = group
        self.size = size
        self.watch = watcher     # times the waits (faults.py)
        self.peers = list(peers)  # the other ranks of the group (named when a wait times out)
        self.overlap = overlap
        self.buckets: list[list[nn.Parameter]] = []
        self.flats: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._where: dict[int, int] = {}            # id(param) -> bucket
        self._flag: dict[int, torch.Tensor] = {}    # id(param) -> its "got a gradient" flag in its bucket
        self._flags: list[torch.Tensor] = []        # per bucket: the flags of its parameters
        self._armed: set[int] = set()
        self._left: list[int] = []                  # per bucket: parameters not final yet
        self._works: list[Any] = []                 # posted all-reduces, in bucket order
        self.posted_early = 0                       # last step: buckets posted from inside backward
        self.shard = shard
        self.whole: list[bool] = []                 # per bucket: all-reduced (not reduce-scattered) under sharding
        self.sizes: list[int] = []                  # per bucket: elements per shard (sharding)
        self.got = torch.zeros(0)                   # sharding: per parameter, in bucket order, got a gradient
        assert shard is None or size > 1, "sharding over one replica"
        if size == 1:
            return
        self._fill_buckets(params, int(bucket_mb * 2**20), whole)
        if shard is not None:
            self.got = torch.zeros(sum(map(len, self.buckets)), device=self.buckets[0][0].device if self.buckets
                                   else None)
        slot = 0
        for k, bucket in enumerate(self.buckets):
            numel = sum(p.numel() for p in bucket)
            self.sizes.append(-(-numel // size))
            extra = len(bucket) if shard is None else self.sizes[-1] * size - numel   # flags, or padding
            flat = torch.zeros(numel + extra, dtype=bucket[0].dtype, device=bucket[0].device)
            views, offset = [], 0
            for j, p in enumerate(bucket):
                views.append(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
                self._where[id(p)] = k
                flags = flat[numel:] if shard is None else self.got[slot:]   # [Note: a parameter without a gradient]
                self._flag[id(p)] = flags[j:j + 1]
                p.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]
            self.flats.append(flat)
            self._flags.append(flat[numel:] if shard is None else flat[:0])
            self._views.append(views)
            slot += len(bucket)

    def _fill_buckets(self, params: Sequence[nn.Parameter], limit: int, whole: frozenset[int]) -> None:
        """Parameters that train, last first, into buckets of up to ``limit`` bytes of one dtype (and apart:
        the ``whole`` ones)."""
        by_key: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
        for p in reversed(list(params)):
            if p.requires_grad:
                by_key.setdefault((p.dtype, id(p) in whole), []).append(p)
        for (_, is_whole), ps in by_key.items():
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
            self.whole += [is_whole] * (len(self.buckets) - len(self.whole))

    def flag_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """Parameter ``p``'s "got a gradient" flag (None: not in a bucket); see [Note: a parameter without a
        gradient]."""
        return self._flag.get(id(p))

    def shard_of(self, k: int) -> torch.Tensor:
        """This replica's shard of bucket ``k``'s gradients (sharding)."""
        assert self.shard is not None
        return self.flats[k][self.shard * self.sizes[k]:(self.shard + 1) * self.sizes[k]]

    def prepare(self) -> bool:
        """Zero the buckets and point every ``param.grad`` into them; False (do ``zero_grad``) without DP."""
        if not self.flats:
            return False
        for flat in self.flats:
            flat.zero_()
        self.got.zero_()
        for bucket, views in zip(self.buckets, self._views):
            for p, view in zip(bucket, views):
                p.grad = view
        self._left = [len(b) for b in self.buckets]
        self._works = []
        self._armed.clear()
        self.posted_early = 0
        return True

    def arm(self, params: Sequence[nn.Parameter]) -> None:
        """The next backward gives these parameters their last gradient of the step."""
        if self.overlap and self.size > 1:
            self._armed.update(id(p) for p in params)

    def _accumulated(self, p: torch.Tensor) -> None:
        self._flag[id(p)].fill_(1)
        if self.overlap and id(p) in self._armed:
            self._final(p)

    def _final(self, p: torch.Tensor) -> None:
        self._armed.discard(id(p))
        self._left[self._where[id(p)]] -= 1
        while len(self._works) < len(self.buckets) and self._left[len(self._works)] == 0:
            self._post()
            self.posted_early += 1

    def _post(self) -> None:
        k = len(self._works)
        for p, view in zip(self.buckets[k], self._views[k]):
            if p.grad is not view:   # replaced behind our back (e.g. set to None): take its value
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        if self.shard is None or self.whole[k]:
            self._works.append(dist.all_reduce(self.flats[k], group=self.group, async_op=True))
        else:   # in place: this replica's shard of the flat receives the sum of everyone's
            self._works.append(dist.reduce_scatter_single(self.shard_of(k), self.flats[k], group=self.group,
                                                          async_op=True))

    def start(self) -> None:
        """Post every bucket not posted yet (called after the rank's last backward of the step)."""
        while len(self._works) < len(self.buckets):
            self._post()

    def finish(self) -> None:
        if not self.flats:
            return
        self.start()
        for k, (flat, work) in enumerate(zip(self.flats, self._works)):
            self.watch.wait(work, "the data-parallel gradient all-reduce", self.peers, cuda=flat.is_cuda)
        self._works = []
        self._armed.clear()

    def untouched(self) -> torch.Tensor | None:
        """Per parameter (bucket order), whether no replica gave it a gradient, on the device: the host reads it with
        the step's signals (consensus.py), then :meth:`drop_untouched`. None under sharding (zero.py has its own)."""
        if self.shard is not None or not self.flats:
            return None
        return torch.cat(self._flags) == 0

    def drop_untouched(self, untouched: Sequence[float]) -> None:
        """Parameters no replica gave a gradient have none, as zero_grad leaves them without DP (tied copies have
        their tie's sum: ties.py)."""
        for (p, whole), none in zip(((p, w) for bucket, w in zip(self.buckets, self.whole) for p in bucket),
                                    untouched):
            if none and not whole:
                p.grad = None


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


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float | None, norm: float) -> None:
    """Scale the gradients so that their global norm ``norm`` becomes at most ``max_norm`` (None: leave them): one
    foreach call (a fused kernel per dtype on CUDA), not one per parameter."""
    if max_norm is None or norm <= max_norm:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


def final_gradients(program: Sequence[Step], chunk_params: Sequence[Sequence[nn.Parameter]],
                    ends_backward: Callable[[Action], bool]) -> dict[int, list[nn.Parameter]]:
    """Program index -> the parameters whose last gradient of the step that action accumulates: the
    stage's last action that ends a backward (``ends_backward``: a W, or a full B, see
    ``Schedule.releases``); a parameter shared by stages, the later one."""
    last = {st[0].chunk: i for i, st in enumerate(program) if ends_backward(st[0])}
    final: dict[int, tuple[int, nn.Parameter]] = {}   # id(param) -> (program index, param)
    for c, params in enumerate(chunk_params):
        for p in params:
            if c in last and last[c] > final.get(id(p), (-1, p))[0]:
                final[id(p)] = (last[c], p)
    at: dict[int, list[nn.Parameter]] = {}
    for index, p in final.values():
        at.setdefault(index, []).append(p)
    return at
