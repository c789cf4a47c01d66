"""No hidden syncs ([Note: no hidden syncs] in runtime/device.py): the host reads what the device computed only
through the watch, a fixed number of times per step, whatever the model's depth and the number of microbatches."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import ROOT, WorldPool

RUNTIME = ROOT / "pipeengine" / "runtime"
# A host read of device values, or a device tensor built from host values by a blocking copy.
SYNCS = re.compile(r"\.item\(|\.tolist\(|\.cpu\(|\.numpy\(|torch\.tensor\(|\.synchronize\(")
# Where one is right, and why (file -> the lines' text that may hold one).
ALLOWED = {
    "faults.py": ["return t.tolist()",                   # Watch.host_values: the watched read itself
                  '"""``t.tolist()``: on CUDA only once',   # its docstring
                  "submit(event.synchronize)"],          # Watch.poll: blocks in the waiter thread, watched
    "device.py": ["``torch.tensor(values, device=cuda)``",   # the note
                  "return torch.tensor(values, dtype=dtype, device=device)",   # constant() on CPU
                  "return torch.tensor(values, dtype=dtype).pin_memory()",     # constant() on CUDA: pinned
                  "torch.cuda.synchronize(device)"],     # device.synchronize: the start-up profile only
    "state.py": ['torch.tensor(e.step_count)', 'torch.tensor(e.loss_scale.value', 'torch.tensor(e.loss_scale.good',
                 'torch.tensor(0)', 'torch.tensor(1.0, dtype'],   # checkpoint counters: CPU tensors, at a save
    "tensors.py": [".cpu().contiguous()", "flat.numpy()"],        # a checkpoint's checksums, at a save
    "release.py": ["torch.cuda.synchronize(device)"],            # engine.close(): before its groups go
    "stage.py": ['"made with .item() or torch.tensor(...)'],       # an error message
}


def test_the_runtime_reads_the_device_only_through_the_watch() -> None:
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SYNCS.search(line) and not any(ok in line for ok in ALLOWED.get(path.name, [])):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert not found, ("host syncs outside the watch (use faults.Watch.host_values or device.constant):\n"
                       + "\n".join(found))


def _reads(rank: int, world: int, depth: int, microbatches: int, zero: bool) -> list[int]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.manual_seed(0)
    layers = [lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth)]
    with PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                        topology=Topology(2, world // 2), schedule="1f1b", microbatches=microbatches,
                        shard_optimizer=zero) as engine:
        data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(microbatches)]
        counts = []
        for _ in range(3):
            before = engine.watch.device_reads
            engine.train_batch(iter(data))
            counts.append(engine.watch.device_reads - before)
        before = engine.watch.device_reads
        engine.eval_batch(iter(data))
        counts.append(engine.watch.device_reads - before)
    return counts


@pytest.mark.parametrize("zero", [False, True], ids=["unsharded", "zero1"])
def test_device_reads_per_step_do_not_grow_with_layers_or_microbatches(world4: WorldPool, zero: bool) -> None:
    """pp 2 x dp 2: every rank reads the same fixed number of times per step at 4 or 8 layers and 2 or 8
    microbatches: a stream's shape header (a position that receives one), then one read for the step's signals,
    its loss over the replicas and which parameters got gradients (the gradient sync's flags; ZeRO-1's); an eval
    step, its header and its loss."""
    runs: dict[tuple[int, int], Any] = {}
    for depth, m in [(4, 2), (8, 2), (4, 8)]:
        runs[(depth, m)] = world4.run(_reads, depth, m, zero)
    first = runs[(4, 2)]
    assert all(run == first for run in runs.values()), runs
    for rank, counts in enumerate(first):
        header = 1 if rank in (2, 3) else 0                # position 1 (ranks 2, 3) receives the activations
        assert counts == [header + 1] * 4, (rank, counts)
