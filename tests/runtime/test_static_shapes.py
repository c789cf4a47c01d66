"""Static training shapes (``static_shapes=True``, ``--static-shapes``; [Note: static training shapes] in
runtime/wire.py): after the first training step no header goes between stages in a training step, the results are
the default's to the bit, eval steps keep their headers, and a changed shape or microbatches of shapes of their own
are refused with a message that says so, the peer stopped, no hang."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import WorldPool, run_distributed
from tests.runtime.equivalence import DIM, mlp_layers


def _data(rows: int = 4, step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(rows, DIM, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(4)]


def _headers(log: list[tuple[str, str, int, int, int]]) -> list[str]:
    return sorted({action for action, *_ in log if action.startswith(("sendH", "recvH"))})


def _train(rank: int, world: int, static: bool, wire: str) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    with PipelineEngine(mlp_layers(0, 4), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                        topology=Topology(2, 1), microbatches=4, wire=wire, static_shapes=static) as engine:
        losses, headers = [], []
        for step in range(3):
            engine.wire.log = []
            losses.append(engine.train_batch(iter(_data(step=step))).loss)
            headers.append(_headers(engine.wire.log))
        engine.wire.log = []
        losses.append(engine.eval_batch(iter(_data(step=9))).loss)
        headers.append(_headers(engine.wire.log))
        return {"losses": losses, "headers": headers, "params": [p.detach().clone() for p in engine.parameters]}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("wire", ["tags", "strict"])
def test_no_header_after_the_first_training_step_and_the_same_results(world2: WorldPool, wire: str) -> None:
    static = world2.run(_train, True, wire, timeout=80)
    default = world2.run(_train, False, wire, timeout=80)
    for rank, (s, d) in enumerate(zip(static, default)):
        header = ["sendH0>1"] if rank == 0 else ["recvH0<0"]
        assert d["headers"] == [header] * 4, d["headers"]               # every step, by default
        assert s["headers"] == [header, [], [], header], s["headers"]   # the first training step and the eval step
        assert s["losses"] == d["losses"]
        assert all(torch.equal(a, b) for a, b in zip(s["params"], d["params"]))


def _refused(rank: int, world: int, case: str, out: str) -> str:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    with PipelineEngine(mlp_layers(0, 4), nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                        topology=Topology(2, 1), microbatches=4, static_shapes=True, timeout=20) as engine:
        engine.watch.kill_after = 0.2   # rank 1, blocked in its receive once rank 0 failed: stopped sooner
        engine.train_batch(iter(_data()))
        data = _data(rows=2) if case == "changed" else [_data(rows=r)[0] for r in (4, 3, 4, 2)]
        try:
            engine.train_batch(iter(data))
        except Exception as exc:   # noqa: BLE001 - what the rank that read the data is told (the trainer prints it)
            with open(f"{out}.{rank}", "w") as fh:
                fh.write(f"{type(exc).__name__}: {exc}")
            engine.watch.mark_shown()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["changed", "ragged"])
def test_a_changed_shape_is_refused_and_the_peer_stops(tmp_path: Any, case: str) -> None:
    out = str(tmp_path / "error.txt")
    try:
        run_distributed(_refused, 2, case, out, timeout=100)
    except RuntimeError as exc:   # rank 1, blocked in its receive, stopped by its watch
        assert re.search(r"ranks \[1\] died without reporting \(exit codes \[\w+, 2\]\)", str(exc)), exc
    else:   # or it heard of rank 0's failure first and raised it too: either way no hang
        with open(f"{out}.1") as fh:
            assert "static training shapes (--static-shapes)" in fh.read()
    with open(f"{out}.0") as fh:
        text = fh.read()
    if case == "changed":
        assert text == ("ValueError: static training shapes (--static-shapes): stage 0's output is (float32[2, 8]), "
                        "in the first training step (float32[4, 8]); give every training step's microbatches one "
                        "shape (pad them) or leave static shapes off"), text
    else:
        assert text == ("ValueError: static training shapes (--static-shapes): the microbatches of this step have "
                        "shapes of their own ([4, 8], [3, 8], [4, 8], [2, 8]); pad them to one shape or leave static "
                        "shapes off"), text
