"""pipeengine: pipeline-parallel (PP x DP) training for PyTorch with schedules as verified data."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["compile_schedule", "simulate", "Costs", "PipelineEngine", "Topology"]

# Names load on first use: `python -m pipeengine.schedule` must not find its own module imported
# already, and the schedule tools stay torch-free.
_LAZY = {"compile_schedule": "schedule", "simulate": "simulate", "Costs": "simulate",
         "PipelineEngine": "engine", "Topology": "topology"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipeengine' has no attribute {name!r}")
