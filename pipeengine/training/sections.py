"""The trainer's settings by concern: one dataclass per section, one ``setting(...)`` per option (torch-free).

Each setting carries its default, help text, command-line flag and check; config.py gathers the
sections into :class:`~pipeengine.training.config.Config` and the flat list that the command line,
``--help``, ``--config`` TOML and ``--print-config`` (cli.py) are generated from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..runtime.logs import LEVELS
from ..runtime.options import BOUNDARY_DTYPES, ON_NONFINITE, PRECISIONS, WIRE_MODES
from ..schedule.builders import SCHEDULES
from . import checks
from .checks import BUILTIN_MODELS, Check, at_least, finite

if TYPE_CHECKING:
    import torch

__all__ = ["setting", "ModelConfig", "DataConfig", "ParallelConfig", "ScheduleConfig", "OptimizerConfig",
           "PrecisionConfig", "RecomputeConfig", "SavingConfig", "FaultsConfig", "LoggingConfig", "MODELS",
           "TRAINING_SCHEDULES"]

MODELS = BUILTIN_MODELS
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
    context: int | None = setting(None, "context length in tokens, for a model whose function takes context= (gpt: "
                                        "None is the preset's)", check=at_least(1, "a positive number of tokens"),
                                  metavar="N")
    packing: str | None = setting(None, "how documents of different lengths become microbatches, for a model whose "
                                        "function takes packing= (gpt: None is ragged): pad one per row to the "
                                        "context; pack several per row, attention within each; ragged each "
                                        "microbatch its own shape, one per row (gpt on CPU at long contexts: "
                                        "one row of them end to end, no padding; docs: "
                                        "pipeengine/training/packing.py)",
                                  choices=("pad", "pack", "ragged"))


@dataclass
class DataConfig:
    """What it trains on, and how much per step."""

    path: str | None = setting(None, "gpt: a text file or folder (each file a document) or a tokens.bin with its "
                                     "tokens.idx; resnet: an ImageFolder root (None: the stdlib's definitions as "
                                     "documents / FakeData, made locally)", flag="--data")
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
    static_shapes: bool = setting(False, "training steps keep the first one's tensor shapes between stages: no shape "
                                         "header after it (on CUDA the host no longer waits for one per stage and "
                                         "step); a step whose shapes changed is refused")
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
    memory_budget: float | None = setting(None, "with --partition profile: the most memory a rank may take, the "
                                                "process's own included (on CPU above its baseline before the model "
                                                "is built, on CUDA the allocator's peak); the schedule (with "
                                                "--schedule auto; else the one named), recompute per stage, the "
                                                "split and pieces per microbatch are chosen together for the "
                                                "shortest predicted step whose predicted peak fits in 90%% of it "
                                                "(the rest for what the twin misses)",
                                          check=finite(0, above=True, what="number of GiB"), metavar="GiB")
    whole_microbatches: bool = setting(False, "with --memory-budget: never run a microbatch as 2 or 4 equal pieces "
                                              "(the budget may, where the loss adds up over them and no layer "
                                              "normalises over the batch: the same step in less memory)")
    dry_run: bool = setting(False, "set up, profile and plan, print the twin's prediction (the step time and each "
                                   "rank's peak memory by part, beside the schedule, split and recompute) and exit "
                                   "before the first step; for a cluster not at hand: python -m pipeengine.plan")
    link_gbps: float | None = setting(None, "with --partition profile: the bandwidth of every link between pipeline "
                                            "neighbours, in Gbit/s (latency taken as 0), instead of measuring each "
                                            "link at start (round trips between each pair)",
                                      check=finite(0, above=True, what="number of Gbit/s"), metavar="Gbit/s")


@dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule: linear warmup, then cosine decay to min_lr."""

    name: str = setting("adamw", "optimizer: torch's AdamW, or SGD with momentum 0.9 (torch's fused step where "
                                 "the device has one: CPU, CUDA)", flag="--optimizer", choices=("adamw", "sgd"))
    steps: int = setting(50, "optimizer steps", check=at_least(1))
    lr: float = setting(3e-3, "peak learning rate (after warmup)", check=finite(0, above=True))
    min_lr: float = setting(3e-4, "final learning rate of the cosine decay", check=finite(0))
    warmup: int = setting(5, "linear warmup steps", check=at_least(0))
    weight_decay: float = setting(0.0, "weight decay", check=finite(0))
    grad_clip: float | None = setting(1.0, "global grad-norm clip (<= 0: off)", check=checks.grad_clip)

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer for ``params`` (the engine's factory), at the peak learning rate: torch's fused
        implementation where the parameters' device has one (CPU and CUDA: one kernel per parameter, the default
        implementation's results up to rounding; on CPU an AdamW step about 6x faster: benchmarks/README.md), else
        the default one."""
        import torch   # not at the top: --help stays quick

        def make(fused: bool | None) -> torch.optim.Optimizer:
            if self.name == "sgd":
                return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay, momentum=0.9, fused=fused)
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, fused=fused)
        try:
            return make(True)
        except RuntimeError:   # a device (or dtype) without fused kernels
            return make(None)


@dataclass
class PrecisionConfig:
    """Numeric precision of compute and of what travels between stages."""

    mode: str = setting("fp32", "bf16: autocast, activations between stages in bf16, fp32 parameters, gradients "
                                "and optimizer state; fp16: the same with a dynamic loss scale, CUDA only",
                        flag="--precision", choices=PRECISIONS)
    boundary: str = setting("fp32", "bf16: fp32 activations and their gradients cross between stages as bf16 (half "
                                    "the pipeline traffic; results then depend on the split)",
                            flag="--boundary-dtype", choices=BOUNDARY_DTYPES)


@dataclass
class RecomputeConfig:
    """Activation recompute: memory for compute."""

    policy: str = setting("none", "recompute a stage's layers in B instead of keeping their activations: none, "
                                  "selective (each layer keeps its matrix products' outputs, recomputes the rest), "
                                  "full (the whole stage) or every:K (every K layers); --checkpoint is its old name",
                          flag="--recompute", aliases=("--checkpoint",), check=checks.recompute,
                          metavar="none|selective|full|every:K")


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
                                       "the run says so", flag="--exit-save-budget", metavar="S",
                                 check=checks.seconds("25 s: torchrun kills its workers 30 s after its SIGTERM",
                                                      "writing a checkpoint"))
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
    collective_timeout: float = setting(
        1800.0, "seconds one collective may take before the process group gives up (long: a checkpoint write is a "
                "legitimate slow collective); hangs are found and explained by --timeout",
        check=checks.seconds("1800 s: long, for legitimately slow collectives such as a checkpoint write",
                             "one collective"))


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
    level: str = setting("info", "what the log shows (logging, logger 'pipeengine', each record carrying its rank): "
                                 "debug, info, warning (notes and restarts), error", flag="--log-level",
                         choices=LEVELS)
    timeline_interval: int = setting(25, "also log the pipeline timeline image every N steps (it is always logged "
                                         "for the first step after warm-up and the last; 0: only those)",
                                     check=at_least(0))
    trace_step: int | None = setting(None, "write a Chrome/Perfetto trace of this step", check=at_least(0))
    peak_tflops: float | None = setting(None, "the device's peak TFLOP/s, for MFU (None: from a table of known GPUs "
                                              "for the precision; none on CPU)", check=finite(0, above=True),
                                        metavar="TFLOPS")
