"""Shared fixtures: worlds of Gloo ranks kept for the whole session (see harness.WorldPool)."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

# Tests import the harness as `tests.harness`; make the repo root importable when pytest runs from anywhere.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from tests.harness import WorldPool  # noqa: E402
from tests.schedule import background  # noqa: E402


@pytest.hookimpl(trylast=True)   # after -k and -m deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The schedule sweep's pps start checking in the background (tests/schedule/background.py), the largest first."""
    background.start(sorted((item.callspec.params["pp"] for item in items  # type: ignore[attr-defined]
                             if item.originalname == "test_every_builder_validates_and_simulates"),  # type: ignore
                            reverse=True))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    background.stop()


def _pool(world_size: int) -> Iterator[WorldPool]:
    pool = WorldPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def world1() -> Iterator[WorldPool]:
    """One Gloo rank in a process of its own (the engine at pp = 1, dp = 1, beside the others)."""
    yield from _pool(1)


@pytest.fixture(scope="session")
def world2() -> Iterator[WorldPool]:
    """Two Gloo ranks, reused by every test that asks (only for calls that leave the group healthy)."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def world4() -> Iterator[WorldPool]:
    yield from _pool(4)


@pytest.fixture(scope="session")
def world8() -> Iterator[WorldPool]:
    yield from _pool(8)


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A Gloo group of this process alone (for the engine in one process), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()
