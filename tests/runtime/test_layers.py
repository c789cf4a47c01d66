"""Layer lists: fingerprints that tell which layer differs between ranks."""

from __future__ import annotations

import torch
from torch import nn

from pipeengine.runtime.layers import fingerprint, model_mismatch


def test_model_mismatch_names_the_first_differing_layer_and_the_ranks() -> None:
    f32 = torch.float32
    a = [fingerprint(nn.Linear(8, 16, dtype=f32)), fingerprint(nn.Linear(16, 4, dtype=f32))]
    b = [fingerprint(nn.Linear(8, 16, dtype=f32)), fingerprint(nn.Linear(16, 5, dtype=f32))]
    assert model_mismatch([(0, a), (0, a)]) is None
    assert model_mismatch([(0, a), (0, a), (0, b)]) == (
        "the ranks were given different models: layer 1 is Linear(weight (4, 16), bias (4,)) on ranks 0, 1 but "
        "Linear(weight (5, 16), bias (5,)) on rank 2; every rank must be given the same layer list (same code, "
        "model, preset and seed)")
    short = str(model_mismatch([(0, a), (0, a[:1])]))
    assert "layer lists of different length: 2 on rank 0 but 1 on rank 1 layers" in short
    assert "different seeds: 0 on rank 0 but 1 on rank 1" in str(model_mismatch([(0, a), (1, a)]))
