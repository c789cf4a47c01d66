"""Pipeline = single process, in NCCL-like strict mode: pp x dp training gives one process's losses and parameters.

Every configuration also evaluates once after training (forward-only schedule) and must give the
single-process evaluation loss, and records the ops it posts: they must be exactly its position's
validated program (headers included), step by step. One configuration is one test.
"""

from __future__ import annotations

import pytest
import torch

from pipeengine.schedule import compile_schedule
from pipeengine.schedule.simulate import stage_peaks as simulated_stage_peaks
from tests.runtime.equivalence import DIM, GLOBAL_BATCH, Case, case, check, run_case, stage_peaks

INTERLEAVED_TIE = {"chunks": 2, "partition": (0, 2, 4, 7, 10)}   # layers 0 and 4 both at position 0
TWO = {"chunks": 2}
SMALL_BUCKETS = {"bucket_mb": 1e-4}

WORLD2: list[Case] = [
    *[case("mlp", opt, sched, 2, 1, 4) for opt in ("sgd", "adam") for sched in ("gpipe", "1f1b", "zb-h1")],
    case("mlp", "adam", "interleaved-1f1b", 2, 1, 4, **TWO),
    case("factories", "adam", "1f1b", 2, 1, 4), case("factories", "sgd", "interleaved-1f1b", 2, 1, 4, **TWO),
    case("mlp", "sgd", "1f1b", 1, 2, 4), case("mlp", "adam", "gpipe", 1, 2, 4),
    case("tuple", "adam", "1f1b", 2, 1, 4), case("tuple", "sgd", "gpipe", 2, 1, 2),
    case("tuple", "adam", "zb-h1", 2, 1, 2),
    case("tied", "adam", "1f1b", 1, 2, 4), case("tied", "sgd", "interleaved-1f1b", 2, 1, 4, **INTERLEAVED_TIE),
    case("tied", "adam", "1f1b", 2, 1, 4),
    # V placement: the first and the last stage (and a tie between them) on position 0, the turn local
    case("mlp", "adam", "zbv", 2, 1, 4, **TWO), case("tied", "adam", "zbv", 2, 1, 4, **TWO),
    # DualPipeV: full and split backwards in one schedule (a B without its W is the full backward)
    case("tied", "adam", "dualpipev", 2, 1, 8, **TWO),
    # synthesised (synth.py): zero-bubble H2, interleaved zero bubble, V with controllable memory
    case("mlp", "adam", "zb-h2", 2, 1, 4), case("mlp", "sgd", "interleaved-zb", 2, 1, 4, **TWO),
    case("mlp", "adam", "v-half", 2, 1, 4, **TWO), case("tied", "adam", "v-min", 2, 1, 4, **TWO),
    # the Gloo fast path (a tag per transfer) and the NCCL path (coalesced steps) give the same results
    case("mlp", "sgd", "interleaved-1f1b", 2, 1, 4, wire="coalesced", **TWO),
    case("tuple", "adam", "1f1b", 2, 1, 4, wire="coalesced"), case("tuple", "adam", "zb-h1", 2, 1, 4, wire="tags"),
    # bf16: every schedule end to end, activations on the wire in bf16
    *[case("mlp", "adam", sched, 2, 1, 4, precision="bf16", **(TWO if sched.startswith("inter") else {}))
      for sched in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")],
    # DP all-reduce inside backward (default) == after it, bitwise; many small buckets
    *[case("tied", "adam", "1f1b", 1, 2, 4, overlap_grad_sync=o, **SMALL_BUCKETS) for o in (True, False)],
    # dropout: each layer's masks keyed to (layer, global microbatch, step), equal to one process drawing the same
    case("dropout", "adam", "1f1b", 2, 1, 4), case("dropout", "sgd", "zb-h1", 1, 2, 2),
    case("dropout", "adam", "zbv", 2, 1, 4, recompute="full", **TWO),
    # the second stage's first op is in place (on the received input), as it may be unpipelined
    *[case("inplace", "adam", sched, 2, 1, 4, partition=(0, 5, 10)) for sched in ("1f1b", "zb-h1")],
]
WORLD4: list[Case] = [
    *[case("mlp", opt, sched, pp, dp, m) for (pp, dp, m) in ((4, 1, 8), (2, 2, 4))
      for opt in ("sgd", "adam") for sched in ("gpipe", "1f1b")],
    case("mlp", "adam", "zb-h1", 4, 1, 8), case("factories", "adam", "zb-h1", 4, 1, 8),
    case("mlp", "sgd", "interleaved-1f1b", 2, 2, 4, **TWO),
    case("tuple", "adam", "interleaved-1f1b", 4, 1, 4, **TWO),
    case("mlp", "sgd", "zbv", 2, 2, 4, **TWO), case("tuple", "adam", "zbv", 4, 1, 8, **TWO),
    case("mlp", "adam", "v-half", 4, 1, 8, **TWO), case("tuple", "adam", "zb-h2", 4, 1, 8),
    case("mlp", "adam", "interleaved-zb", 2, 2, 4, **TWO),
    case("mlp", "adam", "dualpipev", 2, 2, 8, **TWO, **SMALL_BUCKETS),   # in-backward all-reduce after a full B or W
    # a selective stage's gradients are final after its B (its W does nothing): the all-reduce posts them there
    case("mlp", "sgd", "zb-h1", 2, 2, 4, recompute="selective", overlap_grad_sync=False, **SMALL_BUCKETS),
    case("mlp", "sgd", "1f1b", 4, 1, 8, wire="tags"),
    case("dropout", "adam", "interleaved-1f1b", 2, 2, 2, **TWO), case("dropout", "adam", "dualpipev", 4, 1, 8, **TWO),
    *[c.but(overlap_grad_sync=o, **SMALL_BUCKETS) for o in (True, False)
      for c in (case("mlp", "sgd", "1f1b", 2, 2, 4), case("mlp", "adam", "zb-h1", 2, 2, 4),
                case("mlp", "sgd", "interleaved-1f1b", 2, 2, 4, **TWO))],
]
WORLD8: list[Case] = [case("mlp", "adam", "1f1b", 4, 2, 8), case("mlp", "sgd", "gpipe", 4, 2, 8),
                      *[case("mlp", "adam", "1f1b", 4, 2, 8, overlap_grad_sync=o, **SMALL_BUCKETS)
                        for o in (True, False)]]
RECOMPUTE: list[Case] = [   # bitwise equal to none, with dropout, split B/W and interleaved stages
    case("dropout", "adam", sched, 2, 1, 4, recompute=rc, **(TWO if sched.startswith("inter") else {}))
    for sched in ("1f1b", "zb-h1", "interleaved-1f1b") for rc in ("none", "full", "every:1", "selective")]
BN = case("bn", "sgd", "1f1b", 1, 2, 2)
BN_RECOMPUTE = [case("bn", "sgd", sched, 2, 1, 4, recompute=rc) for sched in ("1f1b", "zb-h1")
                for rc in ("none", "full", "every:1", "selective")]


def results(c: Case, request: pytest.FixtureRequest) -> list[dict]:  # type: ignore[type-arg]
    return run_case(c, request.getfixturevalue(f"world{c.world}"))


def _marks(c: Case) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if c.world == 8 else []


@pytest.mark.parametrize("c", [pytest.param(c, id=str(c), marks=_marks(c)) for c in WORLD2 + WORLD4 + WORLD8])
def test_equals_single_process(c: Case, request: pytest.FixtureRequest) -> None:
    rs = results(c, request)
    check(rs, c)
    peaks = stage_peaks(rs)
    compiled = compile_schedule(c.schedule, c.pp, c.m, c.options.get("chunks"))
    # live = simulated; a "selective" stage runs its whole backward in B, which then frees it (recompute.py)
    simulated = simulated_stage_peaks(compiled, frozenset() if c.options.get("recompute") == "selective" else None)
    assert peaks == simulated, (peaks, simulated)
    if c.schedule == "1f1b" and not c.options.get("chunks"):   # 1F1B holds min(pp - s, m) at stage s
        assert peaks == {s: min(c.pp - s, c.m) for s in range(c.pp)}, peaks
    if c.schedule == "gpipe":
        assert peaks == {s: c.m for s in range(c.pp)}, peaks
    if c.options.get("precision") == "bf16":   # activations and gradients travel in bf16: 2 bytes per element
        sizes = {n for a, _, _, _, n in rs[0]["log"] if a.startswith(("sendF", "recvB"))}
        assert sizes == {GLOBAL_BATCH // 4 * DIM * 2}, sizes


TWINS = [c for c in WORLD2 + WORLD4 + WORLD8 if c.options.get("overlap_grad_sync") is False]


@pytest.mark.parametrize("c", [pytest.param(c, id=str(c), marks=_marks(c)) for c in TWINS])
def test_grad_sync_inside_backward_is_bitwise_the_one_after_it(c: Case, request: pytest.FixtureRequest) -> None:
    """The twin posted every bucket from inside backward (its parameters all get gradients)."""
    after, inside = results(c, request), results(c.but(overlap_grad_sync=True), request)
    for a, b in zip(after, inside):
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert all(torch.equal(b["params"][name], v) for name, v in a["params"].items())
        early, buckets = b["buckets"]
        assert buckets > 1 and early == buckets, (early, buckets)
        assert a["buckets"][0] == 0


@pytest.mark.parametrize("sched", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_recompute_changes_nothing_bit_for_bit_with_dropout(sched: str, request: pytest.FixtureRequest) -> None:
    runs = [results(c, request) for c in RECOMPUTE if c.schedule == sched]
    for rank_runs in zip(*runs):
        base = rank_runs[0]
        assert base["losses"][0] != base["losses"][1]
        losses = [r["losses"] for r in rank_runs]
        assert all(x == base["losses"] for x in losses), losses
        for other in rank_runs[1:]:
            assert all(torch.equal(other["params"][name], v) for name, v in base["params"].items())


def test_tied_copies_on_one_rank_stay_two_and_equal(request: pytest.FixtureRequest) -> None:
    """Both ends of a tie on one rank keep a copy each (their gradients summed in tie order, as across ranks:
    see [Note: tied copies are summed in tie order]), and stay bit-identical."""
    tied = results(case("tied", "adam", "1f1b", 1, 2, 4), request)
    untied = results(case("mlp", "sgd", "1f1b", 1, 2, 4), request)
    assert tied[0]["num_params"] == untied[0]["num_params"]
    for r in tied:
        assert torch.equal(r["params"]["0.0.weight"], r["params"]["4.0.weight"])


def test_batchnorm_statistics_are_replica_0s_on_every_replica(request: pytest.FixtureRequest) -> None:
    b0, b1 = (r["buffers"] for r in results(BN, request))
    assert b0 and all(torch.equal(b0[n], b1[n]) for n in b0)


@pytest.mark.parametrize("sched", ["1f1b", "zb-h1"])
def test_recompute_moves_batchnorm_statistics_once(sched: str, request: pytest.FixtureRequest) -> None:
    """Running statistics and num_batches_tracked after the steps equal the run without recompute, with the
    fused backward and with the split one (whose W recomputes once more)."""
    runs = [results(c, request) for c in BN_RECOMPUTE if c.schedule == sched]
    for rank_runs in zip(*runs):
        base = rank_runs[0]["buffers"]
        assert any(k.endswith("num_batches_tracked") and int(v) > 0 for k, v in base.items())
        for other in rank_runs[1:]:
            assert base.keys() == other["buffers"].keys()
            assert all(torch.equal(other["buffers"][k], v) for k, v in base.items()), (
                {k: (v, other["buffers"][k]) for k, v in base.items() if k.endswith("num_batches_tracked")})


def test_replicas_hold_identical_parameters_and_positions_different_ones(request: pytest.FixtureRequest) -> None:
    by_rank = results(case("mlp", "sgd", "1f1b", 2, 2, 4), request)
    for a in by_rank:
        for b in by_rank:
            if a["stages"] == b["stages"]:
                assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            else:
                assert not set(a["params"]) & set(b["params"])


def _bad_engine_calls(rank: int, world: int) -> list[str]:
    from torch import nn

    from pipeengine import PipelineEngine

    def sgd(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=0.1)

    shared = nn.Linear(4, 4)
    inner = nn.Linear(4, 4)
    calls: list[tuple[list[nn.Module], object, object, dict[str, object]]] = [
        ([nn.Linear(4, 4)], nn.functional.mse_loss, torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), {}),
        ([nn.Linear(4, 4)], nn.functional.mse_loss, lambda ps: None, {}),
        ([nn.Linear(4, 4)], None, sgd, {}),
        ([nn.Linear(4, 4)], nn.functional.mse_loss, sgd, {"seed": "abc"}),
        ([nn.Linear(4, 4)], nn.functional.mse_loss, sgd, {"grad_clip": -1}),
        ([nn.Linear(4, 4)], nn.functional.mse_loss, sgd, {"timeout": float("nan")}),
        ([shared, nn.ReLU(), shared], nn.functional.mse_loss, sgd, {}),
        ([nn.Sequential(inner), nn.ReLU(), nn.Sequential(nn.Tanh(), inner)], nn.functional.mse_loss, sgd, {}),
        ([nn.Linear(4, 4)], lambda out, y: nn.functional.mse_loss(out, y).detach(), sgd, {}),
        ([nn.Linear(4, 4)], lambda out, y: torch.tensor(nn.functional.mse_loss(out, y).item()), sgd, {}),
    ]
    out = []
    for layers, loss_fn, opt, kw in calls:
        try:
            engine = PipelineEngine(layers, loss_fn, opt, microbatches=2, **kw)  # type: ignore[arg-type]
            engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))] * 2))
            out.append("trained")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.mark.timeout(60)
def test_bad_engine_arguments_are_named_before_anything_runs(request: pytest.FixtureRequest) -> None:
    """What a user of the Python API can get wrong: a TypeError or ValueError naming the argument and the fix."""
    got = request.getfixturevalue("world1").run(_bad_engine_calls)[0]
    expect = [
        "TypeError: optimizer must be a factory params -> Optimizer, e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)",
        "TypeError: optimizer(params) must return a torch.optim.Optimizer (got NoneType)",
        "TypeError: loss_fn must be a function (output, target) -> scalar Tensor (got None)",
        "TypeError: seed must be a whole number in [0, 2**63) (got 'abc')",
        "ValueError: grad_clip must be a positive, finite gradient norm (got -1)",
        "ValueError: timeout must be a positive number of seconds (got nan)",
        "ValueError: layers 0 and 2 share the same module object (Linear): stages on different ranks would train two "
        "copies; give each layer its own module, and declare weights meant to be one with "
        "tied=[[(0, 'weight'), (2, 'weight')]]",
        "ValueError: layers 0 and 2 share one parameter ('0.weight' of layer 0, '1.weight' of layer 2)",
        "ValueError: loss_fn returned a loss without a gradient path to the model's output",
        "ValueError: loss_fn returned a loss without a gradient path to the model's output",
    ]
    assert len(got) == len(expect)
    for g, e in zip(got, expect):
        assert g.startswith(e), (g, e)


def _loader_steps(rank: int, world: int) -> list[float]:
    """The same global batches twice: as per-step lists, and through one DataLoader iterator per replica (its
    share of the examples, as a DistributedSampler without shuffling gives it) kept across the steps."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    from tests.runtime.equivalence import OPTIMIZERS, batch, mlp_layers, replica_iter
    torch.set_default_dtype(torch.float64)
    try:
        losses = []
        for via_loader in (False, True):
            engine = PipelineEngine(mlp_layers(), torch.nn.functional.mse_loss, OPTIMIZERS["adam"],
                                    topology=Topology(1, 2), microbatches=4, wire="strict")
            xs, ys = zip(*(batch(step) for step in range(3)))
            mine = [t * 16 + 8 * engine.replica + k for t in range(3) for k in range(8)]   # step t: 8 of its 16
            it = iter(DataLoader(Subset(TensorDataset(torch.cat(xs), torch.cat(ys)), mine), batch_size=2))
            for step in range(3):
                data = it if via_loader else replica_iter(batch, step, engine.replica, 2, 4)
                losses.append(engine.train_batch(data).loss)
        return losses
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_dataloader_iterator_kept_across_steps_gives_each_step_its_microbatches(  # type: ignore[no-untyped-def]
        world2) -> None:
    for losses in world2.run(_loader_steps):
        assert losses[:3] == losses[3:], losses


class _Probe(torch.nn.Module):
    """A linear layer that records the mode of each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return self.lin(x)


class _FrozenNorm(torch.nn.Module):
    """The usual way to freeze a BatchNorm: ``train()`` puts it back in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)

    def train(self, mode: bool = True) -> _FrozenNorm:
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def test_layers_train_in_train_mode_evaluate_in_eval_mode_and_keep_modes_the_user_set(
        one_process_group: None) -> None:
    """Training steps run in train mode, eval steps in eval mode. A layer whose ``train()`` keeps its BatchNorm
    frozen is frozen from the first step, and a BatchNorm the user put in eval mode between steps stays there,
    through training steps and after an eval step."""
    from pipeengine import PipelineEngine, Topology
    probe, frozen, norm = _Probe(), _FrozenNorm(), torch.nn.BatchNorm1d(4)
    engine = PipelineEngine([probe, frozen, norm, torch.nn.Linear(4, 4)], torch.nn.functional.mse_loss,
                            lambda ps: torch.optim.SGD(ps, lr=0.1), topology=Topology(1), microbatches=2,
                            partition="uniform")
    data = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(2)]

    def train() -> torch.Tensor:
        engine.train_batch(iter(data))
        return norm.running_mean.clone()

    moved = train()
    assert probe.seen == [True, True] and not frozen.bn.training and torch.equal(frozen.bn.running_mean, torch.zeros(4))
    assert not torch.equal(moved, torch.zeros(4))   # the user's own BatchNorm trained
    norm.eval()
    assert torch.equal(train(), moved) and probe.seen[-1]   # frozen by the user: statistics kept
    engine.eval_batch(iter(data))
    assert probe.seen[-2:] == [False, False]
    assert torch.equal(train(), moved) and probe.seen[-2:] == [True, True] and not norm.training
    assert torch.equal(frozen.bn.running_mean, torch.zeros(4)) and not frozen.bn.training
    engine.close()
