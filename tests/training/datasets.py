"""Models whose data is a torch Dataset or an IterableDataset (``--model tests.training.datasets:FUNCTION``): the
mlp's layers and examples, given the way users hold their data."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, TensorDataset

from pipeengine.training.models import Model, load_model


def _mlp() -> tuple[Model, Any]:
    built = load_model("mlp", None, None)
    return built, built.data


def mapstyle(preset: str | None, data: str | None) -> Model:
    """A TensorDataset of the mlp's examples, and one to validate on: the same examples as ``--model mlp``."""
    built, src = _mlp()
    split = {s: TensorDataset(src.x[s], src.y[s]) for s in ("train", "val")}
    return Model(built.layers, built.loss_fn, split["train"], val_data=split["val"])


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The mlp's training examples in a fixed order, again and again (a stream has no index)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.x, self.y)


def streamed(preset: str | None, data: str | None) -> Model:
    built, src = _mlp()
    return Model(built.layers, built.loss_fn, Stream(src.x["train"][:200], src.y["train"][:200]))


def dicts(preset: str | None, data: str | None) -> Model:
    """A dataset giving dicts (as Hugging Face datasets do): refused in one line."""
    built, src = _mlp()
    return Model(built.layers, built.loss_fn, [{"x": x, "y": y} for x, y in zip(src.x["train"], src.y["train"])])


def three(preset: str | None, data: str | None) -> Model:
    """A layer factory that returns 3: one line, not a traceback from inside the engine."""
    built, _ = _mlp()
    return Model([built.layers[0], lambda: 3, *built.layers[2:]], built.loss_fn, built.data)
