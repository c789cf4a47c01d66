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
