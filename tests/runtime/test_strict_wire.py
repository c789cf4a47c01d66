"""NCCL's semantics on Gloo (strict wire): a valid hand-written schedule runs; an unpaired one hangs, explained."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pipeengine.schedule import parse_schedule
from tests.harness import run_distributed
from tests.runtime.equivalence import OPTIMIZERS, batch, mlp_layers, replica_iter
from tests.schedule.test_verify import HAND_WRITTEN, OUT_OF_ORDER


def out_of_order_worker(rank: int, world: int) -> list[str]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    torch.set_default_dtype(torch.float64)
    engine = PipelineEngine(mlp_layers(), nn.functional.mse_loss, OPTIMIZERS["sgd"], topology=Topology(2, 1),
                            schedule=parse_schedule(HAND_WRITTEN), timeout=20, wire="strict")
    hand = f"{engine.train_batch(replica_iter(batch, 0, 0, 1, 2)).loss:.6f}"   # first: before any failure
    out = []
    for wire in ("tags", "strict"):
        engine = PipelineEngine(mlp_layers(), nn.functional.mse_loss, OPTIMIZERS["sgd"], topology=Topology(2, 1),
                                schedule=parse_schedule(OUT_OF_ORDER), timeout=3, validate_schedule=False, wire=wire)
        try:
            out.append(f"{engine.train_batch(replica_iter(batch, 0, 0, 1, 2)).loss:.6f}")
        except Exception as exc:  # the test asserts on the message
            out.append(f"{type(exc).__name__}: {exc}")
    return [*out, hand]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_out_of_order_schedule_hangs_in_strict_mode_and_a_hand_written_one_runs() -> None:
    """(The validator rejects the first and proves the second: schedule/test_verify.py.)"""
    (tags0, strict0, hand0), (tags1, strict1, hand1) = run_distributed(out_of_order_worker, 2, timeout=50)
    # a valid hand-written schedule runs in strict mode and computes the same step
    assert hand0 == hand1 == tags0, (hand0, hand1, tags0)
    # Gloo's tag matching lets it through (so tags mode alone proves nothing) ...
    assert tags0 == tags1 and not tags0.startswith(("P2P", "Runtime")), (tags0, tags1)
    # ... NCCL's per-peer order does not: each rank waits for the other. The first to time out
    # assembles the wait-for report; both ranks end with it (the other one in its own timeout, or,
    # if it reached its wait late on a loaded machine, as the peer failure it learns of first)
    assert any(t.startswith("P2PTimeout: rank ") for t in (strict0, strict1)), (strict0, strict1)
    for text in (strict0, strict1):
        assert text.startswith(("P2PTimeout: rank ", "PeerFailed: pipeengine: wait-for report")), text
    report = strict0[strict0.index("pipeengine: wait-for report"):]
    assert report == strict1[strict1.index("pipeengine: wait-for report"):]
    assert "2 of 2 ranks answered" in report
    lines = {r: re.search(rf"rank {r} \(position {r}, replica 0, step 0\): (.*)", report) for r in (0, 1)}
    assert lines[0] and re.fullmatch(r"waits [\d.]+ s in recvB0<1 for rank\(s\) 1|runs \S+", lines[0][1]), report
    assert lines[1] and re.fullmatch(r"waits [\d.]+ s in recvF1<0 for rank\(s\) 0|runs \S+", lines[1][1]), report
    if all(m[1].startswith("waits") for m in lines.values() if m):
        assert "cycle: rank 0 -> rank 1 -> rank 0" in report
