"""pipeengine: pipeline-parallel (PP x DP) training for PyTorch with schedules as verified data."""

from __future__ import annotations

import importlib
from typing import Any

from .schedule import Costs, compile_schedule, simulate

__all__ = ["compile_schedule", "simulate", "Costs", "PipelineEngine", "Topology"]

# Torch-dependent names load on first use so `python -m pipeengine.schedule` stays torch-free.
_LAZY = {"PipelineEngine": "engine", "Topology": "topology"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipeengine' has no attribute {name!r}")
