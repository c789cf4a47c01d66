"""A torchvision ResNet (random init, no download) flattened into a layer list.

Layers: the stem (conv1, bn1, relu, maxpool), every residual block of layer1..layer4, and the head
(avgpool, flatten, fc): 10 layers for resnet18, 18 for resnet50. BatchNorm statistics are
computed per microbatch, so pipelined BatchNorm training is not bit-equal to one large batch;
``norm="group"`` swaps BatchNorm for GroupNorm, which makes it equal.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pipeengine.training.models import Model, pick_preset

from .data import ImageSource
from .presets import PRESETS

__all__ = ["model", "Config", "presets", "layer_factories", "build", "flatten", "loss_fn", "tied_parameters",
           "make_source"]


@dataclass
class Config:
    arch: str = "resnet18"   #: resnet18 or resnet50
    num_classes: int = 10
    image_size: int = 32     #: images are resized to image_size x image_size
    norm: str = "batch"      #: batch or group
    dropout: float = 0.0     #: before the classifier (torchvision's ResNet has none)

    def __post_init__(self) -> None:
        if self.arch not in ("resnet18", "resnet50"):
            raise ValueError(f"arch must be resnet18 or resnet50 (got {self.arch!r})")
        if self.norm not in ("batch", "group"):
            raise ValueError(f"norm must be batch or group (got {self.norm!r})")
        if self.num_classes < 2 or self.image_size < 8:
            raise ValueError(f"need num_classes >= 2 and image_size >= 8 (got {self.num_classes}, {self.image_size})")


def presets() -> dict[str, Callable[[], Config]]:
    return {name: functools.partial(Config, **kw) for name, kw in PRESETS["resnet"].items()}


def flatten(model: Any, dropout: float = 0.0) -> list[nn.Module]:
    """A torchvision ResNet as [stem, block, ..., block, head] (``dropout`` before the classifier, where
    the head's parameter names stay torchvision's)."""
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    flat = nn.Sequential(nn.Flatten(1), nn.Dropout(dropout)) if dropout else nn.Flatten(1)
    head = nn.Sequential(model.avgpool, flat, model.fc)
    return [stem, *blocks, head]


def _torchvision(cfg: Config) -> Any:
    import torchvision
    kw: dict[str, Any] = {"weights": None, "num_classes": cfg.num_classes}
    if cfg.norm == "group":
        kw["norm_layer"] = lambda c: nn.GroupNorm(32, c)
    return getattr(torchvision.models, cfg.arch)(**kw)


def _init(module: nn.Module) -> nn.Module:
    """torchvision's ResNet init for one block: He-normal convs, unit norms, default Linear."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()
        elif isinstance(m, nn.Linear):
            m.reset_parameters()
    return module


def _block(cfg: Config, index: int) -> nn.Module:
    """Block ``index`` alone: the network is laid out on ``meta`` (no memory), the block materialised
    on the default device (``meta`` too while the engine sizes the layers: then nothing is allocated)."""
    target = torch.get_default_device()
    with torch.device("meta"):
        block = flatten(_torchvision(cfg), cfg.dropout)[index]
    return _init(block.to_empty(device=target))


def layer_factories(cfg: Config) -> list[Callable[[], nn.Module]]:
    """One factory per flattened layer (10 for resnet18, 18 for resnet50), each building only its block."""
    n = 10 if cfg.arch == "resnet18" else 18
    return [functools.partial(_block, cfg, i) for i in range(n)]


def build(cfg: Config, seed: int = 0) -> list[nn.Module]:
    """The single-process model, with the weights the engine builds for the same seed."""
    from pipeengine.runtime.layers import build_layers
    return build_layers(layer_factories(cfg), seed)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def tied_parameters(num_layers: int) -> list[list[tuple[int, str]]]:
    return []


def make_source(cfg: Config, data_path: str | None) -> ImageSource:
    return ImageSource(data_path, cfg.image_size, cfg.num_classes)


def model(preset: str | None = None, data: str | None = None, dropout: float = 0.0) -> Model:
    """The trainer's protocol (``--model resnet``, see pipeengine/training/models.py): preset ``tiny`` by default;
    ``dropout`` (``--dropout``) before the classifier."""
    cfg = dataclasses.replace(pick_preset("resnet", presets(), preset, "tiny"), dropout=dropout)
    layers = layer_factories(cfg)
    return Model(layers, loss_fn, make_source(cfg, data), tied_parameters(len(layers)),
                 tokens_per_example=None, preset=preset or "tiny")
