"""The engine's clock: timed records gathered from every rank (with or without a process group)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
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
