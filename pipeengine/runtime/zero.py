"""ZeRO-1: each stage's optimizer state sharded over its data-parallel group (``shard_optimizer=True``, ``--zero 1``).

[Note: sharded optimizer state]
Without sharding every replica of a stage holds the whole optimizer state (AdamW: 8 bytes per fp32
parameter, on top of 4 for the weight and 4 for its gradient). With it, the gradient buckets
(grad_sync.py) are padded to a multiple of dp and cut into dp equal shards, and the parameters get
one flat buffer per bucket laid out like its gradients (every ``param.data`` a view into it).
Replica r owns shard r of every bucket: each parameter's *part* there (its flattened elements that
fall in the shard, a view, no copy). A step then goes:

    backward     each bucket is reduce-scattered (``reduce_scatter_single``, in place): replica r gets
                 the sum of shard r; the buckets of tied copies are all-reduced, then summed over
                 their tie as without sharding
    norm         per parameter, the squared norm of its part, and whether it got a gradient, summed
                 over the group (one small all-reduce); then the end-of-step all-reduce as ever
    step         the user's optimizer steps the parts: its groups hold them for the duration of its
                 own ``step()`` (its hyperparameters, LR schedulers and hooks as the user set them),
                 its state holds 1/dp of the stage's elements, keyed by the user's parameters
    all-gather   every bucket's shards, gathered in place (``all_gather_single``), the first layers'
                 buckets first; on CPU waited for at once, on CUDA by each stage just before its first
                 F of the next step (or before a state read): it overlaps the data loading, and the
                 earlier stages' forwards with the later stages' gathers

It is exact for optimizers that update every element on its own (SGD, Adam, AdamW, Adamax,
Adagrad, RMSprop, NAdam, RAdam): a part steps bitwise as the same elements of the whole parameter,
with the parameter's own step count, and with dp 2 the reduce-scatter adds the same two numbers as
the all-reduce did. A parameter that no replica gave a gradient is not stepped (``grad`` None, as
``zero_grad`` leaves it unsharded); one outside every group, or frozen, never. The gradient norm is
summed from per-part norms (round-off apart from the unsharded norm: clipping then differs in the
last bits). The user's ``zero_grad()`` changes nothing: the engine points the gradients into its
buckets at every step.

torch's ``ZeroRedundancyOptimizer`` assigns whole parameters to ranks and broadcasts them, after a
full all-reduce of the gradients (DDP's): it cannot use the buckets' reduce-scatter, and its
``consolidate_state_dict`` gathers the whole state on one rank to save. Megatron's and DeepSpeed's
distributed optimizers step flat shards with one step count per shard and step a parameter without
a gradient with zeros. Here a checkpoint keeps its global keys (state.py): each replica writes its
parts of a parameter's state as DCP shards with global offsets (``CheckpointableTensor``: at most
2 x ndim - 1 boxes of the parameter's shape per part), so a state saved at any dp, sharded or not,
loads at any other.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .device import constant
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
    """Steps the user's ``optimizer`` on this replica's shards of ``sync``'s buckets (see the module note).

    ``optimizer`` stays the user's object: its ``param_groups`` (the user's dicts, parameters and
    hyperparameters), ``state`` (keyed by the user's parameters, each holding its part: a 1-D tensor of
    the elements in this replica's shard), ``state_dict()``, hooks and LR schedulers work as without
    sharding. Only :meth:`step` differs: for the duration of the optimizer's own ``step()`` every group
    holds the parts of its parameters that have elements here and got a gradient on some replica (a
    parameter outside every group, frozen, or without a gradient this step is not stepped, as
    unsharded), each part's ``grad`` a view of the reduced gradient shard.
    """

    def __init__(self, sync: GradSync, optimizer: torch.optim.Optimizer, replica: int,
                 wait: Callable[[Any, str], None]) -> None:
        check_elementwise(optimizer)
        self.sync, self.optimizer, self.replica, self.wait = sync, optimizer, replica, wait
        self.flats: list[torch.Tensor] = []          # per bucket: the parameters, padded like the gradients
        self.params: list[nn.Parameter] = []         # per bucket: this replica's shard (unscaled, clipped in place)
        self.segments: list[list[Segment]] = []      # per bucket: the parameters' parts in that shard
        self._parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(param) -> (its part, the part's grad)
        self._gathers: dict[int, Any] = {}           # bucket -> its parameters' all-gather, not waited for yet
        for k, bucket in enumerate(sync.buckets):
            self._lay_out(k, bucket)
        self._cut_state()
        order = [p for b in sync.buckets for p in b]
        self._slots = {id(p): j for j, p in enumerate(order)}   # -> _reduced
        n = len(order)
        device = self.flats[0].device if self.flats else None
        # [squared norm per parameter, 0 (a parameter without a slot), got a gradient per parameter]: one all-reduce
        self._reduced = torch.zeros(2 * n + 1, dtype=torch.float64, device=device)

    def _cut_state(self) -> None:
        """State the optimizer holds already (Adagrad's ``sum`` from its constructor, or a state the factory
        loaded): each parameter keeps its part's elements of every per-element tensor; one without a part here
        keeps none (another replica steps it)."""
        for segs in self.segments:
            for seg in segs:
                state = self.optimizer.state.get(seg.param)
                if state:
                    self.optimizer.state[seg.param] = {
                        name: v.reshape(-1)[seg.start:seg.stop].clone()
                        if isinstance(v, torch.Tensor) and v.numel() == seg.param.numel() > 1 and name not in SCALARS
                        else v for name, v in state.items()}
        bucketed = {id(p) for b in self.sync.buckets for p in b}
        for p in [p for p in self.optimizer.state if id(p) in bucketed and id(p) not in self._parts]:
            del self.optimizer.state[p]

    def mark_stepped(self, params: Iterable[nn.Parameter]) -> None:
        """These parameters have a gradient this step whatever their own hooks saw (tied copies, given the tie's
        sum after the sync: as unsharded, every copy steps)."""
        for p in params:
            flag = self.sync.flag_of(p)
            if flag is not None:
                flag.fill_(1)

    def _lay_out(self, k: int, bucket: list[nn.Parameter]) -> None:
        size, n = self.sync.sizes[k], self.sync.size
        for p in bucket:
            if not p.dtype.is_floating_point or p.element_size() < 4:
                raise ValueError(f"shard_optimizer (--zero 1) keeps each parameter's optimizer state in its dtype, as "
                                 f"the unsharded optimizer does; a parameter of shape {tuple(p.shape)} is {p.dtype}, "
                                 f"whose state would lose small updates: keep the parameters in float32 (train in "
                                 f"bf16 with --precision bf16, autocast) or use --zero 0")
        flat = torch.zeros(size * n, dtype=bucket[0].dtype, device=bucket[0].device)
        lo, hi = self.replica * size, (self.replica + 1) * size
        shard_grad = self.sync.shard_of(k)
        segments, offset = [], 0
        with torch.no_grad():
            for p in bucket:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                if offset < hi and offset + p.numel() > lo:
                    a, b = max(offset, lo), min(offset + p.numel(), hi)
                    seg = Segment(p, a - offset, b - offset, a - lo)
                    segments.append(seg)
                    self._parts[id(p)] = (seg.piece(flat[lo:hi]), seg.piece(shard_grad))
                offset += p.numel()
        shard = nn.Parameter(flat[lo:hi])
        shard.grad = shard_grad   # the reduced gradients land there (grad_sync.py)
        self.flats.append(flat)
        self.params.append(shard)
        self.segments.append(segments)

    # ------------------------------------------------------------------ a step

    def reduce_squares(self) -> None:
        """Every parameter's squared gradient norm, summed over the replicas' shards, and whether any replica gave
        it a gradient: one all-reduce."""
        parts = [(self._slots[id(s.param)], s.piece(self.sync.shard_of(k))) for k, segs in enumerate(self.segments)
                 for s in segs]
        n = len(self._slots)
        self._reduced.zero_()
        if parts:
            norms = torch._foreach_norm([t for _, t in parts])
            at = self._index_of(tuple(j for j, _ in parts))
            self._reduced[at] = torch.stack([v.double() for v in norms]).pow(2)
        self._reduced[n + 1:].copy_(self.sync.got)
        self.wait(dist.all_reduce(self._reduced, group=self.sync.group, async_op=True), "the gradient-norm all-reduce")

    def _index_of(self, slots: tuple[int, ...]) -> torch.Tensor:
        return constant(slots, torch.long, self._reduced.device)

    def squares(self, params: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The squared gradient norms of ``params`` (None: 0), as :meth:`reduce_squares` summed them."""
        none = len(self._slots)
        return self._reduced[self._index_of(tuple(none if p is None else self._slots.get(id(p), none)
                                                  for p in params))]

    def got(self) -> torch.Tensor:
        """Per parameter slot, whether some replica gave it a gradient (after :meth:`reduce_squares`), on the device:
        the host reads it with the step's signals (consensus.py) and passes it to :meth:`step`."""
        return self._reduced[len(self._slots) + 1:] > 0

    def step(self, defer: bool, got: Sequence[float]) -> None:
        """Step the user's optimizer on this replica's parts that ``got`` a gradient (:meth:`got`, as read), then
        gather every bucket's parameters, the first layers' first (``defer``: wait in :meth:`ready`, bucket by
        bucket as the stages need them)."""
        self.ready()   # (every stage ran its F, so nothing is left: a guard)
        stepped = {pid for pid, j in self._slots.items() if got[j] and pid in self._parts}
        with self._parts_in_groups(stepped):
            self.optimizer.step()
        for k in reversed(range(len(self.flats))):   # buckets hold the last layers first: the first F's come first
            a, size = self.replica * self.sync.sizes[k], self.sync.sizes[k]
            self._gathers[k] = dist.all_gather_single(self.flats[k], self.flats[k][a:a + size], group=self.sync.group,
                                                      async_op=True)
        if not defer:
            self.ready()

    @contextlib.contextmanager
    def _parts_in_groups(self, stepped: set[int]) -> Iterator[None]:
        """The optimizer's groups hold the parts of the parameters in ``stepped`` (its state keyed by them), as
        long as the block runs; then the user's parameters again."""
        opt = self.optimizer
        groups = [g["params"] for g in opt.param_groups]
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []   # (the user's parameter, its part)
        for g, params in zip(opt.param_groups, groups):
            parts = []
            for p in params:
                if id(p) in stepped:
                    part, grad = self._parts[id(p)]
                    part.grad = grad
                    parts.append(part)
                    swapped.append((p, part))
            g["params"] = parts
        for p, part in swapped:
            if p in opt.state:
                opt.state[part] = opt.state.pop(p)
        try:
            yield
        finally:
            for g, params in zip(opt.param_groups, groups):
                g["params"] = params
            for p, part in swapped:
                if part in opt.state:
                    opt.state[p] = opt.state.pop(part)

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

    def state_entries(self, keys: Mapping[int, str]) -> dict[str, Any]:
        """This replica's optimizer state by global key (``keys``: parameter id -> its key): a parameter's part
        as DCP shards of its shape; scalars (a step count) whole."""
        out: dict[str, Any] = {}
        for segs in self.segments:
            for s in segs:
                for name, value in self.optimizer.state.get(s.param, {}).items():
                    key = f"optim.{keys[id(s.param)]}.{name}"
                    out[key] = value if name in SCALARS else s.block(value, s.param.shape)
        return out

    def template_entries(self, found: Mapping[int, Mapping[str, str]],
                         saved: Mapping[str, tuple[tuple[int, ...], torch.dtype] | None],
                         device_of: Callable[[nn.Parameter, str], torch.device]) -> dict[str, Any]:
        """Empty tensors to load this replica's parts of the saved state into (``found``: parameter id -> state
        name -> saved key)."""
        out: dict[str, Any] = {}
        for segs in self.segments:
            for s in segs:
                for name, key in found.get(id(s.param), {}).items():
                    info = saved[key]
                    if info is None:
                        out[key] = None
                    elif name in SCALARS:
                        out[key] = torch.empty(info[0], dtype=info[1], device=device_of(s.param, name))
                    else:
                        like = torch.empty(s.stop - s.start, dtype=info[1], device=s.param.device)
                        out[key] = s.block(like, s.param.shape)
        return out

    def load_entries(self, found: Mapping[int, Mapping[str, str]], sd: Mapping[str, Any]) -> None:
        """Take a filled :meth:`template_entries`: each parameter's part of its saved state."""
        for segs in self.segments:
            for s in segs:
                state = {name: sd[key] if name in SCALARS or not isinstance(sd[key], torch.Tensor)
                         else s.elements(sd[key]).clone() for name, key in found.get(id(s.param), {}).items()}
                if state:
                    self.optimizer.state[s.param] = state
