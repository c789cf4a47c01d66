"""One measuring process of benchmarks.memory (the launcher starts P of them per configuration): the probe of RSS
or CUDA memory, the models, and each engine's steps; each rank writes its records as JSON files.

    MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m benchmarks.memory_worker --model boundary --schedule 1f1b -m 16 --act-mib 16 \\
        --variants ours torch --out-dir /tmp/mem     # per-rank JSON files in /tmp/mem

See benchmarks/memory.py for what is measured and how.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import pipeengine.models.gpt as gpt
from benchmarks.common import finish_and_exit, init_from_env, mean_loss, timed_steps
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.topology import Topology

COLS = 1024                      # activation columns; rows = A MiB * 256
DEEP_LAYERS = 4                  # layers per stage of the deep (checkpointing) model
MIB = 1024 * 1024
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "zb-h1": "ScheduleInterleavedZeroBubble"}


# ---------------------------------------------------------------------------------------------- measurement

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        m = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


class Probe:
    """Current and peak memory of this process: RSS on CPU, the caching allocator's counters on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def current(self) -> float:
        """MiB in use now (VmRSS, or CUDA memory_allocated)."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() / MIB
        return _status_kib("VmRSS") / 1024

    def reset_peak(self) -> float:
        """Start a new peak window; return the current MiB (the window's baseline)."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as fh:   # "5": reset the peak RSS (VmHWM) to the current RSS
                fh.write("5")
        return self.current()

    def peak(self) -> float:
        """MiB at the peak since the last reset_peak (VmHWM, or CUDA max_memory_allocated)."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MIB
        return _status_kib("VmHWM") / 1024


# ---------------------------------------------------------------------------------------------- models

class Affine(nn.Module):
    """y = x * w + b, elementwise with (cols,) parameters: autograd keeps only the input x.

    With ``relu`` the layer returns relu(y), and autograd also keeps that output: one more A per layer
    (relu rather than tanh or gelu: single-threaded tanh is 7x slower here, and the memory is the same).
    """

    def __init__(self, cols: int, relu: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(cols))
        self.b = nn.Parameter(torch.zeros(cols))
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w + self.b
        return torch.relu(y) if self.relu else y


def layers_per_stage(model: str) -> int:
    return DEEP_LAYERS if model in ("deep", "weights") else 1


def make_layers(model: str, pp: int) -> list[nn.Module]:
    """boundary: one Affine per stage; deep: DEEP_LAYERS relu-Affines per stage (where checkpointing pays);
    weights: DEEP_LAYERS Linear(COLS, COLS) per stage, 8-row microbatches (where bf16 weight copies show)."""
    if model == "weights":
        return [nn.Linear(COLS, COLS) for _ in range(pp * DEEP_LAYERS)]
    return [Affine(COLS, relu=model == "deep") for _ in range(pp * layers_per_stage(model))]


# ---------------------------------------------------------------------------------------------- worker

def _variant_kwargs(variant: str) -> dict[str, Any]:
    """'ours:recompute=full,precision=bf16' -> {'recompute': 'full', 'precision': 'bf16'}."""
    _, _, opts = variant.partition(":")
    return dict(kv.split("=", 1) for kv in opts.split(",") if kv)


def key_of(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", variant)


def _build_ours(variant: str, a: argparse.Namespace, device: torch.device,
                mbs: list[torch.Tensor]) -> Callable[[], None]:
    pp, per = dist.get_world_size(), layers_per_stage(a.model)
    engine = PipelineEngine(make_layers(a.model, pp), mean_loss, lambda ps: torch.optim.SGD(ps, lr=1e-3),
                            topology=Topology(pp, 1), schedule=a.schedule, microbatches=a.m,
                            partition=list(range(0, pp * per + 1, per)), device=device, **_variant_kwargs(variant))
    data = mbs if mbs else [None] * a.m      # ranks without the first stage pass placeholders (never read)

    def step() -> None:
        engine.train_batch(iter([(x, None) for x in data]) if engine.needs_data else None)
    return step


def _build_torch(a: argparse.Namespace, device: torch.device, mbs: list[torch.Tensor]) -> Callable[[], None]:
    from torch.distributed import pipelining
    pp, rank, per = dist.get_world_size(), dist.get_rank(), layers_per_stage(a.model)
    module = nn.Sequential(*make_layers(a.model, pp)[rank * per:(rank + 1) * per]).to(device)
    stage = pipelining.PipelineStage(module, rank, pp, device)      # shapes inferred in the first step
    cls = getattr(pipelining, TORCH_SCHEDULES[a.schedule])
    sched = cls([stage] if a.schedule == "zb-h1" else stage, n_microbatches=a.m, loss_fn=mean_loss)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    targets = [torch.zeros(1, device=device) for _ in range(a.m)]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        kw: dict[str, Any] = {"return_outputs": False}
        if rank == 0:
            kw["arg_mbs"] = [(x,) for x in mbs]
        if rank == pp - 1:
            kw["target_mbs"] = targets
            kw["losses"] = []
        sched.step(**kw)
        opt.step()
    return step


def warm_process(pipelining: bool) -> None:
    """Pay one-time costs before any baseline: the first optimizer imports torch._dynamo (~150 MiB of RSS here)."""
    if pipelining:
        importlib.import_module("torch.distributed.pipelining")
    w = nn.Parameter(torch.zeros(8))
    for opt in (torch.optim.SGD([w], lr=0.0), torch.optim.AdamW([w], lr=0.0)):
        (w * 2.0).sum().backward()
        opt.step()
        opt.zero_grad()


def _write(out_dir: str, variant: str, rec: dict[str, Any]) -> None:
    path = os.path.join(out_dir, f"{key_of(variant)}.rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(rec, fh)
    os.replace(path + ".tmp", path)


def worker_matrix(a: argparse.Namespace, device: torch.device, probe: Probe) -> None:
    """boundary / deep model: measure each variant in turn (fresh build, warm-up, measured steps)."""
    rank = dist.get_rank()
    rows = 8 if a.model == "weights" else a.act_mib * MIB // (4 * COLS)
    # The data exists before any engine: only the first stage reads inputs (views of one batch tensor).
    full = torch.randn(a.m * rows, COLS, device=device) if rank == 0 else None
    mbs = list(full.split(rows)) if full is not None else []
    for variant in a.variants:
        try:
            gc.collect()
            dist.barrier()
            pre = probe.current()
            step = _build_torch(a, device, mbs) if variant == "torch" else _build_ours(variant, a, device, mbs)
            warm = timed_steps(step, 1)
            base = probe.reset_peak()
            times = timed_steps(step, a.steps)
            peak = probe.peak()
            rec = {"rank": rank, "pre_mib": pre, "baseline_mib": base, "peak_mib": peak, "growth_mib": peak - base,
                   "held_mib": base - pre, "warmup_s": warm[0], "step_s": statistics.median(times)}
            del step
            gc.collect()
        except Exception as exc:   # recorded; the launcher runs the remaining variants in a new launch
            _write(a.out_dir, variant, {"rank": rank, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            raise
        _write(a.out_dir, variant, rec)


def worker_gpt(a: argparse.Namespace, device: torch.device, probe: Probe, import_mib: float) -> None:
    """Big GPT, AdamW, a.steps steps; peak over the RSS before anything model-related exists.

    The baseline is read at process start after importing torch and warm_process() (without it the
    first optimizer's import of torch._dynamo, ~150 MiB, would count as model memory);
    ``import_mib`` is the RSS right after the imports, kept in the JSON.
    """
    start_mib = probe.reset_peak()
    rank, pp = dist.get_rank(), dist.get_world_size() // a.dp
    cfg = gpt.Config(**json.loads(a.gpt_config))
    specs: list[Any]
    if a.variants[0] == "factories":
        # Per-stage construction: zero-argument factories, the engine calls only this rank's.
        specs = gpt.layer_factories(cfg)
    else:
        # The whole model as modules on every rank, kept by the caller as in the README's usage example
        # (``layers = build_my_layers(); engine = PipelineEngine(layers, ...)``, then the training loop).
        specs = gpt.build(cfg, seed=0)
    engine = PipelineEngine(specs, gpt.loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                            topology=Topology(pp, a.dp), schedule="1f1b", microbatches=a.m, partition="parameters",
                            tied=gpt.tied_parameters(len(specs)), device=device, shard_optimizer=bool(a.zero))
    gc.collect()
    after_build, build_peak = probe.current(), probe.peak()
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, cfg.vocab_size, (a.gpt_batch, cfg.block_size), generator=g),
              torch.randint(0, cfg.vocab_size, (a.gpt_batch, cfg.block_size), generator=g)) for _ in range(a.m)]
    batch = [(x.to(device), y.to(device)) for x, y in batch]
    times = timed_steps(lambda: engine.train_batch(iter(batch) if engine.needs_data else None), a.steps)
    peak = probe.peak()
    local = sum(p.numel() for p in engine.parameters)
    state = sum(t.numel() * t.element_size() for st in engine.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    _write(a.out_dir, a.variants[0], {"rank": rank, "import_mib": import_mib, "start_mib": start_mib,
                                      "after_build_mib": after_build, "build_peak_mib": build_peak,
                                      "peak_mib": peak, "growth_mib": peak - start_mib, "local_params": local,
                                      "optimizer_state_mib": state / MIB, "step_s": times})


def worker(a: argparse.Namespace, import_mib: float) -> None:
    a.steps = a.steps or 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_from_env("nccl" if cuda else "gloo", timeout=a.timeout)
    probe = Probe(device)
    warm_process("torch" in a.variants)
    if a.model == "gpt":
        worker_gpt(a, device, probe, import_mib)
    else:
        worker_matrix(a, device, probe)
    finish_and_exit()


def main() -> None:
    """The worker's arguments, as the launcher (benchmarks/memory.py) passes them."""
    p = argparse.ArgumentParser(description="one measuring process of benchmarks.memory")
    p.add_argument("--model", default="boundary")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("-m", type=int, default=4)
    p.add_argument("--act-mib", type=int, default=16)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--variants", nargs="+", default=["ours"])
    p.add_argument("--out-dir", default=None)
    p.add_argument("--gpt-config", default="{}")
    p.add_argument("--gpt-batch", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    worker(p.parse_args(), Probe(torch.device("cpu")).current())   # RSS right after importing torch and this module


if __name__ == "__main__":
    main()
