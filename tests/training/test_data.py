"""Batches: every step's global batch is a function of (seed, data position), sharded exactly over replicas and
microbatches, evenly or not."""

from __future__ import annotations

import pytest
import torch

from pipeengine.training.batch import Batch
from pipeengine.training.data import global_batch_indices, replica_share, stream_indices


def test_global_batches_are_deterministic_and_shard_exactly() -> None:
    a = global_batch_indices(100, 16, 3, seed=1)
    assert torch.equal(a, global_batch_indices(100, 16, 3, seed=1))
    assert not torch.equal(a, global_batch_indices(100, 16, 4, seed=1))
    for batch, dp in ((Batch(16, 2, 4), 2), (Batch(16, 3, 2), 3), (Batch(16, 6, 1), 3), (Batch(16, 1, 4), 4)):
        shares = [replica_share(a, batch, dp, r) for r in range(dp)]
        assert torch.equal(torch.cat(shares), a)   # every example once, in order
        assert [len(x) // batch.micro for x in shares] == batch.counts(dp)
    assert Batch(16, 3, 2).counts(3) == [3, 3, 2] and Batch(16, 6, 1).counts(3) == [6, 5, 5]
    with pytest.raises(ValueError, match="a step holds 16 examples, but the global batch is 12"):
        replica_share(a, Batch(12, 2, 2), 3, 0)


def test_the_data_position_is_the_examples_consumed() -> None:
    """100 steps at 32, then 50 at 64: the 64s start at example 3,200, where the 32s stopped (none skipped)."""
    stream = stream_indices(1000, 0, 6400, seed=5)
    at32 = torch.cat([global_batch_indices(1000, 32, t, seed=5) for t in range(100)])
    at64 = torch.cat([stream_indices(1000, 3200 + k * 64, 64, seed=5) for k in range(50)])
    assert torch.equal(torch.cat([at32, at64]), stream)


class _Counting:
    """A small source whose example i is (i, 2 i)."""

    def num_examples(self, split: str) -> int:
        return 50

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(index)]), torch.tensor(2 * index)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("batch, dp", [(Batch(12, 3, 2), 2), (Batch(12, 2, 2), 3), (Batch(12, 2, 1), 7)])
def test_step_loader_reads_what_batches_reads(workers: int, batch: Batch, dp: int) -> None:
    from pipeengine.training.data import replica_batches, split_microbatches, step_loader

    src = _Counting()
    for replica in range(dp):
        count = batch.counts(dp)[replica]
        loader = step_loader(src, seed=3, batch=batch, dp=dp, replica=replica, first=2, steps=7, position=30,
                             workers=workers, pin_memory=False)
        got = [split_microbatches(b, count) for b in loader]
        assert len(got) == 5
        for k, mbs in enumerate(got):
            want = replica_batches(src, "train", 30 + k * batch.size, 3, batch, dp, replica)
            assert len(mbs) == count == len(want)
            for (x, y), (wx, wy) in zip(mbs, want):
                assert torch.equal(x, wx) and torch.equal(y, wy) and len(x) == batch.micro


def test_epoch_permutation_is_drawn_once() -> None:
    from pipeengine.training.data import _permutation

    global_batch_indices(3_000_000, 32, 0, seed=11)  # draws epoch 0's order (~0.1 s: longer than a small step)
    misses = _permutation.cache_info().misses
    for step in range(1, 50):
        global_batch_indices(3_000_000, 32, step, seed=11)
    assert _permutation.cache_info().misses == misses
