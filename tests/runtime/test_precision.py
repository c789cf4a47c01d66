"""Low precision: one weight cast per step (not per microbatch in flight), the boundary keeps the model's dtype."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.bf16_weights import saved_storages
from pipeengine.runtime.engine import PipelineEngine

MIB = 2**20


def saved_bytes_of_a_step(engine: PipelineEngine, data: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of the distinct storages autograd saves for backward during one step (parameters left out)."""
    saved, hooks = saved_storages({p.untyped_storage().data_ptr() for p in engine.parameters})
    with hooks:
        engine.train_batch(iter(data))
    return sum(saved.values())


def test_bf16_casts_each_weight_once_per_step_whatever_is_in_flight(one_process_group: None) -> None:
    """Four Linear(1024, 1024), four microbatches of 8 rows in flight (GPipe): fp32 saves only activations;
    bf16 once saved a bf16 copy of the weights per microbatch (4 x 6 MiB), now one (6 MiB)."""
    torch.manual_seed(0)
    k, rows = 4, 8
    data = [(torch.randn(rows, 1024), torch.randn(rows, 1024)) for _ in range(k)]
    sizes = {}
    for precision in ("fp32", "bf16"):
        layers = [nn.Linear(1024, 1024) for _ in range(4)]
        engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                                schedule="gpipe", microbatches=k, precision=precision)
        sizes[precision] = saved_bytes_of_a_step(engine, data)
        assert engine.peak_stored == {0: k}
    # every weight once, in bf16, but the first layer's (its input needs no gradient, so its weight is not saved)
    weight_copy = 3 * 1024 * 1024 * 2
    activations = sizes["fp32"]                # what k microbatches in flight save in fp32 (0.75 MiB)
    assert activations <= 1 * MIB, sizes
    assert weight_copy <= sizes["bf16"] <= weight_copy + activations, {p: s / MIB for p, s in sizes.items()}
