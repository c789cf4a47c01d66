"""The global batch does not follow the layout: its split over replicas and microbatches does."""

from __future__ import annotations

import pytest

from pipeengine.training.batch import Batch, resume_batch, split_global_batch


@pytest.mark.parametrize("dp, given, want", [
    (1, (None, None, None), Batch(32, 4, 8)),      # the default global batch, 4 microbatches when they divide
    (2, (None, None, None), Batch(32, 4, 4)),
    (8, (None, None, None), Batch(32, 4, 1)),
    (16, (None, None, None), Batch(32, 2, 1)),     # 2 examples per replica: 2 microbatches of 1
    (2, (None, 8, None), Batch(32, 8, 2)),
    (2, (None, None, 2), Batch(32, 8, 2)),
    (2, (None, 4, 2), Batch(16, 4, 2)),            # -m and -b without --global-batch choose the split themselves
    (2, (64, None, None), Batch(64, 4, 8)),
    (2, (64, 2, 16), Batch(64, 2, 16)),
])
def test_a_fresh_run_splits_the_global_batch(dp: int, given: tuple[int | None, int | None, int | None],
                                             want: Batch) -> None:
    assert split_global_batch(dp, *given) == want


def test_a_global_batch_that_cannot_split_names_the_flags() -> None:
    with pytest.raises(ValueError, match=r"the global batch \(32 by default\) does not split over dp 64 replicas; "
                                         r"pass --global-batch as a multiple of 64"):
        split_global_batch(64, None, None, None)


@pytest.mark.parametrize("dp, given, want, note", [
    (2, (None, None, None), Batch(32, 2, 8), "resuming with the checkpoint's global batch 32 = dp 2 x 2 "
                                             "microbatches x 8 (it was 4 x 8 per replica)"),
    (1, (None, None, None), Batch(32, 4, 8), None),
    (4, (None, 4, 4), Batch(32, 2, 4), "resuming with the checkpoint's global batch 32 = dp 4 x 2 microbatches "
                                       "x 4 (it was 4 x 8 per replica)"),   # the same command line as at dp 1
    (8, (None, None, None), Batch(32, 4, 1), "resuming with the checkpoint's global batch 32 = dp 8 x 4 "
                                             "microbatches x 1 (it was 4 x 8 per replica)"),   # 8 per microbatch
                                                                                               # cannot stay
    (2, (64, None, None), Batch(64, 4, 8), "global batch 32 -> 64 on resume (--global-batch): the run continues "
                                           "on another batch than the saved one"),
])
def test_a_resumed_run_keeps_the_saved_global_batch(dp: int, given: tuple[int | None, int | None, int | None],
                                                    want: Batch, note: str | None) -> None:
    assert resume_batch(dp, Batch(32, 4, 8), *given) == (want, note)


def test_a_saved_global_batch_that_cannot_split_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"the checkpoint's global batch 32 does not split over dp 3 replicas; "
                                         r"pass --global-batch \(a multiple of 3\)"):
        resume_batch(3, Batch(32, 4, 8), None, None, None)
