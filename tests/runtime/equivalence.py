"""Pipeline = single process: the models, data and single-process reference every equivalence test shares.

A :class:`Case` names a configuration (model, optimizer, schedule, pp, dp, microbatches, engine
options); :func:`run_case` trains it on the ranks of a pool and returns what each rank saw;
:func:`check` compares that with one process training ``nn.Sequential`` of the same layers on the
same global batch. Tolerance: float64 everywhere, rtol=1e-9 / atol=1e-12 (the pipeline sums the same
numbers in a different order, nothing else differs); bf16 to about three digits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pipeengine.runtime.layers import build_layers
from tests.harness import WorldPool

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


def _mlp_layer(i: int, n: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) if i < n - 1 else nn.Linear(DIM, 1)


MLP_FACTORIES = [functools.partial(_mlp_layer, i) for i in range(10)]


def dropout_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.3), nn.Tanh()) for _ in range(7)] + [nn.Linear(DIM, 1)]


def bn_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Tanh()) for _ in range(3)] + [nn.Linear(DIM, 1)]


class InplaceTanh(nn.Module):
    """An in-place first op: at a stage boundary its input is the received tensor, modified in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.tanh_()


def inplace_layers(seed: int = 0) -> list[nn.Module]:
    """[Linear, InplaceTanh] x 4, Linear(DIM, 1): split in two, the second stage begins in place."""
    torch.manual_seed(seed)
    return [m for _ in range(4) for m in (nn.Linear(DIM, DIM), InplaceTanh())] + [nn.Linear(DIM, DIM),
                                                                                  nn.Linear(DIM, 1)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g, dtype=torch.float64)
    return x.to(torch.get_default_dtype()), x.sum(dim=1, keepdim=True).sin().to(torch.get_default_dtype())


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
    return tokens, tokens.double().mean(1, keepdim=True).cos().to(torch.get_default_dtype())


TIE = [[(0, "0.weight"), (4, "0.weight")]]   # two separate Parameter objects that are one logical weight


# name -> (the list the engine gets, data, ties, the single-process model's layers)
MODELS: dict[str, tuple[Callable[[], list[Any]], Callable[[int], Any], list[Any], Callable[[], list[nn.Module]]]] = {
    "mlp": (mlp_layers, batch, [], mlp_layers),
    "factories": (lambda: list(MLP_FACTORIES), batch, [], lambda: build_layers(MLP_FACTORIES, seed=0)),
    "tuple": (tuple_layers, token_batch, [], tuple_layers),
    "tied": (mlp_layers, batch, TIE, lambda: _share(mlp_layers())),
    "dropout": (dropout_layers, batch, [], dropout_layers),
    "bn": (bn_layers, batch, [], bn_layers),
    "inplace": (inplace_layers, batch, [], inplace_layers),
}


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}


def _share(layers: list[nn.Module]) -> list[nn.Module]:
    layers[4][0].weight = layers[0][0].weight   # type: ignore[index]
    return layers


def reference(model: str, opt: str, microbatches: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the full global batch: nn.Sequential of the same layers. With ``microbatches``
    (> 1: what a model that draws random numbers needs) the batch runs as that many microbatches, each drawing
    from the streams the engine keys to (seed 0, layer, microbatch, step): see pipeengine/runtime/rng.py."""
    from pipeengine.runtime.rng import microbatch_key, step_key
    from pipeengine.runtime.chain import LayerChain
    torch.set_default_dtype(torch.float64)
    _, data, _, build = MODELS[model]
    layers = build()
    net = nn.Sequential(*layers)
    chain = LayerChain(layers)
    optim = OPTIMIZERS[opt](list(net.parameters()))
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        optim.zero_grad()
        if microbatches == 1:
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            losses.append(loss.item())
        else:
            b, total = GLOBAL_BATCH // microbatches, 0.0
            for k in range(microbatches):
                out = chain(x[k * b:(k + 1) * b], microbatch_key(step_key(0, step, True), k))
                loss = nn.functional.mse_loss(out, y[k * b:(k + 1) * b]) / microbatches
                loss.backward()
                total += loss.item()
            losses.append(total)
        optim.step()
    net.eval()
    with torch.no_grad():   # evaluation after training, on a batch never trained on
        x, y = data(99)
        losses.append(nn.functional.mse_loss(net(x), y).item())
    return losses, {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers)
                    for k, v in layer.state_dict().items()}


def train_alone(opt: str, loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, float64, ``nn.Sequential`` of :func:`mlp_layers`: each step's loss ``loss_of(net, x, y)`` on
    ``batch(step)``, backward and the optimizer ``opt``; the losses and the final state (keys ``"layer.name"``)."""
    torch.set_default_dtype(torch.float64)
    try:
        layers = mlp_layers()
        net = nn.Sequential(*layers)
        optim, losses = OPTIMIZERS[opt](list(net.parameters())), []
        for step in range(STEPS):
            loss = loss_of(net, *batch(step))
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
        return losses, {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers)
                        for k, v in layer.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)


def replica_iter(data: Any, step: int, replica: int, dp: int, m: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data(step)
    per = GLOBAL_BATCH // dp
    x, y = x[replica * per:(replica + 1) * per], y[replica * per:(replica + 1) * per]
    b = per // m
    return iter([(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b]) for k in range(m)])


def posted(program: list[Any], log: list[tuple[str, str, int, int, int]]) -> tuple[list[list[str]], list[str]]:
    """(the comm steps of a program, each in posting order; the actions the wire posted)."""
    want = [[str(a) for a in sorted(step, key=lambda x: not x.kind.is_send)]
            for step in program if not step[0].kind.is_compute]
    got: list[str] = []
    for action, *_ in log:   # one entry per tensor: a transfer's tensors are consecutive
        if not got or got[-1] != action:
            got.append(action)
    return want, got


def early_receives(steps: list[list[str]], got: list[str]) -> int:
    """How many receives the wire posted with the comm step before theirs (tags mode, [Note: receives one step
    early] in wire.py); asserts that is all that differs from the program: every action once, the sends and
    headers in program order, and no receive earlier than its step's predecessor."""
    assert sorted(got) == sorted(a for st in steps for a in st), f"posted {got}, the program's steps are {steps}"
    pos = {a: i for i, a in enumerate(got)}
    fixed = [a for st in steps for a in st if not a.startswith("recv") or a.startswith("recvH")]
    kept = set(fixed)
    assert [a for a in got if a in kept] == fixed, f"sends and headers out of program order: {got}"
    early = 0
    for k, st in enumerate(steps):
        later_sends = [pos[a] for a in (steps[k + 1] if k + 1 < len(steps) else []) if a.startswith("send")]
        for a in st:
            assert all(pos[a] < p for p in later_sends), f"{a} (comm step {k}) posted after comm step {k + 1}"
            if a.startswith(("recvF", "recvB")) and k > 0:
                assert all(pos[b] < pos[a] for j in range(k - 1) for b in steps[j]), f"{a} posted too early: {got}"
                early += any(pos[a] < pos[b] for b in st if b.startswith("send"))   # (a step posts sends first)
    return early


def run_config(model: str, opt: str, schedule: str, pp: int, dp: int, m: int,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.topology import Topology
    extra = dict(extra or {})
    wire = extra.pop("wire", "strict")
    background = extra.pop("gather_in_background", None)   # ZeRO-1's all-gather waited per stage, as on CUDA
    torch.set_default_dtype(torch.float32 if extra.get("precision") == "bf16" else torch.float64)
    layers, data, tied, _ = MODELS[model]
    engine = PipelineEngine(layers(), nn.functional.mse_loss, OPTIMIZERS[opt], topology=Topology(pp=pp, dp=dp),
                            schedule=schedule, microbatches=m, timeout=60, tied=tied,
                            wire="tags" if wire == "tags" else "strict", **extra)
    engine.wire.coalesce = wire == "coalesced"   # the NCCL path (one batch_isend_irecv per step) on Gloo
    if background is not None:
        engine.update.gather_in_background = background
    torch.manual_seed(1234 + engine.rank)
    losses, peaks, programs_posted, logs, grad_norms = [], [], [], [], []
    for step in range(STEPS):
        engine.wire.log = []
        result = engine.train_batch(replica_iter(data, step, engine.replica, dp, m))
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
        peaks.append(result.peak_stored)
        programs_posted.append(posted(engine.program, engine.wire.log))
        logs.append(engine.wire.log)
    engine.wire.log = []
    ev = engine.eval_batch(replica_iter(data, 99, engine.replica, dp, m), return_outputs=True)
    programs_posted.append(posted(engine.eval_program, engine.wire.log))
    losses.append(ev.loss)   # the reference appends its evaluation loss the same way
    if ev.outputs is not None:
        assert len(ev.outputs) == m and all(o.shape[0] == GLOBAL_BATCH // dp // m for o in ev.outputs)
    params, buffers = {}, {}
    for st in engine.stages:
        start = engine.bounds[st.index]
        for j, layer in enumerate(st.module.layers):
            for k, v in layer.state_dict().items():
                params[f"{start + j}.{k}"] = v.detach().clone()
            buffers.update({f"{start + j}.{k}": v.clone() for k, v in layer.named_buffers()})
    return {"losses": losses, "params": params, "buffers": buffers, "peaks": peaks, "replica": engine.replica,
            "stages": [st.index for st in engine.stages], "posted": programs_posted, "log": logs[0],
            "num_params": sum(p.numel() for p in engine.parameters),
            "buckets": (engine.grad_sync.posted_early, len(engine.grad_sync.buckets)),
            "state_bytes": sum(t.numel() * t.element_size() for st in engine.optimizer.state.values()
                               for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0),
            "grad_norms": grad_norms}


# ------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class Case:
    """One configuration; ``extra`` are engine arguments, plus ``wire``: strict (default), tags or coalesced
    (the NCCL path, one batch_isend_irecv per step, run on Gloo)."""

    model: str
    opt: str
    schedule: str
    pp: int
    dp: int
    m: int
    extra: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.extra)

    def but(self, **extra: Any) -> "Case":
        """The same case with other engine options."""
        return Case(self.model, self.opt, self.schedule, self.pp, self.dp, self.m,
                    tuple(sorted({**self.options, **extra}.items())))

    def __str__(self) -> str:
        opts = "-".join(f"{k}={v}" for k, v in self.extra)
        name = f"{self.model}-{self.opt}-{self.schedule}-pp{self.pp}dp{self.dp}-m{self.m}"
        return name + (f"-{opts}" if opts else "")


def case(model: str, opt: str, schedule: str, pp: int, dp: int, m: int, **extra: Any) -> Case:
    return Case(model, opt, schedule, pp, dp, m, tuple(sorted(extra.items())))


_RESULTS: dict[Case, list[dict[str, Any]]] = {}


def run_case(c: Case, pool: WorldPool) -> list[dict[str, Any]]:
    """Every rank's results for a case (each case runs once per session)."""
    if c not in _RESULTS:
        _RESULTS[c] = pool.run(_worker, c, timeout=120)
    return _RESULTS[c]


def _worker(rank: int, world: int, c: Case) -> dict[str, Any]:
    return run_config(c.model, c.opt, c.schedule, c.pp, c.dp, c.m, c.options)


@functools.lru_cache(maxsize=None)
def _reference(model: str, opt: str, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    try:
        return reference(model, opt, microbatches)
    finally:
        torch.set_default_dtype(torch.float32)


def check_posted(results: list[dict[str, Any]], c: Case) -> None:
    """What every rank posted on the wire is its validated program, step by step (headers included); in tags mode
    the receives may go one comm step early, and some do (seen where a step that receives also sends)."""
    for r in results:
        for steps, got in r["posted"]:
            if c.options.get("wire") != "tags":
                want = [a for st in steps for a in st]
                assert got == want, f"{c}: the wire posted\n{got}\nbut the program is\n{want}"
                continue
            early = early_receives(steps, got)
            mixed = [st for st in steps[1:] if any(a.startswith("send") for a in st)
                     and any(a.startswith(("recvF", "recvB")) for a in st)]
            assert early or not mixed, f"{c}: no receive went early in\n{got}"


def check(results: list[dict[str, Any]], c: Case) -> None:
    """Losses (every step and the evaluation) and every parameter equal single-process training."""
    check_posted(results, c)
    ref_losses, ref_params = _reference(c.model, c.opt, c.dp * c.m if c.model == "dropout" else 1)
    rtol, atol = (0.1, 0.02) if c.options.get("precision") == "bf16" else (RTOL, ATOL)   # bf16: ~3 digits
    seen: set[str] = set()
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                                   msg=lambda e: f"{c} losses: {e}")
        for k, v in r["params"].items():
            if rtol == RTOL:
                torch.testing.assert_close(v, ref_params[k], rtol=RTOL, atol=ATOL, msg=lambda e: f"{c} {k}: {e}")
            seen.add(k)
    assert seen == set(ref_params), f"{c}: parameters {set(ref_params) - seen} missing from every rank"


def stage_peaks(results: list[dict[str, Any]]) -> dict[int, int]:
    peaks: dict[int, int] = {}
    for r in results:
        for step_peaks in r["peaks"]:
            for stage, p in step_peaks.items():
                peaks[stage] = max(peaks.get(stage, 0), p)
    return peaks
