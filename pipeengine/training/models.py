"""Which model a run trains: a module of pipeengine.models by name, and what such a module provides.

A model module offers ``presets()`` (name -> a config factory), ``layer_factories(config)``,
``loss_fn(output, target)``, ``tied_parameters(num_layers)`` and ``make_source(config, data_path)``
(examples by index, see data.Source).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .config import Config

__all__ = ["ModelSpec", "load_model"]


@dataclass
class ModelSpec:
    """The model a config names: its module (models/), its config, its layer factories and its data."""

    module: Any
    config: Any
    factories: list[Any]
    source: Any

    @property
    def tokens_per_example(self) -> int | None:
        return int(getattr(self.config, "block_size", 0)) or None


def load_model(cfg: Config) -> ModelSpec:
    mod = importlib.import_module(f"pipeengine.models.{cfg.model.name}")
    presets = mod.presets()
    if cfg.model.preset not in presets:
        raise ValueError(f"--preset {cfg.model.preset!r} is not a {cfg.model.name} preset; choose "
                         f"{', '.join(presets)}")
    mcfg = presets[cfg.model.preset]()
    torch.manual_seed(cfg.model.seed)
    return ModelSpec(mod, mcfg, mod.layer_factories(mcfg), mod.make_source(mcfg, cfg.data.path))
