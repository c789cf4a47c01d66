"""The global batch and its split: global batch = dp x microbatches x micro-batch size (torch-free).

The global batch is what the optimizer sees, so it does not follow the layout: by default it is
:data:`DEFAULT_GLOBAL_BATCH` whatever pp x dp the run has, and the microbatches per replica follow
from it. A resumed run keeps its checkpoint's global batch under another pp x dp (more or fewer
microbatches per replica) unless ``--global-batch`` says otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Batch", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MICROBATCHES", "split_global_batch", "resume_batch"]

DEFAULT_GLOBAL_BATCH = 32
DEFAULT_MICROBATCHES = 4


class Batch(NamedTuple):
    """How many examples one optimizer step takes, and how: ``size == dp * microbatches * micro``."""

    size: int
    microbatches: int
    micro: int

    def describe(self, dp: int) -> str:
        return f"global batch {self.size} = dp {dp} x {self.microbatches} microbatches x {self.micro}"


def _fit(size: int, dp: int, microbatches: int | None, micro: int | None) -> Batch | None:
    """``size`` over ``dp`` replicas keeping ``microbatches`` (or ``micro``) as given; None if it does not divide."""
    per = size // dp if size % dp == 0 else 0
    if microbatches is not None:
        return Batch(size, microbatches, per // microbatches) if per and per % microbatches == 0 else None
    if micro is not None:
        return Batch(size, per // micro, micro) if per and per % micro == 0 else None
    if not per:
        return None
    m = next(d for d in range(DEFAULT_MICROBATCHES, 0, -1) if per % d == 0)   # 4 when it divides
    return Batch(size, m, per // m)


def split_global_batch(dp: int, size: int | None, microbatches: int | None, micro: int | None) -> Batch:
    """The batch of a fresh run from what the user gave (None: not given). ``-m`` and ``-b`` given without
    ``--global-batch`` choose the split per replica themselves (the global batch is then dp x m x b)."""
    if size is None and microbatches is not None and micro is not None:
        return Batch(dp * microbatches * micro, microbatches, micro)
    given = size is not None
    size = DEFAULT_GLOBAL_BATCH if size is None else size
    if given and microbatches is not None and micro is not None:
        if size != dp * microbatches * micro:
            raise ValueError(f"--global-batch {size} is not dp {dp} x --microbatches {microbatches} x "
                             f"--micro-batch-size {micro} = {dp * microbatches * micro}; give two of the three")
        return Batch(size, microbatches, micro)
    batch = _fit(size, dp, microbatches, micro)
    if batch is None:
        raise ValueError(_cannot_split(size, dp, microbatches, micro, given))
    return batch


def _cannot_split(size: int, dp: int, microbatches: int | None, micro: int | None, given: bool) -> str:
    what = f"--global-batch {size}" if given else f"the global batch ({size} by default)"
    if microbatches is not None:
        return (f"{what} does not split into dp {dp} x --microbatches {microbatches} equal microbatches; pass "
                f"--global-batch as a multiple of {dp * microbatches}, or another --microbatches")
    if micro is not None:
        return (f"{what} does not split into dp {dp} x microbatches of --micro-batch-size {micro}; pass "
                f"--global-batch as a multiple of {dp * micro}, or another --micro-batch-size")
    return f"{what} does not split over dp {dp} replicas; pass --global-batch as a multiple of {dp}"


def resume_batch(dp: int, saved: Batch, size: int | None, microbatches: int | None,
                 micro: int | None) -> tuple[Batch, str | None]:
    """The batch of a run resumed from a checkpoint trained with ``saved``, and a line saying what was kept.

    Without ``--global-batch`` the saved global batch is kept: the micro-batch size stays (the given one,
    else the checkpoint's) and the microbatches per replica follow; failing that the microbatches stay and
    the micro-batch size follows. A global batch that cannot be kept is an error naming the flags.
    """
    if size is not None:   # the user asks for another global batch
        batch = split_global_batch(dp, size, microbatches, micro)
        note = None if batch.size == saved.size else (
            f"global batch {saved.size} -> {batch.size} on resume (--global-batch): the run continues on "
            f"another batch than the saved one")
        return batch, note
    kept = (_fit(saved.size, dp, None, micro if micro is not None else saved.micro)
            or _fit(saved.size, dp, microbatches if microbatches is not None else saved.microbatches, None)
            or _fit(saved.size, dp, None, None))
    if kept is None:
        raise ValueError(f"the checkpoint's global batch {saved.size} does not split over dp {dp} replicas; "
                         f"pass --global-batch (a multiple of {dp}) to continue on another batch")
    if kept == saved:
        return kept, None
    return kept, (f"resuming with the checkpoint's {kept.describe(dp)} (it was {saved.microbatches} x "
                  f"{saved.micro} per replica)")
