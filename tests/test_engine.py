"""Pipeline = single process: pp x dp training gives the losses and parameters of one process.

Every configuration also evaluates once after training (forward-only schedule) and must give the
single-process evaluation loss.

Each spawned world runs many configurations in turn (spawning is the slow part on 2 cores).
Tolerance: float64 everywhere, rtol=1e-9 / atol=1e-12 (the pipeline sums the same numbers in
a different order, nothing else differs).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from pipeengine.schedule import Kind, ScheduleError, compile_schedule, validate
from tests.harness import run_distributed

GLOBAL_BATCH = 16
STEPS = 3
DIM = 8
RTOL, ATOL = 1e-9, 1e-12


# ------------------------------------------------------------------ models and data

def mlp_layers(seed: int = 0, n: int = 10) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) if i < n - 1 else nn.Linear(DIM, 1))
    return layers


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


class Embed(nn.Module):
    """(tokens) -> (hidden float, mask int64): a tuple activation."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, DIM)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(tokens), (tokens % 3 != 0).long()


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x   # one argument, as nn.Sequential passes it
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1).to(h.dtype) + h, mask


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = x
        return self.head((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


def tuple_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed()] + [Masked() for _ in range(6)] + [Pool()]


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = (5, 9, 7)[step % 3]   # the sequence length changes every step
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, 11, (GLOBAL_BATCH, seq), generator=g)
    return tokens, tokens.double().mean(1, keepdim=True).cos()


MODELS = {"mlp": (mlp_layers, batch), "tuple": (tuple_layers, token_batch)}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}


def reference(model: str, opt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the full global batch."""
    torch.set_default_dtype(torch.float64)
    build, data = MODELS[model]
    layers = build()
    net = nn.Sequential(*layers)
    optim = OPTIMIZERS[opt](list(net.parameters()))
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = nn.functional.mse_loss(net(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    with torch.no_grad():   # evaluation after training, on a batch never trained on
        x, y = data(99)
        losses.append(nn.functional.mse_loss(net(x), y).item())
    return losses, {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers)
                    for k, v in layer.state_dict().items()}


# ------------------------------------------------------------------ the pipelined side

def replica_iter(data: Any, step: int, replica: int, dp: int, m: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data(step)
    per = GLOBAL_BATCH // dp
    x, y = x[replica * per:(replica + 1) * per], y[replica * per:(replica + 1) * per]
    b = per // m
    return iter([(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(m)])


def run_config(model: str, opt: str, schedule: str, pp: int, dp: int, m: int, chunks: int = 1,
               wire: str = "strict") -> dict[str, Any]:
    from pipeengine.engine import PipelineEngine
    from pipeengine.topology import Topology
    torch.set_default_dtype(torch.float64)
    build, data = MODELS[model]
    layers = build()
    engine = PipelineEngine(layers, nn.functional.mse_loss, OPTIMIZERS[opt], topology=Topology(pp=pp, dp=dp),
                            schedule=schedule, microbatches=m, chunks=chunks, timeout=60,
                            wire="tags" if wire == "tags" else "strict")
    engine.wire.coalesce = wire == "coalesced"   # the NCCL path (one batch_isend_irecv per step) on Gloo
    losses, peaks = [], []
    for step in range(STEPS):
        result = engine.train_batch(replica_iter(data, step, engine.replica, dp, m))
        losses.append(result.loss)
        peaks.append(result.peak_stored)
    ev = engine.eval_batch(replica_iter(data, 99, engine.replica, dp, m), return_outputs=True)
    losses.append(ev.loss)   # the reference appends its evaluation loss the same way
    if ev.outputs is not None:
        assert len(ev.outputs) == m and all(o.shape[0] == GLOBAL_BATCH // dp // m for o in ev.outputs)
    params = {}
    for ch in engine.chunks:
        start = engine.bounds[ch.stage]
        for j, layer in enumerate(ch.module.layers):
            for k, v in layer.state_dict().items():
                params[f"{start + j}.{k}"] = v.detach().clone()
    return {"losses": losses, "params": params, "peaks": peaks, "stages": [c.stage for c in engine.chunks],
            "replica": engine.replica}


def worker(rank: int, world: int, configs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [run_config(*cfg) for cfg in configs]


def check(results: list[list[dict[str, Any]]], configs: list[tuple[Any, ...]]) -> None:
    refs: dict[tuple[str, str], tuple[list[float], dict[str, torch.Tensor]]] = {}
    for i, cfg in enumerate(configs):
        model, opt, schedule, pp, dp, m = cfg[:6]
        if (model, opt) not in refs:
            refs[(model, opt)] = reference(model, opt)
        ref_losses, ref_params = refs[(model, opt)]
        seen: set[str] = set()
        for rank_results in results:
            r = rank_results[i]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                       msg=lambda e: f"{cfg} losses: {e}")
            for k, v in r["params"].items():
                torch.testing.assert_close(v, ref_params[k], rtol=RTOL, atol=ATOL, msg=lambda e: f"{cfg} {k}: {e}")
                seen.add(k)
        assert seen == set(ref_params), f"{cfg}: parameters {set(ref_params) - seen} missing from every rank"


def stage_peaks(results: list[list[dict[str, Any]]], i: int) -> dict[int, int]:
    peaks: dict[int, int] = {}
    for rank_results in results:
        for step_peaks in rank_results[i]["peaks"]:
            for stage, p in step_peaks.items():
                peaks[stage] = max(peaks.get(stage, 0), p)
    return peaks


# ------------------------------------------------------------------ tests

WORLD2 = [(model, opt, sched, 2, 1, 4) for model in ("mlp",) for opt in ("sgd", "adam")
          for sched in ("gpipe", "1f1b", "zb-h1")] + [
    ("mlp", "adam", "interleaved-1f1b", 2, 1, 4, 2),
    ("mlp", "sgd", "1f1b", 1, 2, 4), ("mlp", "adam", "gpipe", 1, 2, 4),
    ("tuple", "adam", "1f1b", 2, 1, 4), ("tuple", "sgd", "gpipe", 2, 1, 2),
    ("mlp", "sgd", "interleaved-1f1b", 2, 1, 4, 2, True), ("tuple", "adam", "1f1b", 2, 1, 4, 1, True)]


@pytest.mark.timeout(300)
def test_world2_pp2_and_dp2_equal_single_process() -> None:
    results = run_distributed(worker, 2, WORLD2, timeout=280)
    check(results, WORLD2)


WORLD4 = [(model, opt, sched, pp, dp, m) for (pp, dp, m) in ((4, 1, 8), (2, 2, 4)) for model in ("mlp",)
          for opt in ("sgd", "adam") for sched in ("gpipe", "1f1b")] + [("mlp", "adam", "zb-h1", 4, 1, 8),
                                                                        ("mlp", "sgd", "1f1b", 4, 1, 8, 1, True)]


@pytest.mark.timeout(400)
def test_world4_pp4_and_pp2dp2_equal_single_process_and_memory_bound() -> None:
    results = run_distributed(worker, 4, WORLD4, timeout=380)
    check(results, WORLD4)
    for i, cfg in enumerate(WORLD4):
        sched, pp, dp, m = cfg[2:6]
        peaks = stage_peaks(results, i)
        if sched == "1f1b":
            assert peaks == {s: min(pp - s, m) for s in range(pp)}, (WORLD4[i], peaks)
        if sched == "gpipe":
            assert peaks == {s: m for s in range(pp)}, (WORLD4[i], peaks)
    # DP: replicas of a stage hold identical parameters, different stages hold different ones
    i = WORLD4.index(("mlp", "sgd", "1f1b", 2, 2, 4))
    by_rank = [r[i] for r in results]
    for a in by_rank:
        for b in by_rank:
            if a["stages"] == b["stages"]:
                for k in a["params"]:
                    assert torch.equal(a["params"][k], b["params"][k])
            else:
                assert not set(a["params"]) & set(b["params"])


WORLD8 = [("mlp", "adam", "1f1b", 4, 2, 8), ("mlp", "sgd", "gpipe", 4, 2, 8)]


@pytest.mark.timeout(400)
def test_world8_pp4_dp2_equals_single_process() -> None:
    results = run_distributed(worker, 8, WORLD8, timeout=380)
    check(results, WORLD8)


# ------------------------------------------------------------------ faults

def mismatched_worker(rank: int, world: int) -> str:
    from pipeengine.engine import PipelineEngine
    from pipeengine.topology import Topology
    torch.set_default_dtype(torch.float64)
    sched = compile_schedule("1f1b", 2, 2)
    if rank == 1:  # rank 1 posts the receive of microbatch 1 before that of microbatch 0
        prog = sched.programs[1]
        i = next(i for i, st in enumerate(prog) if any(a.kind is Kind.RECV_F and a.microbatch == 1 for a in st))
        sched.programs[1] = [prog[i]] + prog[:i] + prog[i + 1:]
    engine = PipelineEngine(mlp_layers(), nn.functional.mse_loss, OPTIMIZERS["sgd"], topology=Topology(2, 1),
                            schedule=sched, timeout=3, validate_schedule=False)
    try:
        engine.train_batch(replica_iter(batch, 0, 0, 1, 2))
    except Exception as exc:  # the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_mismatched_p2p_order_times_out_naming_the_action() -> None:
    results = run_distributed(mismatched_worker, 2, timeout=50)
    assert "recvF1<0 on rank 1" in results[1], results
    assert "Timeout" in results[1] or "timed out" in results[1], results
    assert results[0] != "no error", results


def test_the_validator_rejects_that_mismatch_before_any_process_starts() -> None:
    sched = compile_schedule("1f1b", 2, 2)
    prog = sched.programs[1]
    i = next(i for i, st in enumerate(prog) if any(a.kind is Kind.RECV_F and a.microbatch == 1 for a in st))
    sched.programs[1] = [prog[i]] + prog[:i] + prog[i + 1:]
    with pytest.raises(ScheduleError, match=r"not in paired order"):
        validate(copy.deepcopy(sched))
