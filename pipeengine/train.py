"""The command-line trainer behind launch/pipe.sh: config, data, model, loop, progress, TensorBoard.

    launch/pipe.sh 4 cpus --model gpt --preset tiny --steps 100      # pp=2 x dp=2 on Gloo
    launch/pipe.sh 8 gpus --model gpt --preset small                 # pp=4 x dp=2 on NCCL
    python -m pipeengine.train --steps 20                            # one process, no torchrun
    tensorboard --logdir runs                                        # throughput views
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from .schedule import SCHEDULES

if TYPE_CHECKING:
    from .topology import Topology

__all__ = ["TrainConfig", "parse_args", "run", "main", "to_toml"]

MODELS = ("gpt", "resnet", "mlp")
PRECISION_NAMES = ("fp32", "bf16", "fp16")   # stage.PRECISIONS, named here so that --help needs no torch
STARTUP_TIMEOUT = 600.0                      # faults.STARTUP_TIMEOUT (a test keeps the two equal)


@dataclass
class TrainConfig:
    """Everything a run needs; ``check()`` rejects bad combinations with a message that says why."""

    model: str = "gpt"            #: one of gpt, resnet, mlp (models/, installed as pipeengine.models)
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
    log_interval: int = 0         #: a progress line and every rank's timings every N steps (0: steps / 50)
    quiet: bool = False           #: no progress output (errors and the final summary only)
    timeline_interval: int = 25   #: log a pipeline timeline image every N steps (0: off)
    trace_step: int | None = None  #: write a Chrome/Perfetto trace of this step
    device: str = "auto"          #: auto, cpu or cuda
    backend: str = "auto"         #: auto, gloo or nccl
    timeout: float | None = None  #: seconds a wait may take (None: 600 s, after the first step max(60, 20 x median))
    on_nonfinite: str = "stop"    #: a non-finite loss or gradient: stop (name the stage) or skip the step
    partition: str = "profile"    #: stage bounds: profile (measured), parameters, uniform, or explicit "0,3,6,10"
    memory_cap: float | None = None  #: GiB per rank the profile partition may plan for (None: no limit)
    checkpoint: str = "none"      #: activation checkpointing per chunk: none, full or every:K (layers per region)
    precision: str = "fp32"       #: fp32, bf16 (autocast, bf16 between stages) or fp16 (CUDA, loss scaling)
    wire: str = "tags"            #: Gloo only: tags, or strict (NCCL's per-peer order emulated, to test schedules)
    save_interval: int = 0        #: save a checkpoint every N steps and after the last one (0: never)
    save_dir: str = "checkpoints"  #: where checkpoints go (one step-NNNNNNNN folder each)
    keep: int = 3                 #: keep the newest K complete checkpoints (0: all)
    resume: str | None = None     #: "latest" (the newest in save_dir, if any) or a checkpoint path
    save_on_exit: bool = False    #: on SIGINT/SIGTERM, save a checkpoint after the step in progress
    async_save: bool = False      #: write checkpoints from a background thread while training goes on

    def check(self, world_size: int) -> Topology:
        from .stage import parse_checkpoint
        from .topology import Topology
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r} is not one of {', '.join(MODELS)}")
        if self.schedule not in SCHEDULES or self.schedule == "forward":
            raise ValueError(f"--schedule {self.schedule!r} is not a training schedule; choose "
                             f"{', '.join(s for s in SCHEDULES if s != 'forward')}")
        if self.chunks == 0:
            self.chunks = 2 if self.schedule == "interleaved-1f1b" else 1
        if self.wire not in ("tags", "strict"):
            raise ValueError(f"--wire must be tags or strict (got {self.wire!r})")
        if self.precision not in PRECISION_NAMES:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISION_NAMES)}")
        try:
            parse_checkpoint(self.checkpoint)
        except ValueError as exc:
            raise ValueError(f"--checkpoint: {exc}") from None
        if self.save_interval < 0 or self.keep < 0:
            raise ValueError(f"--save-interval and --keep must be >= 0 (got {self.save_interval}, {self.keep})")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds (got {self.timeout:g}); leave it "
                             f"out for the default ({STARTUP_TIMEOUT:.0f} s until the first step, then 20 x the "
                             f"median step)")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"--on-nonfinite must be 'stop' or 'skip' (got {self.on_nonfinite!r})")
        for name in ("eval_interval", "timeline_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if self.trace_step is not None and not 0 <= self.trace_step < self.steps:
            raise ValueError(f"--trace-step {self.trace_step} is not one of the run's steps 0..{self.steps - 1}")
        self.partition_arg()
        if self.memory_cap is not None and not self.memory_cap > 0:
            raise ValueError(f"--memory-cap must be a positive number of GiB (got {self.memory_cap:g})")
        if self.memory_cap is not None and self.partition != "profile":
            raise ValueError("--memory-cap is planned for by --partition profile only; drop it or use profile")
        if self.log_interval == 0:
            self.log_interval = max(1, self.steps // 50)
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
            if self.global_batch < 1:
                raise ValueError(f"--global-batch must be a positive number of examples (got {self.global_batch})")
            if self.global_batch % per_step:
                raise ValueError(f"--global-batch {self.global_batch} is not divisible by dp={topo.dp} x "
                                 f"microbatches={self.microbatches} = {per_step}; use a multiple of {per_step}")
            self.micro_batch_size = self.global_batch // per_step
        return topo

    def partition_arg(self) -> str | list[int]:
        """``--partition`` for the engine: a method name, or explicit stage bounds."""
        if self.partition in ("profile", "parameters", "uniform"):
            return self.partition
        try:
            return [int(b) for b in self.partition.split(",")]
        except ValueError:
            raise ValueError(f"--partition must be profile, parameters, uniform or stage bounds like 0,3,6,10 (got "
                             f"{self.partition!r})") from None

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _presets() -> str:
    names = importlib.import_module("pipeengine.models.presets").PRESETS   # torch-free
    return "; ".join(f"{m}: {', '.join(names[m])}" for m in MODELS)


def _parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m pipeengine.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a model with pipeline x data parallelism. Launch with launch/pipe.sh N gpus|cpus "
                    "(torchrun) or run it as one process. Logs go to TensorBoard under --log-dir. Settings come "
                    "from the defaults, then --config FILE, then the flags.")
    p.add_argument("--config", metavar="FILE", help="a TOML file of these settings (names as below, - or _)")
    p.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    p.add_argument("--model", default=d.model, choices=MODELS, help="model to train")
    p.add_argument("--preset", default=d.preset, help=f"model size: {_presets()}")
    p.add_argument("--data", default=d.data, help="gpt: a text file or folder; resnet: an ImageFolder root "
                                                  "(None: a byte corpus / FakeData made locally)")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (None: all processes)")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel replicas (None: world / pp)")
    p.add_argument("--schedule", default=d.schedule, help="gpipe, 1f1b, interleaved-1f1b or zb-h1")
    p.add_argument("--chunks", type=int, default=d.chunks,
                   help="model chunks per rank (0: 2 for interleaved-1f1b, else 1)")
    p.add_argument("--microbatches", "-m", type=int, default=d.microbatches, help="microbatches per step per replica")
    p.add_argument("--micro-batch-size", "-b", type=int, default=d.micro_batch_size, help="examples per microbatch")
    p.add_argument("--global-batch", type=int, default=d.global_batch,
                   help="examples per optimizer step over all replicas (sets --micro-batch-size)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help="final learning rate of the cosine decay")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    p.add_argument("--optimizer", default=d.optimizer, choices=("adamw", "sgd"), help="optimizer")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="weight decay")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global grad-norm clip (<= 0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the data order")
    p.add_argument("--log-dir", default=d.log_dir, help="TensorBoard root")
    p.add_argument("--run-name", default=d.run_name, help="sub-directory of --log-dir (None: model-schedule-time)")
    p.add_argument("--eval-interval", type=int, default=d.eval_interval,
                   help="validate every N steps (0: only at the end)")
    p.add_argument("--log-interval", type=int, default=d.log_interval,
                   help="a progress line (when not on a terminal) and every rank's timings (bubble, per-stage "
                        "views) every N steps; loss and throughput go to TensorBoard every step (0: steps / 50, "
                        "about 50 lines)")
    p.add_argument("--quiet", action="store_true", default=d.quiet, help="no progress output; errors and the summary")
    p.add_argument("--timeline-interval", type=int, default=d.timeline_interval,
                   help="also log the pipeline timeline image every N steps (it is always logged for the first "
                        "step after warm-up and the last; 0: only those)")
    p.add_argument("--trace-step", type=int, default=d.trace_step, help="write a Chrome/Perfetto trace of this step")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"), help="where to run")
    p.add_argument("--backend", default=d.backend, choices=("auto", "gloo", "nccl"), help="torch.distributed backend")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a wait may take before every rank's wait is reported and the job ends (None: "
                        f"{STARTUP_TIMEOUT:.0f} until the first step, then max(60, 20 x the median step))")
    p.add_argument("--on-nonfinite", default=d.on_nonfinite, choices=("stop", "skip"),
                   help="a NaN/inf loss or gradient: stop and name the stage, or skip the update")
    p.add_argument("--partition", default=d.partition, metavar="profile|parameters|uniform|B0,B1,...",
                   help="stage bounds: profile (time every layer's F, B and W on the first microbatch, in parallel "
                        "over the ranks, and take the split whose simulated step is shortest; printed at start), "
                        "parameters (balance parameter counts), uniform (layer counts), or explicit bounds 0,b1,...,L")
    p.add_argument("--memory-cap", type=float, default=d.memory_cap, metavar="GiB",
                   help="with --partition profile: leave out splits whose estimated peak memory on a rank (4 x its "
                        "parameters + its activations in flight) exceeds this")
    p.add_argument("--checkpoint", default=d.checkpoint, metavar="none|full|every:K",
                   help="activation checkpointing per chunk: recompute its layers (full) or every K layers in B "
                        "instead of keeping their activations")
    p.add_argument("--precision", default=d.precision, choices=list(PRECISION_NAMES),
                   help="bf16: autocast, activations between stages in bf16, fp32 parameters, gradients and "
                        "optimizer state; fp16: the same with a dynamic loss scale, CUDA only")
    p.add_argument("--wire", default=d.wire, choices=["tags", "strict"],
                   help="Gloo: tags (transfers matched by tag, receives left running) or strict (NCCL's semantics "
                        "emulated: one tag per pair, each comm step completes before the next: what hangs on "
                        "NCCL hangs here); NCCL always coalesces each step")
    p.add_argument("--save-interval", type=int, default=d.save_interval, metavar="N",
                   help="save a checkpoint every N steps and after the last step (0: never)")
    p.add_argument("--save-dir", default=d.save_dir, help="checkpoint directory")
    p.add_argument("--keep", type=int, default=d.keep, help="keep the newest K checkpoints (0: all)")
    p.add_argument("--resume", nargs="?", const="latest", default=d.resume, metavar="PATH",
                   help="resume from PATH (a checkpoint or a save directory) or, without PATH, from the newest "
                        "complete checkpoint in --save-dir if there is one (else start at step 0); a "
                        "group restarted by torchrun (pipe.sh --max-restarts) does this by itself. With "
                        "--partition profile the checkpoint's stage bounds are reused when pp and chunks match")
    p.add_argument("--save-on-exit", action="store_true", default=d.save_on_exit,
                   help="on Ctrl-C or SIGTERM, finish the step in progress on every rank and save a checkpoint")
    p.add_argument("--async-save", action="store_true", default=d.async_save,
                   help="write checkpoints in the background (torch.distributed.checkpoint.async_save): a save "
                        "costs the step a copy of the state to host memory (and the previous save's end, if it "
                        "is still writing); it becomes visible at the next save or at the end")
    return p


def load_config(path: str) -> dict[str, Any]:
    """The settings of a TOML file, checked against :class:`TrainConfig` (names with - or _)."""
    import tomllib
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path!r} is not valid TOML: {exc}") from None
    kinds = {f.name: f.type for f in fields(TrainConfig)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in kinds:
            close = difflib.get_close_matches(name, list(kinds), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(kinds)}"
            raise ValueError(f"--config {path!r}: unknown setting {key!r}{hint}")
        want = str(kinds[name])
        ok = (isinstance(value, bool) if want == "bool" else isinstance(value, int) and not isinstance(value, bool)
              if want.startswith("int") else isinstance(value, (int, float)) and not isinstance(value, bool)
              if "float" in want else isinstance(value, str))
        if not ok:
            raise ValueError(f"--config {path!r}: {key} = {value!r} should be {want.replace(' | None', '')}")
        out[name] = float(value) if "float" in want else value
    return out


def to_toml(cfg: TrainConfig) -> str:
    """Every setting as TOML (unset ones commented out): a file to start from, and a run's record."""
    lines = ["# pipeengine.train settings (python -m pipeengine.train --config FILE)"]
    for name, value in asdict(cfg).items():
        if value is None:
            lines.append(f"# {name} =")
        elif isinstance(value, bool):
            lines.append(f"{name} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{name} = {value!r}")
        else:
            lines.append(f"{name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Defaults, then ``--config FILE``, then the flags; ``--print-config`` prints the result and exits."""
    p = _parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            p.set_defaults(**load_config(known.config))
        except ValueError as exc:
            p.exit(2, f"error: {exc}\n")
    a = vars(p.parse_args(argv))
    a.pop("config")
    show = a.pop("print_config")
    cfg = TrainConfig(**a)
    if show:
        sys.stdout.write(to_toml(cfg))
        p.exit(0)
    return cfg


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Run one training job (see runner.py)."""
    from .runner import run as _run
    return _run(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit 0 done, 2 bad input, 3 an explained failure, 128+N stopped by signal N, 1 a crash.

    After a failure the process group may hold waits that never end: the process ends without
    tearing it down (see faults.py), and only rank 0 shows a crash's traceback (other ranks'
    reach rank 0 through the store). Every path ends with ``os._exit`` once the output is
    flushed: C++ objects of torch.distributed (store and Gloo threads) destroyed at interpreter
    exit sometimes abort the process ("terminate called without an active exception"), which
    would turn a finished run into a crash.
    """
    cfg = parse_args(argv)
    import traceback

    import torch.distributed as dist
    try:
        run(cfg)
    except SystemExit as exc:
        _end(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:
        if not dist.is_initialized() or dist.get_rank() == 0:
            traceback.print_exc()
        _end(1)
    _end(0)


def _end(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
