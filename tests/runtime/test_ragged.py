"""Microbatches of their own shapes in one step ([Note: ragged microbatches] in runtime/wire.py): the shapes ride in
the header the step sends anyway: the same messages and device reads as fixed shapes, results equal to one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeengine.models import gpt
from pipeengine.runtime.header import RAGGED_DIMS, TensorMeta, decode_header, encode_header, follow, shape_table
from tests.harness import WorldPool, run_distributed
from tests.runtime.equivalence import early_receives, posted

CFG = gpt.Config(block_size=24, n_layer=4, n_head=2, n_embd=16)
IGNORE = -100


def test_shape_table_and_follow() -> None:
    same = [torch.zeros(2, 8, dtype=torch.long)] * 3
    assert shape_table(same) is None   # one shape: the header is what it always was
    table = shape_table([torch.zeros(2, 8), (torch.zeros(3, 5), torch.zeros(1)), torch.zeros(1, 9)])
    assert table == ((2, 8), (3, 5), (1, 9))   # a tuple input: its first tensor's shape
    metas = (TensorMeta((2, 8, 16), torch.float32), TensorMeta((2, 8), torch.int64), TensorMeta((16,), torch.float32),
             TensorMeta((2, 4), torch.float32))
    assert follow(metas, table, 0, 2) == (TensorMeta((1, 9, 16), torch.float32), TensorMeta((1, 9), torch.int64),
                                          TensorMeta((16,), torch.float32), TensorMeta((2, 4), torch.float32))
    h = encode_header(True, metas, table=table, microbatches=3)
    assert decode_header(h) == (True, metas, table)
    assert decode_header(encode_header(False, metas, microbatches=3)) == (False, metas, None)
    with pytest.raises(ValueError, match="one number of dimensions"):
        shape_table([torch.zeros(2, 8), torch.zeros(2, 8, 1)])
    with pytest.raises(ValueError, match=f"at most {RAGGED_DIMS}"):
        shape_table([torch.zeros((1,) * 5), torch.zeros((2,) * 5)])


def _microbatches(layout: str, seed: int) -> list[tuple[Any, Any]]:
    """Four microbatches of shapes of their own: ``ragged`` [rows, width] token rows padded at the end, ``packed``
    (tokens, positions, segments) rows of the context with several documents each; targets (labels, weight)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    shapes = [(3, 24), (1, 7), (5, 11), (2, 24)] if layout == "ragged" else [(2, 24), (4, 24), (1, 24), (3, 24)]
    for rows, width in shapes:
        tokens = torch.randint(0, 256, (rows, width), generator=g)
        labels = torch.randint(0, 256, (rows, width), generator=g)
        labels[0, width // 2:] = IGNORE   # padding after the first row's sequence
        weight = torch.tensor(4 / 150.0)
        if layout == "ragged":
            out.append((tokens, (labels, weight)))
            continue
        cut = width // 3   # two documents per row: positions restart, segments 0 and 1
        pos = torch.cat([torch.arange(cut), torch.arange(width - cut)]).expand(rows, width).clone()
        seg = torch.cat([torch.zeros(cut), torch.ones(width - cut)]).long().expand(rows, width).clone()
        out.append(((tokens, pos, seg), (labels, weight)))
    return out


def _reference(layout: str) -> tuple[float, dict[str, torch.Tensor]]:
    layers = gpt.build(CFG, seed=0)
    total = torch.zeros(())
    for x, y in _microbatches(layout, 1):
        for layer in layers:
            x = layer(x)
        total = total + gpt.loss_fn(x, y) / 4
    total.backward()
    grads = {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()
             if p.grad is not None}
    return float(total.detach()), grads


def _ragged(rank: int, world: int, layout: str, schedule: str, wire: str) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    factories = gpt.layer_factories(CFG)
    with PipelineEngine(factories, gpt.loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.0), topology=Topology(2, 1),
                        schedule=schedule, microbatches=4, tied=gpt.tied_parameters(len(factories)), wire=wire,
                        seed=0) as engine:
        engine.wire.log = []
        fixed_reads = engine.watch.device_reads
        fixed = engine.train_batch(iter([_microbatches(layout, 1)[0]] * 4))   # one shape, the same layout
        fixed_reads, fixed_ops = engine.watch.device_reads - fixed_reads, len(engine.wire.log)
        engine.wire.log = []
        for st in engine.stages:
            for p in st.module.parameters():
                p.grad = None
        reads = engine.watch.device_reads
        res = engine.train_batch(iter(_microbatches(layout, 1)))
        reads = engine.watch.device_reads - reads
        grads = {f"{st.index}:{n}": p.grad.clone() for st in engine.stages for n, p in st.module.named_parameters()
                 if p.grad is not None}
        assert fixed.loss == fixed.loss
        early = early_receives(*posted(engine.program, engine.wire.log)) if wire == "tags" else 0
        return {"loss": res.loss, "grads": grads, "reads": (fixed_reads, reads),
                "ops": (fixed_ops, len(engine.wire.log)), "bounds": engine.bounds, "early": early}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,schedule,wire", [("ragged", "1f1b", "strict"), ("packed", "zbv", "tags"),
                                                  ("ragged", "interleaved-zb", "tags")])
def test_microbatches_of_their_own_shapes_cost_no_message_and_equal_one_process(
        world2: WorldPool, layout: str, schedule: str, wire: str) -> None:
    loss, grads = _reference(layout)
    got = world2.run(_ragged, layout, schedule, wire)
    assert got[0]["loss"] == pytest.approx(loss, rel=1e-5) and got[1]["loss"] == got[0]["loss"]
    for r in got:
        assert r["reads"][0] == r["reads"][1], r["reads"]   # no host read more than with fixed shapes
        assert r["ops"][0] == r["ops"][1], r["ops"]           # no message more
    # tags mode: receives of each microbatch's own shape went one comm step early (wire.py), and the results hold
    assert (sum(r["early"] for r in got) > 0) == (wire == "tags"), [r["early"] for r in got]
    seen = 0
    for r in got:   # every parameter's gradient, wherever it lives, against one process's
        for key, g in r["grads"].items():
            stage, name = key.split(":")
            _, local, rest = name.split(".", 2)   # layers.<index in the stage>.<parameter>
            layer = r["bounds"][int(stage)] + int(local)
            torch.testing.assert_close(g, grads[f"{layer}.{rest}"], rtol=1e-4, atol=1e-6)
            seen += 1
    assert seen >= len(grads)


class Transpose(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t()


def _off_contract(rank: int, world: int, out: str) -> str:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    layers = [lambda: Transpose(), lambda: torch.nn.Linear(3, 1)]   # [rows, 5] -> [5, rows]: neither rule
    with PipelineEngine(layers, lambda o, t: o.sum(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                        topology=Topology(2, 1), microbatches=2, timeout=20) as engine:
        engine.watch.kill_after = 0.2   # rank 1, blocked in its receive once rank 0 failed: stopped sooner
        try:
            engine.train_batch(iter([(torch.ones(3, 5), None), (torch.ones(1, 5), None)]))
        except Exception as exc:   # noqa: BLE001 - what the sender is told (the trainer prints it; the peer stops)
            with open(out, "w") as fh:
                fh.write(f"{type(exc).__name__}: {exc}")
            engine.watch.mark_shown()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_output_that_follows_neither_rule_is_named_and_the_peer_stops(tmp_path: Any) -> None:
    out = str(tmp_path / "error.txt")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died without reporting \(exit codes \[\w+, 2\]\)"):
        run_distributed(_off_contract, 2, out, timeout=80)   # rank 1, blocked in its receive, stopped: no hang
    with open(out) as fh:
        text = fh.read()
    assert text.startswith("ValueError: stage 0 output for microbatch 1 is (float32[5, 1]), but its input shape [1, 5] "
                           "makes it (float32[5, 3])"), text
    assert "either starts with the microbatch's input shape or keeps one shape" in text, text


def test_a_rank_without_inputs_learns_the_table_from_the_header() -> None:
    assert shape_table([None, None]) is None   # the last stage's rank reads (None, target) pairs
    assert shape_table([(None, torch.zeros(2, 3)), (None, torch.zeros(1, 3))]) == ((2, 3), (1, 3))
