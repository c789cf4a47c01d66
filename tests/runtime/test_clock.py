"""The engine's clock: timed records gathered from every rank (with or without a process group)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import weakref
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from pipeengine.runtime.clock import ActionRecord, gather_records
from tests.training.test_reporting import R


def test_gather_without_process_group_is_single_rank() -> None:
    assert not dist.is_initialized()
    assert gather_records(R[0]) == {0: R[0]}


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gather_through_gloo_rebuilds_records(single_rank_group: None) -> None:
    out = gather_records(R[0])
    assert out == {0: R[0]}
    assert out is not None and all(type(r) is ActionRecord for r in out[0])
    assert gather_records([]) == {0: []}       # a rank with nothing recorded still appears


def test_a_steps_records_are_made_when_read_and_the_next_step_leaves_them_as_they_were() -> None:
    """``later()`` keeps the step's stamps for a caller who reads them after the next step began (the trainer's
    reporter, every few steps), and holds no reference to the clock (so none to the engine); ``end()`` is the last
    stamp, the step's end (the SYNC record's); a StepResult makes its records once, on the first read, and every
    dataclass way of reading them reads them made."""
    from pipeengine.runtime.clock import ActionClock, Phase
    from pipeengine.runtime.results import StepResult
    clock = ActionClock(3, torch.device("cpu"))
    clock.start()
    a = clock.mark()
    clock.add(0, Phase.F, 0, a, clock.mark())
    clock.add(0, Phase.SYNC, -1, clock.mark(), clock.mark())
    made = clock.later()
    end = clock.end()
    clock.start()   # the next step
    clock.add(0, Phase.F, 1, clock.mark(), clock.mark())
    records = made()
    assert [(r.rank, r.kind, r.microbatch) for r in records] == [(3, Phase.F, 0), (3, Phase.SYNC, -1)]
    assert end == max(r.end for r in records) and 0 <= records[0].start < records[0].end <= end
    alive = weakref.ref(clock)
    del clock
    gc.collect()
    assert alive() is None and made() == records
    calls = []
    result = StepResult(loss=0.0)
    result.records_later(lambda: calls.append(1) or records)
    assert result.records == records and result.records is result.records and calls == [1]
    for read in (pickle.loads(pickle.dumps(result)), copy.deepcopy(result), dataclasses.replace(result, loss=1.0)):
        assert read.records == records
    lazy = StepResult(loss=0.0)
    lazy.records_later(lambda: list(records))
    assert lazy == result and dataclasses.asdict(lazy)["records"] == records
    assert StepResult(loss=0.0, records=records).records is records   # the field as it was
