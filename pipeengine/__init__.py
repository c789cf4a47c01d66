"""pipeengine: pipeline-parallel (PP x DP) training for PyTorch with schedules as verified data.

Layers (imports point down): ``training`` (config, trainer, data, checkpoints, reporting) ->
``runtime`` (topology, plan, engine, stage, wire, gradient sync, faults) -> ``schedule`` (pure
Python: actions, builders, lowering, the validator, the simulator).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["PipelineEngine", "Topology", "Plan", "make_plan", "build_schedule", "compile_schedule", "simulate",
           "Costs", "Model", "Packing", "save_checkpoint", "load_checkpoint", "export_checkpoint"]

# The example models live in the top-level models/ folder and install as pipeengine.models
# (setup.cfg maps the package there); run from a source tree, find them beside this package.
_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "models")) and os.path.isfile(os.path.join(_here, "..", "models", "gpt.py")):
    __path__.append(os.path.dirname(_here))  # noqa: F821 - this package's own search path

# Names load on first use, so that the schedule tools and ``--help`` stay torch-free.
_LAZY = {"PipelineEngine": "runtime.engine", "Topology": "runtime.topology", "Plan": "runtime.plan",
         "make_plan": "runtime.plan", "build_schedule": "schedule", "compile_schedule": "schedule",
         "simulate": "schedule", "Costs": "schedule", "Model": "training.models", "Packing": "training.packing",
         "save_checkpoint": "training.checkpoint:save", "load_checkpoint": "training.checkpoint:load",
         "export_checkpoint": "training.export:export"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, _, attr = _LAZY[name].partition(":")
        return getattr(importlib.import_module(f".{module}", __name__), attr or name)
    raise AttributeError(f"module 'pipeengine' has no attribute {name!r}")
