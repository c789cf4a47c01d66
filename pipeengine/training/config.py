"""The trainer's settings, defined once: one dataclass per concern, one ``setting(...)`` per option (torch-free).

Each setting carries its default, help text, command-line flag and check; the command line,
``--help``, ``--config`` TOML, ``--print-config`` (cli.py) and the checks are all generated from
these declarations, so a value is checked the same way whether it came from a flag or a file.
:meth:`Config.resolve` then checks what involves several settings or the world size.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from ..runtime.options import ON_NONFINITE, PRECISIONS, WIRE_MODES
from ..runtime.topology import Topology
from ..schedule.builders import ANY_CHUNKS, SCHEDULES, default_chunks
from . import checks
from .batch import Batch, split_global_batch
from .checks import BUILTIN_MODELS, Check, at_least, finite

if TYPE_CHECKING:
    import torch

__all__ = ["Config", "ModelConfig", "DataConfig", "ParallelConfig", "ScheduleConfig", "OptimizerConfig",
           "PrecisionConfig", "RecomputeConfig", "SavingConfig", "FaultsConfig", "LoggingConfig", "Setting",
           "settings", "flat_config", "MODELS", "TRAINING_SCHEDULES"]

MODELS = BUILTIN_MODELS
Replan = Callable[[int, int, int], tuple[int, str]]   # (world, --pp, chunks) -> (pp, why): elastic.py
TRAINING_SCHEDULES = (*(s for s in SCHEDULES if s != "forward"), "auto")


def setting(default: Any, help: str, *, flag: str | None = None, short: str | None = None,
            choices: Sequence[str] | None = None, check: Check | None = None, metavar: str | None = None,
            aliases: Sequence[str] = ()) -> Any:
    """A field of a section: its default, its help, and how the command line and files give it."""
    meta = {"help": help, "flag": flag, "short": short, "choices": tuple(choices) if choices else None,
            "check": check, "metavar": metavar, "aliases": tuple(aliases)}
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------ the sections

@dataclass
class ModelConfig:
    """What to train."""

    name: str = setting("gpt", "the model: gpt, resnet, mlp (built in) or package.module:function returning a "
                               "pipeengine.Model (see README: your own model)", flag="--model", check=checks.model_spec,
                        metavar="NAME|MODULE:FUNCTION")
    preset: str | None = setting(None, "the model's named size (None: its default, tiny for the built-ins)")
    seed: int = setting(1234, "seed of the weights, the data order and every layer's random stream (dropout masks "
                              "keyed to layer, microbatch and step: the same whatever the layout)", check=checks.seed)
    dropout: float | None = setting(None, "dropout probability, for a model whose function takes dropout= (the "
                                          "built-ins do; None: the model's own, 0 for the built-ins)",
                                    check=checks.probability, metavar="P")


@dataclass
class DataConfig:
    """What it trains on, and how much per step."""

    path: str | None = setting(None, "gpt: a text file or folder; resnet: an ImageFolder root (None: a byte "
                                     "corpus / FakeData made locally)", flag="--data")
    global_batch: int | None = setting(None, "examples per optimizer step over all replicas, whatever pp x dp; dp "
                                             "need not divide it (None: 32, or dp x 2pp if more, or dp x -m x -b "
                                             "when both are given; a resumed run keeps its checkpoint's)",
                                       check=at_least(1, "a positive number of examples"))
    micro_batch_size: int | None = setting(None, "examples per microbatch (None: what the global batch and "
                                                 "--microbatches leave)", short="-b", check=at_least(1))
    workers: int | None = setting(None, "processes reading ahead on each rank that reads data (torch.utils.data."
                                        "DataLoader workers; 0: read in the training process; None: 2 on CUDA, 0 "
                                        "on CPU, where workers would take the ranks' cores)", flag="--data-workers",
                                  check=at_least(0))


@dataclass
class ParallelConfig:
    """How the processes split the work."""

    pp: int | None = setting(None, "pipeline positions (None: all processes)", check=at_least(1))
    dp: int | None = setting(None, "data-parallel replicas (None: world / pp)", check=at_least(1))
    device: str = setting("auto", "where to run", choices=("auto", "cpu", "cuda"))
    backend: str = setting("auto", "torch.distributed backend", choices=("auto", "gloo", "nccl"))
    wire: str = setting("tags", "Gloo: tags (transfers matched by tag, receives left running) or strict (NCCL's "
                                "semantics emulated: one tag per pair, each comm step completes before the next: "
                                "what hangs on NCCL hangs here); NCCL always coalesces each step",
                        choices=WIRE_MODES)
    zero: int = setting(0, "ZeRO stage: 1 shards the optimizer state over each stage's data-parallel replicas (each "
                           "rank holds 1/dp of it; gradients reduce-scattered, parameters all-gathered), 0 keeps a "
                           "whole copy per replica", check=checks.zero, metavar="{0,1}")


@dataclass
class ScheduleConfig:
    """The pipeline schedule and the split of the layers into stages."""

    name: str = setting("1f1b", "the pipeline schedule (auto: the schedule and the split chosen together from the "
                        "measured layer costs, with --partition profile)", flag="--schedule",
                        choices=TRAINING_SCHEDULES)
    chunks: int = setting(0, "stages per position (0: the schedule's own, 2 for the interleaved and V ones, else 1)",
                          check=at_least(0))
    microbatches: int | None = setting(None, "microbatches per step per replica, the most when dp does not divide "
                                             "them (None: at least max(4, 2 x pp) when the global batch allows, "
                                             "in the largest microbatches that give as many)", short="-m",
                                       check=at_least(1))
    partition: str = setting("profile", "stage bounds: profile (time every layer's F, B and W on the first "
                                        "microbatch, in parallel over the ranks, and take the split whose simulated "
                                        "step is shortest; printed at start), parameters (balance parameter counts), "
                                        "uniform (layer counts), or explicit bounds 0,b1,...,L",
                             check=checks.partition, metavar="profile|parameters|uniform|B0,B1,...")
    memory_cap: float | None = setting(None, "with --partition profile: leave out splits whose estimated peak memory "
                                             "at a position (4 x its parameters + its activations in flight) exceeds "
                                             "this", check=finite(0, above=True, what="number of GiB"), metavar="GiB")


@dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule: linear warmup, then cosine decay to min_lr."""

    name: str = setting("adamw", "optimizer", flag="--optimizer", choices=("adamw", "sgd"))
    steps: int = setting(50, "optimizer steps", check=at_least(1))
    lr: float = setting(3e-3, "peak learning rate (after warmup)", check=finite(0, above=True))
    min_lr: float = setting(3e-4, "final learning rate of the cosine decay", check=finite(0))
    warmup: int = setting(5, "linear warmup steps", check=at_least(0))
    weight_decay: float = setting(0.0, "weight decay", check=finite(0))
    grad_clip: float | None = setting(1.0, "global grad-norm clip (<= 0: off)", check=checks.grad_clip)

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer for ``params`` (the engine's factory), at the peak learning rate."""
        import torch   # not at the top: --help stays quick
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


@dataclass
class PrecisionConfig:
    """Numeric precision of compute and of what travels between stages."""

    mode: str = setting("fp32", "bf16: autocast, activations between stages in bf16, fp32 parameters, gradients "
                                "and optimizer state; fp16: the same with a dynamic loss scale, CUDA only",
                        flag="--precision", choices=PRECISIONS)


@dataclass
class RecomputeConfig:
    """Activation recompute: memory for compute."""

    policy: str = setting("none", "recompute a stage's layers in B instead of keeping their activations: none, "
                                  "full (the whole stage) or every:K (every K layers); --checkpoint is its old name",
                          flag="--recompute", aliases=("--checkpoint",), check=checks.recompute,
                          metavar="none|full|every:K")


@dataclass
class SavingConfig:
    """Checkpoints (saved training state) and resuming."""

    interval: int = setting(0, "save a checkpoint every N steps and after the last step (0: never)",
                            flag="--save-interval", check=at_least(0), metavar="N")
    dir: str = setting("checkpoints", "checkpoint directory", flag="--save-dir")
    keep: int = setting(3, "keep the newest K checkpoints (0: all)", check=at_least(0))
    resume: str | None = setting(None, "resume from PATH (a checkpoint or a save directory) or, without PATH, from "
                                       "the newest complete checkpoint in --save-dir if there is one (else start at "
                                       "step 0); a group restarted by torchrun (pipe.sh --max-restarts) does this by "
                                       "itself. With --partition profile the checkpoint's stage bounds are reused "
                                       "when pp and chunks match", metavar="PATH")
    on_exit: bool = setting(False, "on Ctrl-C or SIGTERM, finish the step in progress on every rank and save a "
                                   "checkpoint", flag="--save-on-exit")
    exit_budget: float = setting(25.0, "seconds a save on SIGTERM may take (torchrun kills the workers 30 s after "
                                       "its SIGTERM): when the last save took longer, the exit save is skipped and "
                                       "the run says so", flag="--exit-save-budget", check=checks.timeout, metavar="S")
    background: bool = setting(False, "write checkpoints in the background (torch.distributed.checkpoint."
                                      "async_save): a save costs the step a copy of the state to host memory (and the "
                                      "previous save's end, if it is still writing); it becomes visible at the next "
                                      "save or at the end", flag="--async-save")


@dataclass
class FaultsConfig:
    """What happens when something goes wrong."""

    timeout: float | None = setting(None, "seconds a wait may take before every rank's wait is reported and the job "
                                          "ends (None: 600 until the first step, then max(60, 20 x the median step))",
                                    check=checks.timeout)
    on_nonfinite: str = setting("stop", "a NaN/inf loss or gradient: stop and name the stage, or skip the update",
                                choices=ON_NONFINITE)
    collective_timeout: float = setting(1800.0, "seconds one collective may take before the process group gives up "
                                                "(long: a checkpoint write is a legitimate slow collective); hangs "
                                                "are found and explained by --timeout", check=checks.timeout)


@dataclass
class LoggingConfig:
    """What the run shows and writes."""

    dir: str = setting("runs", "TensorBoard root", flag="--log-dir")
    run_name: str | None = setting(None, "sub-directory of --log-dir (None: model-schedule-layout-time)")
    eval_interval: int = setting(25, "validate every N steps (0: only at the end)", check=at_least(0))
    log_interval: int = setting(0, "a progress line (when not on a terminal) and every rank's timings (bubble, "
                                   "per-position views) every N steps; loss and throughput go to TensorBoard every "
                                   "step (0: steps / 50, about 50 lines)", check=at_least(0))
    quiet: bool = setting(False, "no progress output; errors and the summary")
    timeline_interval: int = setting(25, "also log the pipeline timeline image every N steps (it is always logged "
                                         "for the first step after warm-up and the last; 0: only those)",
                                     check=at_least(0))
    trace_step: int | None = setting(None, "write a Chrome/Perfetto trace of this step", check=at_least(0))
    peak_tflops: float | None = setting(None, "the device's peak TFLOP/s, for MFU (None: from a table of known GPUs "
                                              "for the precision; none on CPU)", check=finite(0, above=True),
                                        metavar="TFLOPS")


@dataclass
class Config:
    """Everything a training run needs; build it with cli.parse_args, check it with :meth:`resolve`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    saving: SavingConfig = field(default_factory=SavingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def resolve(self, world_size: int, replan: Replan | None = None) -> Topology:
        """Check what involves several settings or the world; fill the derived ones (chunks, log interval,
        microbatch size); return the PP x DP grid. A ValueError names the flags and how to fix them.
        ``replan(world, pp, chunks) -> (pp, why)``: an elastic group's pipeline depth when ``--pp`` does not
        divide the world (elastic.py; default: the deepest divisor up to ``--pp``)."""
        for s in settings():
            s.set(self, s.checked(s.get(self)))
        sch, opt, log = self.schedule, self.optimizer, self.logging
        if sch.chunks == 0:
            sch.chunks = default_chunks(sch.name)
        if sch.name == "auto" and sch.chunks != 1:
            raise ValueError(f"--schedule auto chooses the stages per position itself (got --chunks {sch.chunks}); "
                             f"drop --chunks")
        if sch.name in ANY_CHUNKS and sch.chunks < 2:
            raise ValueError(f"--schedule {sch.name} needs --chunks >= 2 (got {sch.chunks}); use 1f1b for "
                             f"one stage per position")
        if sch.name not in ANY_CHUNKS and sch.chunks != default_chunks(sch.name):
            n = default_chunks(sch.name)
            raise ValueError(f"--schedule {sch.name} runs {'one stage' if n == 1 else f'{n} stages'} per position "
                             f"(got --chunks {sch.chunks}); use interleaved-1f1b for any number")
        if sch.name == "auto" and sch.partition != "profile":
            raise ValueError(f"--schedule auto chooses the schedule and the split together from measured layer costs: "
                             f"use --partition profile (the default), not {sch.partition!r}")
        if sch.memory_cap is not None and sch.partition != "profile":
            raise ValueError("--memory-cap is planned for by --partition profile only; drop it or use profile")
        if opt.min_lr > opt.lr:
            raise ValueError(f"--min-lr {opt.min_lr:g} is above --lr {opt.lr:g}; the cosine decay ends at --min-lr")
        if log.trace_step is not None and not 0 <= log.trace_step < opt.steps:
            raise ValueError(f"--trace-step {log.trace_step} is not one of the run's steps 0..{opt.steps - 1}")
        if log.log_interval == 0:
            log.log_interval = max(1, opt.steps // 50)
        topo = self._topology(world_size, replan)
        self.set_batch(split_global_batch(topo.dp, *self.given_batch(), pp=topo.pp))
        return topo

    def given_batch(self) -> tuple[int | None, int | None, int | None]:
        """(global batch, microbatches, micro-batch size) as the user gave them (None: not given), before
        :meth:`resolve` filled them in."""
        # kept outside the dataclass fields: a record of the input, not a setting
        given = (self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size)
        return self.__dict__.setdefault("_given_batch", given)  # type: ignore[no-any-return]

    @property
    def batch(self) -> Batch:
        """The global batch and its split, once :meth:`resolve` filled them in."""
        size, m, micro = self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size
        if size is None or m is None or micro is None:
            raise RuntimeError("Config.batch is known after Config.resolve()")
        return Batch(size, m, micro)

    def set_batch(self, batch: Batch) -> None:
        self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size = batch

    def _topology(self, world_size: int, replan: Replan | None) -> Topology:
        pp, dp = self.parallel.pp, self.parallel.dp
        elastic = os.environ.get("PIPEENGINE_ELASTIC") == "1"
        if elastic and pp is not None and world_size % pp:
            # an elastic group (launch/pipe.sh NNODES=MIN:MAX) restarted at a size --pp does not divide: a pp that
            # does, fits the model and the memory (elastic.py), the rest data-parallel (the global batch stays)
            if replan is not None:
                pp, why = replan(world_size, pp, self.schedule.chunks)
            else:
                given, pp = pp, max(d for d in range(1, min(pp, world_size) + 1) if world_size % d == 0)
                why = (f"elastic: {world_size} processes: pp {pp} x dp {world_size // pp} (--pp {given} does not "
                       f"divide {world_size})")
            print(why, file=sys.stderr)
            self.parallel.pp, self.parallel.dp, dp = pp, None, None
        elif elastic and dp is not None and pp is not None and pp * dp != world_size:
            self.parallel.dp = dp = None   # elastic: dp follows the world
        if pp is not None and world_size % pp:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"world size {world_size} is not divisible by --pp {pp}; use --pp in {divisors} or "
                             f"launch a multiple of {pp} processes")
        try:
            return Topology.from_world(world_size, pp=pp, dp=dp)
        except ValueError as exc:
            raise ValueError(f"bad --pp/--dp for {world_size} processes: {exc}") from None

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
        opt = self.optimizer
        if step < opt.warmup:
            return opt.lr * (step + 1) / opt.warmup
        progress = (step - opt.warmup) / max(1, opt.steps - opt.warmup)
        return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every setting by section (the form summaries and checkpoint manifests record)."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (the flag's name, ``micro_batch_size``)."""
        return {s.key: s.get(self) for s in settings()}

    def computation(self) -> dict[str, Any]:
        """The settings every rank must have alike, by flag: all but how the run is shown (the logging section)
        and how fast its data is read (``--data-workers``)."""
        return {s.flag: s.get(self) for s in settings() if s.section != "logging" and s.flag != "--data-workers"}


# ------------------------------------------------------------------ the settings as a flat list

@dataclass(frozen=True)
class Setting:
    """One setting: where it lives (section, field), how the command line names it, how it is checked."""

    section: str
    name: str
    type: str           # "int", "float", "str" or "bool"
    optional: bool      # None allowed
    default: Any
    help: str
    flag: str
    short: str | None
    aliases: tuple[str, ...]
    choices: tuple[str, ...] | None
    check: Check | None
    metavar: str | None

    @property
    def key(self) -> str:
        """The flat name used in old TOML files and in messages: the flag without its dashes."""
        return self.flag[2:].replace("-", "_")

    def get(self, cfg: Config) -> Any:
        return getattr(getattr(cfg, self.section), self.name)

    def set(self, cfg: Config, value: Any) -> None:
        setattr(getattr(cfg, self.section), self.name, value)

    def checked(self, value: Any, name: str | None = None) -> Any:
        """``value`` if this setting allows it (choices, range); else ValueError naming ``name`` (the flag)."""
        name = name or self.flag
        if value is None:
            if not self.optional:
                raise ValueError(f"{name} needs a value")
            return None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} {value!r} is not one of {', '.join(self.choices)}")
        return self.check(name, value) if self.check is not None else value


_SECTIONS: tuple[tuple[str, Callable[[], Any]], ...] = tuple(
    (f.name, f.default_factory) for f in dataclasses.fields(Config))   # type: ignore[misc]


def _type_of(annotation: str) -> tuple[str, bool]:
    optional = "None" in annotation
    return annotation.replace(" | None", "").strip(), optional


def flat_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded config by flat key, from the sectioned form (:meth:`Config.to_dict`) or the flat one that
    records made before sections hold (``checkpoint`` there is recompute's old name)."""
    by_field = {(s.section, s.name): s.key for s in settings()}
    by_alias = {a[2:].replace("-", "_"): s.key for s in settings() for a in s.aliases}
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, dict):
            out.update({by_field[(key, k)]: v for k, v in value.items() if (key, k) in by_field})
        else:
            out[by_alias.get(key, key)] = value
    return out


def settings() -> Iterator[Setting]:
    """Every setting, section by section, in declaration order."""
    for section, factory in _SECTIONS:
        for f in dataclasses.fields(factory()):
            kind, optional = _type_of(str(f.type))
            m = f.metadata
            yield Setting(section, f.name, kind, optional, f.default, m["help"], m["flag"] or "--" + f.name.replace(
                "_", "-"), m["short"], m["aliases"], m["choices"], m["check"], m["metavar"])
