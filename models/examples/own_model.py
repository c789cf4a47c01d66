"""Your own model and data from the command line: ``--model own_model:model`` (this file's ``model`` function).

    cd models/examples && ../../launch/pipe.sh 2 cpus --model own_model:model --steps 200
    cd models/examples && ../../launch/pipe.sh 2 cpus --model own_model:model --data points.csv --preset wide

The trainer imports ``own_model`` (the current folder is on the path; elsewhere put its folder on
``PYTHONPATH`` or install it) and calls ``model(preset, data)`` with ``--preset`` and ``--data``.
The function returns a :class:`pipeengine.Model`: layer factories, a loss, and a data source that
gives examples by index. Everything else (pp x dp, schedules, checkpoints, logs) is the trainer's.
"""

from __future__ import annotations

import csv

import torch
from torch import nn

import pipeengine

WIDTHS = {"narrow": 64, "wide": 256}


class Points:
    """Points of the plane labelled 1 inside a ring and 0 elsewhere (no straight line splits them), made here; or
    rows of a CSV file ``x,y,label``. Examples by index: the trainer draws every step's global batch from these."""

    def __init__(self, path: str | None, size: int = 4096) -> None:
        if path is None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.rand(size, 2, generator=g) * 2 - 1
            radius = self.x.norm(dim=1)
            self.y = ((radius > 0.35) & (radius < 0.75)).long()
        else:
            try:
                with open(path, newline="") as fh:
                    rows = [r for r in csv.reader(fh) if r]
                self.x = torch.tensor([[float(a), float(b)] for a, b, _ in rows])
                self.y = torch.tensor([int(c) for _, _, c in rows])
            except (OSError, ValueError) as exc:   # shown to the user as one line
                raise ValueError(f"--data {path!r}: expected rows x,y,label (0 or 1): {exc}") from None
            if len(rows) < 10:
                raise ValueError(f"--data {path!r} has {len(rows)} rows; give at least 10")
        self.cut = len(self.y) * 9 // 10     # the last tenth is the validation split

    def num_examples(self, split: str) -> int:
        return self.cut if split == "train" else len(self.y) - self.cut

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = index if split == "train" else self.cut + index
        return self.x[i], self.y[i]


def model(preset: str | None, data: str | None) -> pipeengine.Model:
    """``--preset narrow`` (default) or ``wide``; ``--data`` a CSV of x,y,label rows (default: made here)."""
    if (preset or "narrow") not in WIDTHS:
        raise ValueError(f"--preset {preset!r} is not one of {', '.join(WIDTHS)}")
    w = WIDTHS[preset or "narrow"]
    layers = [lambda: nn.Linear(2, w), lambda: nn.GELU()]
    for _ in range(4):
        layers += [lambda: nn.Linear(w, w), lambda: nn.GELU()]
    layers.append(lambda: nn.Linear(w, 2))
    return pipeengine.Model(layers=layers, loss_fn=nn.functional.cross_entropy, data=Points(data),
                            preset=preset or "narrow")
