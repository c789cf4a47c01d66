"""pipeengine: pipeline-parallel (PP x DP) training for PyTorch with schedules as verified data."""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["compile_schedule", "simulate", "Costs", "PipelineEngine", "Topology"]

# The example models live in the top-level models/ folder and install as pipeengine.models
# (setup.cfg maps the package there); run from a source tree, find them beside this package.
_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "models")) and os.path.isfile(os.path.join(_here, "..", "models", "gpt.py")):
    __path__.append(os.path.dirname(_here))  # noqa: F821 - this package's own search path

# Names load on first use: `python -m pipeengine.schedule` must not find its own module imported
# already, and the schedule tools stay torch-free.
_LAZY = {"compile_schedule": "schedule", "simulate": "simulate", "Costs": "simulate",
         "PipelineEngine": "engine", "Topology": "topology"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipeengine' has no attribute {name!r}")
