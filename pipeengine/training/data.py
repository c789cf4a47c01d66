"""Deterministic, DP-sharded batches: every step's global batch from (seed, step), sliced per replica and microbatch.

The global batch of step t is a function of (seed, step, dataset size) only; replica r takes the
r-th contiguous slice and microbatch k the k-th piece of that slice. So a pp x dp job sees exactly
the examples one process sees with the same global batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Source", "global_batch_indices", "shard_microbatches", "batches"]


class Source(Protocol):
    """Examples by index, per split ("train" or "val")."""

    def num_examples(self, split: str) -> int: ...
    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def global_batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Indices of step ``step``'s global batch: consecutive slices of a per-epoch permutation.

    Epoch e uses ``randperm(num_examples)`` seeded by ``seed * 1_000_003 + e``; a batch that
    crosses an epoch end continues into the next epoch's permutation.
    """
    if num_examples < 1:
        raise ValueError("the dataset is empty")
    out: list[torch.Tensor] = []
    start = step * global_batch
    while sum(len(t) for t in out) < global_batch:
        epoch, offset = divmod(start, num_examples)
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        take = min(global_batch - sum(len(t) for t in out), num_examples - offset)
        out.append(perm[offset:offset + take])
        start += take
    return torch.cat(out)


def shard_microbatches(indices: torch.Tensor, dp_rank: int, dp_size: int, microbatches: int) -> list[torch.Tensor]:
    """This replica's slice of the global batch, cut into ``microbatches`` equal microbatches."""
    g = len(indices)
    if g % (dp_size * microbatches):
        raise ValueError(f"global batch {g} is not divisible by dp={dp_size} x microbatches={microbatches}")
    per = g // dp_size
    mine = indices[dp_rank * per:(dp_rank + 1) * per]
    return list(mine.chunk(microbatches))


def batches(source: Source, split: str, step: int, seed: int, dp_rank: int, dp_size: int, microbatches: int,
            micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, targets) microbatches of replica ``dp_rank`` at ``step``."""
    g = dp_size * microbatches * micro_batch_size
    idx = global_batch_indices(source.num_examples(split), g, step, seed + (0 if split == "train" else 7919))
    out = []
    for mb in shard_microbatches(idx, dp_rank, dp_size, microbatches):
        xs, ys = zip(*(source.example(split, int(i)) for i in mb))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out
