"""The global batch does not follow the layout: its split over replicas and microbatches does."""

from __future__ import annotations

import pytest

from pipeengine.training.batch import Batch, resume_batch, split_global_batch


@pytest.mark.parametrize("dp, pp, given, want", [
    (1, 1, (None, None, None), Batch(32, 4, 8)),      # the default global batch, 4 microbatches when they divide
    (2, 1, (None, None, None), Batch(32, 4, 4)),
    (8, 1, (None, None, None), Batch(32, 4, 1)),
    (16, 1, (None, None, None), Batch(32, 2, 1)),     # 2 examples per replica: 2 microbatches of 1
    (64, 1, (None, None, None), Batch(128, 2, 1)),    # a large world raises the default: 2 x pp per replica
    (1, 4, (None, None, None), Batch(32, 8, 4)),      # a deeper pipeline gets at least 2 x pp microbatches
    (2, 8, (None, None, None), Batch(32, 16, 1)),
    (3, 8, (None, None, None), Batch(48, 16, 1)),     # slurm.sbatch on 3 nodes (pp 8)
    (64, 8, (None, None, None), Batch(1024, 16, 1)),  # and on 64
    (3, 1, (None, None, None), Batch(32, 6, 2)),      # dp 3: 16 microbatches of 2, as 6, 5, 5
    (3, 2, (None, None, 4), Batch(32, 3, 4)),         # 8 of 4: 3, 3, 2
    (3, 1, (None, 3, None), Batch(32, 3, 4)),
    (2, 1, (None, 8, None), Batch(32, 8, 2)),
    (2, 1, (None, None, 2), Batch(32, 8, 2)),
    (2, 1, (None, 4, 2), Batch(16, 4, 2)),            # -m and -b without --global-batch choose the split themselves
    (2, 1, (64, None, None), Batch(64, 4, 8)),
    (2, 1, (64, 2, 16), Batch(64, 2, 16)),
    (127, 8, (1024, None, None), Batch(1024, 9, 1)),  # 1024 GPUs at pp 8 after losing a node: 9 or 8 each
])
def test_a_fresh_run_splits_the_global_batch(dp: int, pp: int, given: tuple[int | None, int | None, int | None],
                                             want: Batch) -> None:
    assert split_global_batch(dp, *given, pp=pp) == want


@pytest.mark.parametrize("dp, given, match", [
    (64, (32, None, None), r"--global-batch 32 has fewer examples than dp 64 has replicas; pass --global-batch 64 "),
    (3, (32, 4, None), r"--global-batch 32 cannot be cut into equal microbatches with 4 on the fullest of dp 3 "
                       r"replicas; --microbatches 2, 3, 6, 11 can"),
    (3, (32, None, 5), r"--global-batch 32 is not a whole number of microbatches of --micro-batch-size 5"),
])
def test_a_global_batch_that_cannot_split_names_the_flags(dp: int, given: tuple[int | None, int | None, int | None],
                                                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_global_batch(dp, *given)


@pytest.mark.parametrize("dp, given, want, note", [
    (2, (None, None, None), Batch(32, 4, 4), "resuming with the checkpoint's global batch 32 = dp 2 x 4 "
                                             "microbatches x 4 (it was 4 microbatches of 8)"),   # 4 per replica kept
    (1, (None, None, None), Batch(32, 4, 8), None),
    (4, (None, 4, 4), Batch(32, 2, 4), "resuming with the checkpoint's global batch 32 = dp 4 x 2 microbatches "
                                       "x 4 (it was 4 microbatches of 8); --microbatches 4 cannot hold with it at "
                                       "dp 4"),   # the same command line as at dp 1: -b holds
    # 8 per microbatch cannot stay
    (8, (None, None, None), Batch(32, 4, 1), "resuming with the checkpoint's global batch 32 = dp 8 x 4 "
                                             "microbatches x 1 (it was 4 microbatches of 8)"),
    (3, (None, None, None), Batch(32, 6, 2), "resuming with the checkpoint's global batch 32 = 16 microbatches x 2 "
                                             "over dp 3 (6 on replica 0, 5 on the others) (it was 4 microbatches "
                                             "of 8)"),
    (2, (64, None, None), Batch(64, 4, 8), "global batch 32 -> 64 on resume (--global-batch): the run continues "
                                           "on another batch than the saved one"),
])
def test_a_resumed_run_keeps_the_saved_global_batch(dp: int, given: tuple[int | None, int | None, int | None],
                                                    want: Batch, note: str | None) -> None:
    assert resume_batch(dp, Batch(32, 4, 8), *given) == (want, note)


def test_a_saved_global_batch_goes_on_at_any_dp_and_refuses_only_fewer_examples_than_replicas() -> None:
    assert resume_batch(3, Batch(32, 4, 8), None, None, 4) == (   # -b 4 given: 8 microbatches as 3, 3, 2
        Batch(32, 3, 4), "resuming with the checkpoint's global batch 32 = 8 microbatches x 4 over dp 3 (3 on "
                         "replicas 0-1, 2 on the others) (it was 4 microbatches of 8)")
    assert resume_batch(3, Batch(32, 4, 2), None, None, None, pp=2)[0] == Batch(32, 6, 2)   # 8 -> 6 ranks at pp 2
    with pytest.raises(ValueError, match=r"the checkpoint's global batch 32 has fewer examples than dp 33 has "
                                         r"replicas; pass --global-batch \(at least 33\)"):
        resume_batch(33, Batch(32, 4, 8), None, None, None)


def test_a_resume_honours_the_split_asked_for_or_says_which_flag_cannot_hold() -> None:
    assert resume_batch(3, Batch(32, 4, 8), None, 6, 2)[0] == Batch(32, 6, 2)   # 16 of 2 over dp 3: 6, 5, 5
    batch, note = resume_batch(3, Batch(32, 4, 8), None, 8, 2)   # an elastic restart keeps its flags: -b holds
    assert batch == Batch(32, 6, 2) and note is not None and note.endswith("; --microbatches 8 cannot hold with it "
                                                                           "at dp 3"), note
