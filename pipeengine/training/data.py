"""Deterministic, DP-sharded batches: every step's global batch from (seed, step), sliced per replica and microbatch.

The global batch of step t is a function of (seed, step, dataset size) only; replica r takes the
r-th contiguous slice and microbatch k the k-th piece of that slice. So a pp x dp job sees exactly
the examples one process sees with the same global batch.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..runtime.tensors import crc32

__all__ = ["Source", "data_digest",
           "global_batch_indices", "shard_microbatches", "batches", "split_microbatches", "SourceDataset",
           "StepSampler", "step_loader"]


class Source(Protocol):
    """Examples by index, per split ("train" or "val")."""

    def num_examples(self, split: str) -> int: ...
    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@functools.lru_cache(maxsize=4)
def _permutation(num_examples: int, seed: int) -> torch.Tensor:
    """One epoch's order, drawn once (a draw over millions of examples takes longer than a step)."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))


def global_batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Indices of step ``step``'s global batch: consecutive slices of a per-epoch permutation.

    Epoch e uses ``randperm(num_examples)`` seeded by ``seed * 1_000_003 + e`` (drawn once per epoch
    and kept); a batch that crosses an epoch end continues into the next epoch's permutation.
    """
    if num_examples < 1:
        raise ValueError("the dataset is empty")
    out: list[torch.Tensor] = []
    start, have = step * global_batch, 0
    while have < global_batch:
        epoch, offset = divmod(start, num_examples)
        perm = _permutation(num_examples, seed * 1_000_003 + epoch)
        take = min(global_batch - have, num_examples - offset)
        out.append(perm[offset:offset + take])
        start, have = start + take, have + take
    return torch.cat(out)


def shard_microbatches(indices: torch.Tensor, dp_rank: int, dp_size: int, microbatches: int) -> list[torch.Tensor]:
    """This replica's slice of the global batch, cut into ``microbatches`` equal microbatches."""
    g = len(indices)
    if g % (dp_size * microbatches):
        raise ValueError(f"global batch {g} is not divisible by dp={dp_size} x microbatches={microbatches}")
    per = g // dp_size
    mine = indices[dp_rank * per:(dp_rank + 1) * per]
    return list(mine.chunk(microbatches))


def _split_seed(seed: int, split: str) -> int:
    return seed + (0 if split == "train" else 7919)


def batches(source: Source, split: str, step: int, seed: int, dp_rank: int, dp_size: int, microbatches: int,
            micro_batch_size: int) -> list[tuple[Any, Any]]:
    """The (inputs, targets) microbatches of replica ``dp_rank`` at ``step`` (read here, in this process)."""
    g = dp_size * microbatches * micro_batch_size
    idx = global_batch_indices(source.num_examples(split), g, step, _split_seed(seed, split))
    mine = shard_microbatches(idx, dp_rank, dp_size, 1)[0]
    return split_microbatches(default_collate([source.example(split, int(i)) for i in mine]), microbatches)


def split_microbatches(batch: Any, count: int) -> list[tuple[Any, Any]]:
    """A replica's (inputs, targets) for one step cut into ``count`` equal microbatches (tuples stay tuples)."""
    x, y = batch
    xs, ys = _chunks(x, count), _chunks(y, count)
    return list(zip(xs, ys))


def _chunks(x: Any, count: int) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return list(x.chunk(count))
    if isinstance(x, (tuple, list)):
        parts = [_chunks(t, count) for t in x]
        return [type(x)(p[k] for p in parts) for k in range(count)]
    raise TypeError(f"a batch holds Tensors or tuples of them, not {type(x).__name__}")


class SourceDataset(Dataset[tuple[Any, Any]]):
    """One split of a :class:`Source` as a ``torch.utils.data.Dataset``."""

    def __init__(self, source: Source, split: str) -> None:
        self.source, self.split = source, split

    def __len__(self) -> int:
        return self.source.num_examples(self.split)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.source.example(self.split, index)


class StepSampler(Sampler[list[int]]):
    """A replica's share of every step's global batch, step by step from ``start``: the indices of one
    step's examples at a time (``batch_sampler=`` of a DataLoader), the same as :func:`batches` reads."""

    def __init__(self, num_examples: int, global_batch: int, seed: int, replica: int, replicas: int, start: int,
                 steps: int) -> None:
        self.num_examples, self.global_batch, self.seed = num_examples, global_batch, seed
        self.replica, self.replicas, self.start, self.steps = replica, replicas, start, steps

    def __len__(self) -> int:
        return max(0, self.steps - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.steps):
            idx = global_batch_indices(self.num_examples, self.global_batch, step, self.seed)
            yield shard_microbatches(idx, self.replica, self.replicas, 1)[0].tolist()


def step_loader(source: Source, seed: int, replica: int, replicas: int, global_batch: int, start: int, steps: int,
                workers: int, pin_memory: bool) -> DataLoader[Any]:
    """Each training step's batch for this replica (inputs, targets), from ``workers`` processes that read
    ahead (``prefetch_factor`` 2), in pinned memory for a CUDA device: cut it with :func:`split_microbatches`."""
    sampler = StepSampler(source.num_examples("train"), global_batch, _split_seed(seed, "train"), replica, replicas,
                          start, steps)
    return DataLoader(SourceDataset(source, "train"), batch_sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, prefetch_factor=2 if workers else None, persistent_workers=bool(workers))


def data_digest(source: Source) -> str:
    """What the ranks compare to know they read the same data: the example counts of both splits and a
    checksum of the first and last training examples (a path can name other files on another node)."""
    n, v = source.num_examples("train"), source.num_examples("val")
    crc = 0
    for i in sorted({0, n - 1} if n else set()):
        crc = _crc(source.example("train", i), crc)
    return f"{n:,} training and {v:,} validation examples, first and last crc32 {crc:08x}"


def _crc(x: Any, crc: int) -> int:
    if isinstance(x, torch.Tensor):
        return crc32(x, crc)
    if isinstance(x, (tuple, list)):
        for item in x:
            crc = _crc(item, crc)
        return crc
    if isinstance(x, dict):
        for key in sorted(x, key=str):
            crc = _crc(x[key], zlib.crc32(str(key).encode(), crc))
        return crc
    return zlib.crc32(repr(x).encode(), crc)
