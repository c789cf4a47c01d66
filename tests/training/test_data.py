"""Batches: every step's global batch is a function of (seed, step), sharded exactly over replicas and microbatches."""

from __future__ import annotations

import pytest
import torch

from pipeengine.training.data import global_batch_indices, shard_microbatches


def test_global_batches_are_deterministic_and_shard_exactly() -> None:
    a = global_batch_indices(100, 16, 3, seed=1)
    assert torch.equal(a, global_batch_indices(100, 16, 3, seed=1))
    assert not torch.equal(a, global_batch_indices(100, 16, 4, seed=1))
    dp2 = [mb for r in range(2) for mb in shard_microbatches(a, r, 2, 2)]
    assert torch.equal(torch.cat(dp2), torch.cat(shard_microbatches(a, 0, 1, 4)))
    with pytest.raises(ValueError, match="global batch 16 is not divisible by dp=3 x microbatches=2"):
        shard_microbatches(a, 0, 3, 2)


class _Counting:
    """A small source whose example i is (i, 2 i)."""

    def num_examples(self, split: str) -> int:
        return 50

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(index)]), torch.tensor(2 * index)


@pytest.mark.parametrize("workers", [0, 1])
def test_step_loader_reads_what_batches_reads(workers: int) -> None:
    from pipeengine.training.data import batches, split_microbatches, step_loader

    src = _Counting()
    for replica in range(2):
        loader = step_loader(src, seed=3, replica=replica, replicas=2, global_batch=12, start=2, steps=7,
                             workers=workers, pin_memory=False)
        got = [split_microbatches(b, 3) for b in loader]
        assert len(got) == 5
        for step, mbs in zip(range(2, 7), got):
            want = batches(src, "train", step, 3, replica, 2, 3, 2)
            assert len(mbs) == 3
            for (x, y), (wx, wy) in zip(mbs, want):
                assert torch.equal(x, wx) and torch.equal(y, wy)


def test_epoch_permutation_is_drawn_once() -> None:
    from pipeengine.training.data import _permutation

    global_batch_indices(3_000_000, 32, 0, seed=11)  # draws epoch 0's order (~0.1 s: longer than a small step)
    misses = _permutation.cache_info().misses
    for step in range(1, 50):
        global_batch_indices(3_000_000, 32, step, seed=11)
    assert _permutation.cache_info().misses == misses
