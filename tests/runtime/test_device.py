"""Where the engine runs: CUDA whenever the group runs NCCL, alone or beside another backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeengine.runtime import device


@pytest.mark.parametrize("backend,want", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")])
def test_a_group_with_nccl_runs_the_engine_on_cuda(backend: str, want: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group made with several backends (``cpu:gloo,cuda:nccl``) once put the engine on the CPU silently.
    No GPU here: torch is told there is one."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device.default_device().type == want
