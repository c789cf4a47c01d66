"""The global batch and its split: global batch = microbatches x micro-batch size, spread over dp replicas.

The global batch is what the optimizer sees, so it does not follow the layout: by default it is
:data:`DEFAULT_GLOBAL_BATCH` (raised for a large world until every replica gets 2 x pp microbatches
of one example), and the microbatches follow from it. A dp that does not divide the microbatches
gives the first replicas one more (16 over dp 3: 6, 5, 5; [Note: uneven replicas] in
runtime/update.py). A resumed run keeps its checkpoint's global batch under another pp x dp unless
``--global-batch`` says otherwise, so an elastic group that shrank to any size goes on with it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Batch", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MICROBATCHES", "default_global_batch", "split_global_batch",
           "resume_batch"]

DEFAULT_GLOBAL_BATCH = 32
DEFAULT_MICROBATCHES = 4


class Batch(NamedTuple):
    """How many examples one optimizer step takes, and how: ``size`` examples in ``size // micro`` microbatches of
    ``micro``; ``microbatches`` is the most a replica takes (every replica's when dp divides them)."""

    size: int
    microbatches: int
    micro: int

    @property
    def total(self) -> int:
        """Microbatches per step over every replica."""
        return self.size // self.micro

    def counts(self, dp: int) -> list[int]:
        """Each replica's microbatches: the first ``total % dp`` replicas take one more."""
        return [self.total // dp + (r < self.total % dp) for r in range(dp)]

    def describe(self, dp: int) -> str:
        if self.total % dp == 0:
            return f"global batch {self.size} = dp {dp} x {self.microbatches} microbatches x {self.micro}"
        counts, extra = self.counts(dp), self.total % dp
        fuller = "replica 0" if extra == 1 else f"replicas 0-{extra - 1}"
        return (f"global batch {self.size} = {self.total} microbatches x {self.micro} over dp {dp} "
                f"({counts[0]} on {fuller}, {counts[-1]} on the others)")


def default_global_batch(dp: int, pp: int) -> int:
    """:data:`DEFAULT_GLOBAL_BATCH`, or more when the world is large: every replica 2 x pp microbatches of one."""
    return max(DEFAULT_GLOBAL_BATCH, dp * 2 * pp)


def _of(size: int, dp: int, micro: int) -> Batch | None:
    """``size`` in microbatches of ``micro`` over ``dp`` replicas; None if they do not divide or a replica gets none."""
    if micro < 1 or size % micro or size // micro < dp:
        return None
    return Batch(size, -(-(size // micro) // dp), micro)


def _fit(size: int, dp: int, microbatches: int | None, micro: int | None, target: int = DEFAULT_MICROBATCHES
         ) -> Batch | None:
    """``size`` over ``dp`` replicas keeping ``micro`` or, else, at most ``microbatches`` per replica (the largest
    microbatches that give that many); neither: at least ``target`` per replica where the batch allows, in the
    largest microbatches that do. None if it cannot."""
    if micro is not None:
        return _of(size, dp, micro)
    splits = [b for b in (_of(size, dp, d) for d in range(size, 0, -1)) if b is not None]   # largest first
    if microbatches is not None:
        return next((b for b in splits if b.microbatches == microbatches), None)
    return next((b for b in splits if b.total >= dp * target), splits[-1] if splits else None)


def split_global_batch(dp: int, size: int | None, microbatches: int | None, micro: int | None, pp: int = 1) -> Batch:
    """The batch of a fresh run from what the user gave (None: not given). ``-m`` and ``-b`` given without
    ``--global-batch`` choose the split per replica themselves (the global batch is then dp x m x b)."""
    if size is None and microbatches is not None and micro is not None:
        return Batch(dp * microbatches * micro, microbatches, micro)
    given = size is not None
    size = default_global_batch(dp, pp) if size is None else size
    if given and microbatches is not None and micro is not None:
        batch = _of(size, dp, micro)
        if batch is None or batch.microbatches != microbatches:
            raise ValueError(f"--global-batch {size} is not {microbatches} microbatches of --micro-batch-size {micro} "
                             f"on each of dp {dp} replicas (the first ones may take one more); give two of the three")
        return batch
    batch = _fit(size, dp, microbatches, micro, max(DEFAULT_MICROBATCHES, 2 * pp))
    if batch is None or (microbatches is not None and batch.microbatches != microbatches):
        raise ValueError(_cannot_split(size, dp, microbatches, micro, given))
    return batch


def _cannot_split(size: int, dp: int, microbatches: int | None, micro: int | None, given: bool,
                  what: str = "") -> str:
    what = what or (f"--global-batch {size}" if given else f"the global batch ({size} by default)")
    if size < dp:
        return (f"{what} has fewer examples than dp {dp} has replicas; pass --global-batch {dp} or more (each "
                f"replica takes at least one microbatch)")
    if micro is not None:
        return (f"{what} is not a whole number of microbatches of --micro-batch-size {micro} for dp {dp} replicas "
                f"(at least one each); pass a --micro-batch-size dividing {size}, or another --global-batch")
    choices = sorted({b.microbatches for b in (_of(size, dp, d) for d in range(1, size + 1)) if b is not None})
    return (f"{what} cannot be cut into equal microbatches with {microbatches} on the fullest of dp {dp} replicas; "
            f"--microbatches {', '.join(map(str, choices))} can, or pass another --global-batch")


def resume_batch(dp: int, saved: Batch, size: int | None, microbatches: int | None, micro: int | None,
                 pp: int = 1) -> tuple[Batch, str | None]:
    """The batch of a run resumed from a checkpoint trained with ``saved``, and a line saying what was kept.

    Without ``--global-batch`` the saved global batch is kept, cut as the user says (``-b``, ``-m``), else in
    the checkpoint's micro-batch size while that leaves the replicas as many microbatches as before (or the
    default's ``max(4, 2 pp)``: a pipeline keeps its fill), else in the checkpoint's microbatches per replica,
    else as a fresh run would be; replicas may take one microbatch more than others. Only a global batch with
    fewer examples than replicas is an error.
    """
    if size is not None:   # the user asks for another global batch
        batch = split_global_batch(dp, size, microbatches, micro, pp)
        note = None if batch.size == saved.size else (
            f"global batch {saved.size} -> {batch.size} on resume (--global-batch): the run continues on "
            f"another batch than the saved one")
        return batch, note
    target = max(DEFAULT_MICROBATCHES, 2 * pp)
    same_micro = _fit(saved.size, dp, None, saved.micro)
    if same_micro is not None and same_micro.microbatches < min(saved.microbatches, target):
        same_micro = None   # fewer microbatches than the pipeline had: a smaller micro-batch size first
    asked = [(m, b) for m, b in ((microbatches, micro), (None, micro), (microbatches, None))
             if (m, b) != (None, None)]
    both = [b for b in (_fit(saved.size, dp, m, mb) for m, mb in asked) if b is not None
            and (microbatches is None or b.microbatches == microbatches or b.micro == micro)]
    kept = (both[0] if both else None) or same_micro or _fit(saved.size, dp, saved.microbatches, None) \
        or _fit(saved.size, dp, None, None, target)
    if kept is None:
        raise ValueError(f"the checkpoint's global batch {saved.size} has fewer examples than dp {dp} has replicas; "
                         f"pass --global-batch (at least {dp}) to continue on another batch")
    dropped = [f"{flag} {v}" for flag, v, have in (("--microbatches", microbatches, kept.microbatches),
                                                   ("--micro-batch-size", micro, kept.micro))
               if v is not None and v != have]
    if kept == saved and not dropped:
        return kept, None
    unkept = f"; {' and '.join(dropped)} cannot hold with it at dp {dp}" if dropped else ""
    return kept, (f"resuming with the checkpoint's {kept.describe(dp)} (it was {saved.total} microbatches of "
                  f"{saved.micro}){unkept}")
