"""Deterministic, DP-sharded batches: every step's global batch from (seed, data position), sliced per replica.

The data is one stream of examples: epoch e is ``randperm`` seeded by (seed, e), the epochs one after
another. Step t reads the global batch's examples from the stream's position t x global batch, or,
after a resume, from the number of examples consumed so far (a run resumed under another global
batch neither skips nor repeats). Replica r takes the r-th contiguous slice (its microbatches' worth:
replicas may take one microbatch more than others) and microbatch k the k-th piece of that slice. So
a pp x dp job sees exactly the examples one process sees with the same global batch.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..runtime.tensors import crc32
from .batch import Batch

__all__ = ["Source", "data_digest", "stream_indices", "global_batch_indices", "replica_share", "batches",
           "step_indices", "replica_examples", "replica_batches", "split_microbatches", "SourceDataset", "StepSampler",
           "step_loader", "example_crc"]


class Source(Protocol):
    """Examples by index, per split ("train" or "val")."""

    def num_examples(self, split: str) -> int: ...
    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@functools.lru_cache(maxsize=4)
def _permutation(num_examples: int, seed: int) -> torch.Tensor:
    """One epoch's order, drawn once (a draw over millions of examples takes longer than a step)."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))


def stream_indices(num_examples: int, start: int, count: int, seed: int) -> torch.Tensor:
    """Indices of the ``count`` examples from position ``start`` of the data stream (epoch e: ``randperm`` seeded
    by ``seed * 1_000_003 + e``, drawn once and kept; a batch that crosses an epoch end goes on into the next)."""
    if num_examples < 1:
        raise ValueError("the dataset is empty")
    out: list[torch.Tensor] = []
    have = 0
    while have < count:
        epoch, offset = divmod(start, num_examples)
        perm = _permutation(num_examples, seed * 1_000_003 + epoch)
        take = min(count - have, num_examples - offset)
        out.append(perm[offset:offset + take])
        start, have = start + take, have + take
    return torch.cat(out)


def global_batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Indices of step ``step``'s global batch in a run that kept one global batch from step 0."""
    return stream_indices(num_examples, step * global_batch, global_batch, seed)


def replica_share(indices: torch.Tensor, batch: Batch, dp: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s slice of a step's global batch: its microbatches' examples, in order."""
    if len(indices) != batch.size:
        raise ValueError(f"a step holds {len(indices)} examples, but the global batch is {batch.size}")
    counts = batch.counts(dp)
    first = sum(counts[:replica]) * batch.micro
    return indices[first:first + counts[replica] * batch.micro]


def _split_seed(seed: int, split: str) -> int:
    return seed + (0 if split == "train" else 7919)


def step_indices(source: Source, split: str, start: int, seed: int, size: int) -> torch.Tensor:
    """Indices of the ``size`` examples of ``split`` from data position ``start`` (the global batch there)."""
    return stream_indices(source.num_examples(split), start, size, _split_seed(seed, split))


def replica_examples(source: Source, split: str, start: int, seed: int, batch: Batch, dp: int,
                     replica: int) -> list[tuple[Any, Any]]:
    """Replica ``replica``'s examples of the global batch at data position ``start`` (read here, in this process)."""
    mine = replica_share(step_indices(source, split, start, seed, batch.size), batch, dp, replica)
    return [source.example(split, int(i)) for i in mine]


def replica_batches(source: Source, split: str, start: int, seed: int, batch: Batch, dp: int,
                    replica: int) -> list[tuple[Any, Any]]:
    """Replica ``replica``'s (inputs, targets) microbatches of the global batch at data position ``start``
    (read here, in this process)."""
    return split_microbatches(default_collate(replica_examples(source, split, start, seed, batch, dp, replica)),
                              batch.counts(dp)[replica])


def batches(source: Source, split: str, step: int, seed: int, dp_rank: int, dp_size: int, microbatches: int,
            micro_batch_size: int) -> list[tuple[Any, Any]]:
    """The (inputs, targets) microbatches of replica ``dp_rank`` at ``step`` of a run whose global batch, dp x
    microbatches x micro-batch size, never changed."""
    batch = Batch(dp_size * microbatches * micro_batch_size, microbatches, micro_batch_size)
    return replica_batches(source, split, step * batch.size, seed, batch, dp_size, dp_rank)


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
    """A replica's share of every step's global batch, step by step: the indices of one step's examples at a time
    (``batch_sampler=`` of a DataLoader), the same as :func:`replica_batches` reads. Step ``first`` starts at data
    position ``position``; each later step one global batch further."""

    def __init__(self, num_examples: int, seed: int, batch: Batch, dp: int, replica: int, first: int, steps: int,
                 position: int) -> None:
        self.num_examples, self.seed, self.batch, self.dp, self.replica = num_examples, seed, batch, dp, replica
        self.first, self.steps, self.position = first, steps, position

    def __len__(self) -> int:
        return max(0, self.steps - self.first)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(len(self)):
            idx = stream_indices(self.num_examples, self.position + k * self.batch.size, self.batch.size, self.seed)
            yield replica_share(idx, self.batch, self.dp, self.replica).tolist()


def step_loader(source: Source, seed: int, batch: Batch, dp: int, replica: int, first: int, steps: int,
                position: int, workers: int, pin_memory: bool, collate: Any = default_collate) -> DataLoader[Any]:
    """Each training step's batch for this replica (inputs, targets), from step ``first`` at data position
    ``position``, read ahead by ``workers`` processes (``prefetch_factor`` 2), in pinned memory for a CUDA device:
    cut it with :func:`split_microbatches` into the replica's microbatches (``collate``: ``list`` keeps the
    examples apart, for a packing to build)."""
    sampler = StepSampler(source.num_examples("train"), _split_seed(seed, "train"), batch, dp, replica, first, steps,
                          position)
    return DataLoader(SourceDataset(source, "train"), batch_sampler=sampler, num_workers=workers,
                      collate_fn=collate, pin_memory=pin_memory, prefetch_factor=2 if workers else None,
                      persistent_workers=bool(workers))


def data_digest(source: Source) -> str:
    """What the ranks compare to know they read the same data: the example counts of both splits and a
    checksum of the first and last training examples (a path can name other files on another node)."""
    n, v = source.num_examples("train"), source.num_examples("val")
    crc = 0
    for i in sorted({0, n - 1} if n else set()):
        crc = example_crc(source.example("train", i), crc)
    return f"{n:,} training and {v:,} validation examples, first and last crc32 {crc:08x}"


def example_crc(x: Any, crc: int = 0) -> int:
    if isinstance(x, torch.Tensor):
        return crc32(x, crc)
    if isinstance(x, (tuple, list)):
        for item in x:
            crc = example_crc(item, crc)
        return crc
    if isinstance(x, dict):
        for key in sorted(x, key=str):
            crc = example_crc(x[key], zlib.crc32(str(key).encode(), crc))
        return crc
    return zlib.crc32(repr(x).encode(), crc)
