"""ZeRO-1: each stage's optimizer state sharded over its data-parallel group (``shard_optimizer=True``, ``--zero 1``).

[Note: sharded optimizer state]
Without sharding every replica of a stage holds the whole optimizer state (AdamW: 8 bytes per fp32
parameter, on top of 4 for the weight and 4 for its gradient). With it, the gradient buckets
(grad_sync.py) are padded to a multiple of dp and cut into dp equal shards, and the parameters get
one flat buffer per bucket laid out like its gradients (every ``param.data`` a view into it).
Replica r owns shard r of every bucket. A step then goes:

    backward     each bucket is reduce-scattered (``reduce_scatter_single``, in place): replica r gets
                 the sum of shard r; the buckets of tied copies are all-reduced, then summed over
                 their tie as without sharding
    norm         per parameter, the squared norm of its part of this replica's shards, summed over
                 the group (one small all-reduce); then the end-of-step all-reduce as ever
    step         the optimizer steps one flat shard parameter per bucket (a view of the parameter
                 buffer: no copy), holding state for 1/dp of the stage's elements
    all-gather   every bucket's shards, gathered in place (``all_gather_single``), the first layers'
                 buckets first; on CPU waited for at once, on CUDA by each stage just before its first
                 F of the next step (or before a state read): it overlaps the data loading, and the
                 earlier stages' forwards with the later stages' gathers

It is exact for optimizers that update every element on its own (SGD, Adam, AdamW, Adamax,
Adagrad, RMSprop, NAdam, RAdam): a flat shard steps bitwise as the parameters it covers, and with
dp 2 the reduce-scatter adds the same two numbers as the all-reduce did. The gradient norm is
summed from per-shard parts (round-off apart from the unsharded norm: clipping then differs in
the last bits). Two differences from the unsharded engine, as in Megatron's and DeepSpeed's
distributed optimizers: a parameter that got no gradient on any replica steps with a zero gradient
(weight decay and moments move), and each shard has one step count.

torch's ``ZeroRedundancyOptimizer`` assigns whole parameters to ranks and broadcasts them, after a
full all-reduce of the gradients (DDP's): it cannot use the buckets' reduce-scatter, and its
``consolidate_state_dict`` gathers the whole state on one rank to save. Here a checkpoint keeps its
global keys (state.py): each replica writes its parts of a parameter's state as DCP shards with
global offsets (``CheckpointableTensor``: at most 2 x ndim - 1 boxes of the parameter's shape per
part), so a state saved at any dp, sharded or not, loads at any other.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .grad_sync import GradSync

__all__ = ["ShardedOptimizer", "ELEMENTWISE", "check_elementwise", "boxes", "Segment"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam)

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, sizes)
SCALARS = frozenset({"step", "mu_product"})   # the optimizers above: per-parameter scalars; the rest per element


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` updates every element on its own (what a flat shard needs)."""
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(f"shard_optimizer (--zero 1) steps flat slices of the parameters, exact only for optimizers "
                         f"that update every element on its own ({names}); {type(optimizer).__name__} is not one "
                         f"of them: use shard_optimizer=False (--zero 0)")


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangular boxes of a tensor of ``shape`` that hold its flattened elements ``start .. stop - 1``."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        return [((first, *o), (1, *z)) for o, z in boxes(shape[1:], start - first * row, stop - first * row)]
    out: list[Box] = []
    if start % row:
        out += [((first, *o), (1, *z)) for o, z in boxes(shape[1:], start % row, row)]
    lo, hi = -(-start // row), stop // row   # whole rows
    if hi > lo:
        out.append(((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:])))
    if stop % row:
        out += [((last, *o), (1, *z)) for o, z in boxes(shape[1:], 0, stop - last * row)]
    return out


@dataclass(frozen=True)
class Segment:
    """Parameter ``param``'s flattened elements ``start .. stop - 1`` sit at ``at`` in this replica's shard."""

    param: nn.Parameter
    start: int
    stop: int
    at: int

    def piece(self, shard: torch.Tensor) -> torch.Tensor:
        return shard[self.at:self.at + self.stop - self.start]

    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.param.numel()

    def block(self, like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """A tensor that DCP reads or writes as this segment's boxes of a tensor of ``shape``
        (torch.distributed.checkpoint's ``CheckpointableTensor`` protocol): the rows it touches, filled
        from ``like`` (this segment's elements, or an empty tensor to load into)."""
        if self.whole():
            return like.reshape(shape)
        row = math.prod(shape[1:])
        first = self.start // row
        rows = (self.stop - 1) // row - first + 1
        block = torch.zeros((rows, *shape[1:]), dtype=like.dtype, device=like.device)
        block.view(-1)[self.start - first * row:self.stop - first * row] = like
        local = boxes((rows, *shape[1:]), self.start - first * row, self.stop - first * row)
        block.global_shape = tuple(shape)   # type: ignore[attr-defined]
        block.global_offsets = tuple((o[0] + first, *o[1:]) for o, _ in local)   # type: ignore[attr-defined]
        block.local_offsets = tuple(o for o, _ in local)   # type: ignore[attr-defined]
        block.local_sizes = tuple(z for _, z in local)   # type: ignore[attr-defined]
        return block

    def elements(self, block: torch.Tensor) -> torch.Tensor:
        """This segment's elements of a :meth:`block` (after a load)."""
        if self.whole():
            return block.reshape(-1)
        row = math.prod(block.shape[1:])
        first = self.start // row
        return block.reshape(-1)[self.start - first * row:self.stop - first * row]


class ShardedOptimizer:
    """This replica's optimizer over its shards of ``sync``'s buckets (see the module note).

    ``optimizer``: the user's, built on the rank's parameters; only its class and parameter groups
    are used (buckets never mix groups: ``sync`` was made with ``key=group_key(optimizer)``).
    """

    def __init__(self, sync: GradSync, optimizer: torch.optim.Optimizer, replica: int,
                 wait: Callable[[Any, str], None]) -> None:
        self.sync, self.replica, self.wait = sync, replica, wait
        self.flats: list[torch.Tensor] = []          # per bucket: the parameters, padded like the gradients
        self.params: list[nn.Parameter] = []         # per bucket: this replica's shard of it (what is stepped)
        self.segments: list[list[Segment]] = []      # per bucket: the parameters' parts in that shard
        self._gathers: dict[int, Any] = {}           # bucket -> its parameters' all-gather, not waited for yet
        groups = group_key(optimizer)
        per_group: dict[int, list[nn.Parameter]] = {}
        for k, bucket in enumerate(sync.buckets):
            self._lay_out(k, bucket)
            per_group.setdefault(groups(bucket[0]), []).append(self.params[-1])
        hyper = [{key: v for key, v in g.items() if key != "params"} for g in optimizer.param_groups]
        cls = type(optimizer)
        accepted = inspect.signature(cls).parameters
        self.optimizer = cls([{**hyper[i], "params": ps} for i, ps in sorted(per_group.items())],
                             **{key: v for key, v in optimizer.defaults.items() if key in accepted})
        self._slots = {id(p): j for j, p in enumerate(p for b in sync.buckets for p in b)}   # -> _squares
        self._squares = torch.zeros(len(self._slots) + 1, dtype=torch.float64,
                                    device=self.flats[0].device if self.flats else None)

    def _lay_out(self, k: int, bucket: list[nn.Parameter]) -> None:
        size, n = self.sync.sizes[k], self.sync.size
        flat = torch.zeros(size * n, dtype=bucket[0].dtype, device=bucket[0].device)
        lo, hi = self.replica * size, (self.replica + 1) * size
        segments, offset = [], 0
        with torch.no_grad():
            for p in bucket:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                if offset < hi and offset + p.numel() > lo:
                    a, b = max(offset, lo), min(offset + p.numel(), hi)
                    segments.append(Segment(p, a - offset, b - offset, a - lo))
                offset += p.numel()
        shard = nn.Parameter(flat[lo:hi])
        shard.grad = self.sync.shard_of(k)   # the reduced gradients land there (grad_sync.py)
        self.flats.append(flat)
        self.params.append(shard)
        self.segments.append(segments)

    # ------------------------------------------------------------------ a step

    def reduce_squares(self) -> None:
        """Every parameter's squared gradient norm, summed over the replicas' shards (one all-reduce)."""
        parts = [(self._slots[id(s.param)], s.piece(self.sync.shard_of(k))) for k, segs in enumerate(self.segments)
                 for s in segs]
        self._squares.zero_()
        if parts:
            norms = torch._foreach_norm([t for _, t in parts])
            self._squares[torch.tensor([j for j, _ in parts], device=self._squares.device)] = \
                torch.stack([v.double() for v in norms]).pow(2)
        self.wait(dist.all_reduce(self._squares, group=self.sync.group, async_op=True), "the gradient-norm all-reduce")

    def squares(self, params: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The squared gradient norms of ``params`` (None: 0), as :meth:`reduce_squares` summed them."""
        none = len(self._slots)
        at = [none if p is None else self._slots.get(id(p), none) for p in params]
        return self._squares[torch.tensor(at, device=self._squares.device)]

    def step(self, defer: bool) -> None:
        """Step the shards, then gather every bucket's parameters, the first layers' first (``defer``: wait in
        :meth:`ready`, bucket by bucket as the stages need them)."""
        self.ready()   # (every stage ran its F, so nothing is left: a guard)
        self.optimizer.step()
        for k in reversed(range(len(self.flats))):   # buckets hold the last layers first: the first F's come first
            a, size = self.replica * self.sync.sizes[k], self.sync.sizes[k]
            self._gathers[k] = dist.all_gather_single(self.flats[k], self.flats[k][a:a + size], group=self.sync.group,
                                                      async_op=True)
        if not defer:
            self.ready()

    def ready(self, buckets: Iterable[int] | None = None) -> None:
        """Wait for the last step's all-gather of ``buckets`` (default: all); a no-op for those already waited for.
        On CUDA a wait only orders the current stream after the gather: the host goes on."""
        for k in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(k, None)
            if work is not None:
                self.wait(work, "the parameter all-gather")

    def buckets_of(self, params: Iterable[nn.Parameter]) -> set[int]:
        """The buckets holding ``params``."""
        ids = {id(p) for p in params}
        return {k for k, bucket in enumerate(self.sync.buckets) if any(id(p) in ids for p in bucket)}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    # ------------------------------------------------------------------ checkpoints (state.py)

    def _state_names(self, k: int) -> dict[str, Any]:
        return dict(self.optimizer.state.get(self.params[k], {}))

    def state_entries(self, keys: Mapping[int, str]) -> dict[str, Any]:
        """This replica's optimizer state by global key (``keys``: parameter id -> its key): a parameter's part
        as DCP shards of its shape; scalars (a step count) whole."""
        out: dict[str, Any] = {}
        for k, segs in enumerate(self.segments):
            for name, value in self._state_names(k).items():
                for s in segs:
                    key = f"optim.{keys[id(s.param)]}.{name}"
                    out[key] = value if name in SCALARS else s.block(s.piece(value), s.param.shape)
        return out

    def template_entries(self, found: Mapping[int, Mapping[str, str]],
                         saved: Mapping[str, tuple[tuple[int, ...], torch.dtype] | None],
                         device_of: Callable[[nn.Parameter, str], torch.device]) -> dict[str, Any]:
        """Empty tensors to load this replica's parts of the saved state into (``found``: parameter id -> state
        name -> saved key)."""
        out: dict[str, Any] = {}
        for k, segs in enumerate(self.segments):
            for s in segs:
                for name, key in found.get(id(s.param), {}).items():
                    info = saved[key]
                    if info is None:
                        out[key] = None
                    elif name in SCALARS:
                        out[key] = torch.empty(info[0], dtype=info[1], device=device_of(self.params[k], name))
                    else:
                        like = torch.empty(s.stop - s.start, dtype=info[1], device=s.param.device)
                        out[key] = s.block(like, s.param.shape)
        return out

    def load_entries(self, found: Mapping[int, Mapping[str, str]], sd: Mapping[str, Any]) -> None:
        """Take a filled :meth:`template_entries`: each shard's state assembled from its parameters' parts."""
        for k, (shard, segs) in enumerate(zip(self.params, self.segments)):
            state: dict[str, Any] = {}
            for s in segs:
                for name, key in found.get(id(s.param), {}).items():
                    value = sd[key]
                    if name in SCALARS or not isinstance(value, torch.Tensor):
                        state.setdefault(name, value)
                    else:
                        whole = state.setdefault(name, torch.zeros(shard.shape, dtype=value.dtype, device=shard.device))
                        s.piece(whole).copy_(s.elements(value))
            if state:
                self.optimizer.state[shard] = state


def group_key(optimizer: torch.optim.Optimizer) -> Callable[[nn.Parameter], int]:
    """Parameter -> the index of its group in ``optimizer`` (buckets never mix groups)."""
    where = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return lambda p: where.get(id(p), 0)
