"""A deep residual MLP as a layer list, for quick runs; data from a fixed random teacher."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pipeengine.training.models import Model, pick_preset

from .data import SyntheticRegression
from .presets import PRESETS

__all__ = ["model", "Config", "presets", "layer_factories", "build", "loss_fn", "tied_parameters", "make_source"]


@dataclass
class Config:
    in_dim: int = 32      #: input features
    hidden: int = 128     #: width of every hidden block
    depth: int = 8        #: residual blocks between the input and output layers
    out_dim: int = 8      #: regression targets
    dropout: float = 0.0  #: after each block's activation

    def __post_init__(self) -> None:
        for k in ("in_dim", "hidden", "depth", "out_dim"):
            if getattr(self, k) < 1:
                raise ValueError(f"mlp {k} must be >= 1 (got {getattr(self, k)})")


def presets() -> dict[str, Callable[[], Config]]:
    return {name: functools.partial(Config, **kw) for name, kw in PRESETS["mlp"].items()}


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc(self.norm(x)))
        return x + (torch.nn.functional.dropout(h, self.dropout, self.training) if self.dropout else h)


def layer_factories(cfg: Config) -> list[Callable[[], nn.Module]]:
    """Input projection, ``depth`` residual blocks, output head: depth + 2 layers, each built on its own."""
    return ([lambda: nn.Linear(cfg.in_dim, cfg.hidden)]
            + [lambda: Block(cfg.hidden, cfg.dropout) for _ in range(cfg.depth)]
            + [lambda: nn.Sequential(nn.LayerNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.out_dim))])


def build(cfg: Config, seed: int = 0) -> list[nn.Module]:
    """The single-process model, with the weights the engine builds for the same seed."""
    from pipeengine.runtime.layers import build_layers
    return build_layers(layer_factories(cfg), seed)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def tied_parameters(num_layers: int) -> list[list[tuple[int, str]]]:
    return []


def make_source(cfg: Config, data_path: str | None) -> SyntheticRegression:
    if data_path is not None:
        raise ValueError("the mlp trains on synthetic data; --data is for gpt (text) and resnet (images)")
    return SyntheticRegression(cfg.in_dim, cfg.out_dim)


def model(preset: str | None = None, data: str | None = None, dropout: float = 0.0) -> Model:
    """The trainer's protocol (``--model mlp``, see pipeengine/training/models.py): preset ``tiny`` by default;
    ``dropout`` (``--dropout``) after each block's activation."""
    cfg = dataclasses.replace(pick_preset("mlp", presets(), preset, "tiny"), dropout=dropout)
    layers = layer_factories(cfg)
    return Model(layers, loss_fn, make_source(cfg, data), tied_parameters(len(layers)),
                 tokens_per_example=None, preset=preset or "tiny")
