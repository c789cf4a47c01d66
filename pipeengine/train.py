"""The command-line trainer behind launch/pipe.sh: config, data, model, loop, progress, TensorBoard.

    launch/pipe.sh 4 cpus --model gpt --preset tiny --steps 100      # pp=2 x dp=2 on Gloo
    launch/pipe.sh 8 gpus --model gpt --preset small                 # pp=4 x dp=2 on NCCL
    python -m pipeengine.train --steps 20                            # one process, no torchrun
    tensorboard --logdir runs                                        # throughput views
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .checkpoint import latest, load, save
from .engine import PipelineEngine, StepResult
from .metrics import MetricsWriter, chrome_trace, compute_breakdown, gather_records, measured_bubble
from .schedule import SCHEDULES, Costs, simulate, theoretical_bubble
from .stage import PRECISIONS, parse_checkpoint
from .topology import Topology

__all__ = ["TrainConfig", "parse_args", "main"]

MODELS = ("gpt", "resnet", "mlp")


@dataclass
class TrainConfig:
    """Everything a run needs; ``check()`` rejects bad combinations with a message that says why."""

    model: str = "gpt"            #: one of gpt, resnet, mlp (modules under models/)
    preset: str = "tiny"          #: a named size from the model module's presets()
    data: str | None = None       #: text file/folder (gpt) or ImageFolder (resnet); default: built locally
    pp: int | None = None         #: pipeline stages (physical ranks per pipeline); default: all ranks
    dp: int | None = None         #: data-parallel replicas; default: world size / pp
    schedule: str = "1f1b"        #: gpipe, 1f1b, interleaved-1f1b or zb-h1
    chunks: int = 0               #: model chunks per rank; 0: 2 for interleaved-1f1b, else 1
    microbatches: int = 4         #: microbatches per step per replica
    micro_batch_size: int = 4     #: examples per microbatch
    global_batch: int | None = None  #: if set, micro_batch_size = global_batch / (dp * microbatches)
    steps: int = 50               #: optimizer steps
    lr: float = 3e-3              #: peak learning rate (after warmup)
    min_lr: float = 3e-4          #: learning rate at the end of the cosine decay
    warmup: int = 5               #: linear warmup steps
    optimizer: str = "adamw"      #: adamw or sgd
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  #: clip the global grad norm (0 or less: off)
    seed: int = 1234
    log_dir: str = "runs"         #: TensorBoard logs go to <log_dir>/<run_name>
    run_name: str | None = None
    eval_interval: int = 25       #: evaluate on the validation split every N steps (0: only at the end)
    log_interval: int = 1         #: gather every rank's action timings (bubble, per-stage views) every N steps
    timeline_interval: int = 25   #: log a pipeline timeline image every N steps (0: off)
    trace_step: int | None = None  #: write a Chrome/Perfetto trace of this step
    device: str = "auto"          #: auto, cpu or cuda
    backend: str = "auto"         #: auto, gloo or nccl
    timeout: float = 300.0        #: seconds any wait may take before the rank reports what it was stuck on
    checkpoint: str = "none"      #: activation checkpointing per chunk: none, full or every:K (layers per region)
    precision: str = "fp32"       #: fp32, bf16 (autocast, bf16 between stages) or fp16 (CUDA, loss scaling)
    save_interval: int = 0        #: save a checkpoint every N steps and after the last one (0: never)
    save_dir: str = "checkpoints"  #: where checkpoints go (one step-NNNNNNNN folder each)
    keep: int = 3                 #: keep the newest K complete checkpoints (0: all)
    resume: str | None = None     #: "latest" (the newest in save_dir, if any) or a checkpoint path

    def check(self, world_size: int) -> Topology:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r} is not one of {', '.join(MODELS)}")
        if self.schedule not in SCHEDULES or self.schedule == "forward":
            raise ValueError(f"--schedule {self.schedule!r} is not a training schedule; choose "
                             f"{', '.join(s for s in SCHEDULES if s != 'forward')}")
        if self.chunks == 0:
            self.chunks = 2 if self.schedule == "interleaved-1f1b" else 1
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        try:
            parse_checkpoint(self.checkpoint)
        except ValueError as exc:
            raise ValueError(f"--checkpoint: {exc}") from None
        if self.save_interval < 0 or self.keep < 0:
            raise ValueError(f"--save-interval and --keep must be >= 0 (got {self.save_interval}, {self.keep})")
        for name in ("microbatches", "micro_batch_size", "steps", "chunks", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.pp is not None and self.pp >= 1 and world_size % self.pp:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"world size {world_size} is not divisible by --pp {self.pp}; use --pp in "
                             f"{divisors} or launch a multiple of {self.pp} processes")
        try:
            topo = Topology.from_world(world_size, pp=self.pp, dp=self.dp)
        except ValueError as exc:
            raise ValueError(f"bad --pp/--dp for {world_size} processes: {exc}") from None
        if self.global_batch is not None:
            per_step = topo.dp * self.microbatches
            if self.global_batch < 1 or self.global_batch % per_step:
                raise ValueError(f"--global-batch {self.global_batch} is not divisible by dp={topo.dp} x "
                                 f"microbatches={self.microbatches} = {per_step}; use a multiple of {per_step}")
            self.micro_batch_size = self.global_batch // per_step
        return topo

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m pipeengine.train", description=(
        "Train a model with pipeline x data parallelism. Launch with launch/pipe.sh N gpus|cpus "
        "(torchrun) or run it as one process. Logs go to TensorBoard under --log-dir."))
    p.add_argument("--model", default=d.model, choices=MODELS, help="model to train (default gpt)")
    p.add_argument("--preset", default=d.preset, help="model size preset, e.g. tiny, small (default tiny)")
    p.add_argument("--data", default=None, help="gpt: a text file or folder; resnet: an ImageFolder root. "
                                                "Default: a byte corpus / FakeData built locally")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: all processes)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: world / pp)")
    p.add_argument("--schedule", default=d.schedule, help="gpipe, 1f1b, interleaved-1f1b or zb-h1 (default 1f1b)")
    p.add_argument("--chunks", type=int, default=d.chunks,
                   help="model chunks per rank (default: 2 for interleaved-1f1b, else 1)")
    p.add_argument("--microbatches", "-m", type=int, default=d.microbatches, help="microbatches per step per replica")
    p.add_argument("--micro-batch-size", "-b", type=int, default=d.micro_batch_size, help="examples per microbatch")
    p.add_argument("--global-batch", type=int, default=None,
                   help="examples per optimizer step over all replicas (sets --micro-batch-size)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default 50)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help="final learning rate of the cosine decay")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    p.add_argument("--optimizer", default=d.optimizer, choices=("adamw", "sgd"))
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global grad-norm clip (<= 0: off)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-dir", default=d.log_dir, help="TensorBoard root (default runs)")
    p.add_argument("--run-name", default=None, help="sub-directory of --log-dir (default: model-schedule-time)")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval, help="validate every N steps")
    p.add_argument("--log-interval", type=int, default=d.log_interval,
                   help="gather per-stage timings and bubble every N steps (loss and throughput: every step)")
    p.add_argument("--timeline-interval", type=int, default=d.timeline_interval,
                   help="log the pipeline timeline image every N steps (0: off)")
    p.add_argument("--trace-step", type=int, default=None, help="write a Chrome/Perfetto trace of this step")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    p.add_argument("--backend", default=d.backend, choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds before a stuck wait is reported")
    p.add_argument("--checkpoint", default=d.checkpoint, metavar="none|full|every:K",
                   help="activation checkpointing per chunk: recompute its layers (full) or every K layers in B "
                        "instead of keeping their activations (default none)")
    p.add_argument("--precision", default=d.precision, choices=list(PRECISIONS),
                   help="bf16: autocast, activations between stages in bf16, fp32 parameters, gradients and "
                        "optimizer state; fp16: the same with a dynamic loss scale, CUDA only (default fp32)")
    p.add_argument("--save-interval", type=int, default=d.save_interval, metavar="N",
                   help="save a checkpoint every N steps and after the last step (default 0: never)")
    p.add_argument("--save-dir", default=d.save_dir, help="checkpoint directory (default checkpoints)")
    p.add_argument("--keep", type=int, default=d.keep, help="keep the newest K checkpoints (0: all; default 3)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="resume from PATH (a checkpoint or a save directory) or, without PATH, from the newest "
                        "complete checkpoint in --save-dir if there is one (else start at step 0)")
    a = p.parse_args(argv)
    return TrainConfig(**{k.replace("-", "_"): v for k, v in vars(a).items()})


def _init(cfg: TrainConfig) -> tuple[torch.device, bool]:
    """Initialise torch.distributed (torchrun env, or a one-process group) unless the caller did; pick the device.

    Returns (device, whether this call created the process group).
    """
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu (or launch/pipe.sh N cpus)")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if want_cuda else "gloo")
    if backend == "nccl" and not want_cuda:
        raise ValueError("--backend nccl needs --device cuda; use gloo on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        torch.cuda.set_device(local_rank)
    from datetime import timedelta
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if dist.is_initialized():
        return device, False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun keeps one store across restarts of the group: keys of a crashed attempt (the Gloo
        # addresses of its groups) would be read by the next one, so each attempt gets its own prefix
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous
        store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=cfg.timeout)))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=PrefixStore(f"pipeengine/attempt{attempt}/", store),
                                rank=rank, world_size=world, timeout=timedelta(seconds=cfg.timeout))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    return device, True


def _progress(step: int, total: int, loss: float, samples_s: float, width: int = 24) -> str:
    done = int(width * step / total)
    return f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  {samples_s:,.0f} samples/s"


def run(cfg: TrainConfig) -> dict[str, Any]:
    device, owned = _init(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        topo = cfg.check(world)
        mod = importlib.import_module(f"models.{cfg.model}")
        presets = mod.presets()
        if cfg.preset not in presets:
            raise ValueError(f"--preset {cfg.preset!r} is not a {cfg.model} preset; choose {', '.join(presets)}")
        mcfg = presets[cfg.preset]()
        torch.manual_seed(cfg.seed)
        factories = mod.layer_factories(mcfg)   # each rank builds only its own stages' layers
        stages = topo.pp * cfg.chunks
        if len(factories) < stages:
            raise ValueError(f"{cfg.model} ({cfg.preset}) has {len(factories)} layers but pp={topo.pp} x chunks="
                             f"{cfg.chunks} needs {stages} stages; use fewer stages or a deeper preset")
        source = mod.make_source(mcfg, cfg.data)
        from models.data import batches
        opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.SGD

        def make_opt(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            kw: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
            if cfg.optimizer == "sgd":
                kw["momentum"] = 0.9
            return opt_cls(ps, **kw)

        engine = PipelineEngine(factories, mod.loss_fn, make_opt, topology=topo, schedule=cfg.schedule,
                                microbatches=cfg.microbatches, chunks=cfg.chunks, seed=cfg.seed,
                                tied=mod.tied_parameters(len(factories)), device=device, timeout=cfg.timeout,
                                grad_clip=cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0 else None,
                                checkpoint=cfg.checkpoint, precision=cfg.precision)
        del factories
        start = _resume(cfg, engine)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        if owned:
            dist.destroy_process_group()
        raise SystemExit(2)
    global_batch = topo.dp * cfg.microbatches * cfg.micro_batch_size
    tokens_per_example = int(getattr(mcfg, "block_size", 0)) or None
    run_name = cfg.run_name or f"{cfg.model}-{cfg.schedule}-pp{topo.pp}dp{topo.dp}-{time.strftime('%Y%m%d-%H%M%S')}"
    writer = MetricsWriter(os.path.join(cfg.log_dir, run_name), enabled=rank == 0)
    if rank == 0:
        print(topo.describe())
        print(f"model {cfg.model}/{cfg.preset}: {engine.num_layers} layers, stage bounds {engine.bounds}; schedule "
              f"{cfg.schedule}, {cfg.microbatches} microbatches x {cfg.micro_batch_size} per replica, global batch "
              f"{global_batch}; logs in {os.path.join(cfg.log_dir, run_name)}")
    is_tty = sys.stdout.isatty()

    def data_iter(split: str, step: int) -> Any:
        if not engine.needs_data:
            return None
        return iter(batches(source, split, step, cfg.seed, engine.replica, topo.dp, cfg.microbatches,
                            cfg.micro_batch_size))

    def evaluate(step: int) -> float:
        return engine.eval_batch(data_iter("val", step)).loss

    first_loss = last_loss = float("nan")
    val_loss = float("nan")
    times: list[float] = []
    bubbles: list[tuple[float, float]] = []
    losses: list[float] = []
    for step in range(start, cfg.steps):
        lr = cfg.lr_at(step)
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        res: StepResult = engine.train_batch(data_iter("train", step))
        first_loss = res.loss if step == start else first_loss
        last_loss = res.loss
        losses.append(res.loss)
        times.append(res.step_time)
        samples_s = global_batch / res.step_time
        wanted = (step % cfg.log_interval == 0 or step == cfg.steps - 1 or cfg.trace_step == step
                  or (cfg.timeline_interval and (step + 1) % cfg.timeline_interval == 0))
        records = gather_records(res.records) if wanted else None   # the same decision on every rank
        if not wanted and rank == 0:
            writer.log_scalars(step, {"train/loss": res.loss, "train/lr": lr, "time/step_s": res.step_time,
                                      "throughput/samples_per_s": samples_s,
                                      **({"train/grad_norm": res.grad_norm} if res.grad_norm is not None else {})})
        if records is not None:   # rank 0: every rank's timings of this step
            step_time = max(r.end for rs in records.values() for r in rs)
            # replica 0's ranks stand for their stage (replicas run the same program)
            breakdown = {topo.position_of(rk): compute_breakdown(rs, step_time)
                         for rk, rs in records.items() if topo.replica_of(rk) == 0}
            measured = measured_bubble(records, step_time)
            theory = _theoretical(engine, records)
            bubbles.append((measured, theory))
            writer.log_step(step, loss=res.loss, lr=lr, grad_norm=res.grad_norm, step_time=step_time,
                            samples_per_s=global_batch / step_time,
                            tokens_per_s=global_batch * tokens_per_example / step_time if tokens_per_example else None,
                            breakdown_by_stage=breakdown, measured_bubble=measured, theoretical_bubble=theory)
            if cfg.timeline_interval and (step + 1) % cfg.timeline_interval == 0:
                writer.log_timeline(step, records)
            if cfg.trace_step == step:
                chrome_trace(records, os.path.join(cfg.log_dir, run_name, f"trace_step{step}.json"), step)
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and step + 1 < cfg.steps:
            val_loss = evaluate(step)
            writer.log_eval(step, val_loss)
        if cfg.save_interval and ((step + 1) % cfg.save_interval == 0 or step + 1 == cfg.steps):
            t_save = time.perf_counter()
            saved = save(engine, cfg.save_dir, step + 1, keep=cfg.keep or None,
                         extra={"model": cfg.model, "preset": cfg.preset, "config": asdict(cfg)})
            if rank == 0:
                print(f"{chr(10) if is_tty else ''}saved {saved} in {time.perf_counter() - t_save:.2f} s")
        if rank == 0:
            line = _progress(step + 1, cfg.steps, res.loss, samples_s)
            print(("\r" + line) if is_tty else line, end="" if is_tty else "\n", flush=True)
    val_loss = evaluate(cfg.steps)
    writer.log_eval(cfg.steps, val_loss)
    writer.close()
    steady = sorted(times[1:] or times or [float("nan")])
    median = steady[len(steady) // 2]
    summary = {"config": asdict(cfg), "pp": topo.pp, "dp": topo.dp, "first_loss": first_loss,
               "final_loss": last_loss, "val_loss": val_loss, "median_step_s": median,
               "first_step": start, "losses": losses,
               "samples_per_s": global_batch / median,
               "tokens_per_s": global_batch * tokens_per_example / median if tokens_per_example else None,
               "measured_bubble": sum(b[0] for b in bubbles) / len(bubbles) if bubbles else None,
               "theoretical_bubble": bubbles[-1][1] if bubbles else None,
               "closed_form_bubble": theoretical_bubble(cfg.schedule, topo.pp, cfg.microbatches, cfg.chunks)}
    if rank == 0:
        if is_tty:
            print()
        print(_summary_text(summary))
        os.makedirs(os.path.join(cfg.log_dir, run_name), exist_ok=True)
        with open(os.path.join(cfg.log_dir, run_name, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    if owned:
        dist.destroy_process_group()
    return summary


def _resume(cfg: TrainConfig, engine: PipelineEngine) -> int:
    """Load the checkpoint ``--resume`` asks for (rank 0 decides which, every rank loads); the step to start at."""
    if cfg.resume is None:
        return 0
    choice: list[Any] = [cfg.resume]
    if cfg.resume == "latest" and dist.get_rank() == 0:
        found, partial = latest(cfg.save_dir)
        for p in partial:
            print(f"ignoring incomplete checkpoint {p} (a save that did not finish)")
        choice = [found]
        if found is None:
            print(f"no checkpoint in {cfg.save_dir!r}: starting at step 0")
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    t0 = time.perf_counter()
    info = load(engine, choice[0])
    if dist.get_rank() == 0:
        print(f"resumed from {info['path']} at step {info['step']} in {time.perf_counter() - t0:.2f} s (written "
              f"with pp={info.get('pp')} dp={info.get('dp')} {info.get('schedule')})")
    if info["step"] >= cfg.steps:
        raise ValueError(f"the checkpoint is at step {info['step']}, not before --steps {cfg.steps}; "
                         f"ask for more steps to continue training")
    return int(info["step"])


def _theoretical(engine: PipelineEngine, records: dict[int, list[Any]]) -> float:
    """The simulator's bubble for this schedule fed each pipeline position's measured mean F/B/W times.

    Replica 0's ranks stand for every replica (they run the same program).
    """
    split = engine.schedule.split_backward
    per_position = []
    for position in range(engine.topology.pp):
        rs = records.get(engine.topology.rank(position, 0), [])
        mean = {}
        for kind in ("F", "B", "W"):
            ds = [r.end - r.start for r in rs if r.kind == kind]
            mean[kind] = sum(ds) / len(ds) if ds else 0.0
        per_position.append(Costs(f=mean["F"], b=mean["B"], w=mean["W"] if split else 0.0))
    if all(c.f + c.b <= 0 for c in per_position):
        return 0.0
    return simulate(engine.schedule, per_position).mean_bubble


def _summary_text(s: dict[str, Any]) -> str:
    c = s["config"]
    tok = f"  tokens/s {s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else ""
    bub = (f"measured {s['measured_bubble']:.3f}  simulated {s['theoretical_bubble']:.3f}  closed form "
           f"{s['closed_form_bubble']:.3f}") if s["measured_bubble"] is not None else "n/a"
    return "\n".join([
        "=" * 72,
        f"model {c['model']}/{c['preset']}  schedule {c['schedule']}  pp {s['pp']} x dp {s['dp']}  "
        f"microbatches {c['microbatches']} x {c['micro_batch_size']}  steps {c['steps']}",
        f"loss       first {s['first_loss']:.4f}  final {s['final_loss']:.4f}  validation {s['val_loss']:.4f}",
        f"throughput {s['samples_per_s']:,.1f} samples/s{tok}  (median step {s['median_step_s'] * 1000:.1f} ms)",
        f"bubble     {bub}",
        "=" * 72,
    ])


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
