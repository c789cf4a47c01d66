"""The engine's clock: timed records gathered from every rank (with or without a process group)."""

from __future__ import annotations

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


def test_the_step_ends_at_the_last_stamp_and_its_records_count_from_the_start() -> None:
    """``end()`` is the last stamp marked, the step's end (the SYNC record's, the records' latest end)."""
    from pipeengine.runtime.clock import ActionClock, Phase
    clock = ActionClock(3, torch.device("cpu"))
    clock.start()
    a = clock.mark()
    clock.add(0, Phase.F, 0, a, clock.mark())
    clock.add(0, Phase.SYNC, -1, clock.mark(), clock.mark())
    end = clock.end()
    records = clock.records()
    assert [(r.rank, r.kind, r.microbatch) for r in records] == [(3, Phase.F, 0), (3, Phase.SYNC, -1)]
    assert end == max(r.end for r in records) and 0 <= records[0].start < records[0].end <= end
