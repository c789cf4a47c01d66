"""``python -m pipeengine.plan``: a dry run for the cluster, a projection of the best pp x dp, schedule and recompute.

Nothing runs and no process starts: the model (the built-in GPT, its size by preset or flags) is built on the
meta device one layer kind at a time, its FLOPs and the bytes it keeps for backward counted
(training/meta_costs.py); every pp x dp of the world, schedule and recompute policy is scored by the twin
(runtime/twin.py) for the GPU's spec-sheet figures (training/hardware.py), and the fitting one with the most
tokens/s is printed (training/projection.py). A projection, not a measurement: its assumptions are printed with it.

    python -m pipeengine.plan --preset 7b --nodes 8 --gpu h100
    python -m pipeengine.plan --preset 70b --nodes 128 --gpu h100 --json plan.json
    python -m pipeengine.plan --layers 48 --width 6144 --heads 48 --context 8192 --gpus 256 --gpu h200

Exit status 0 with the projection, 2 with one line when the input is wrong or nothing fits the GPU's memory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, NoReturn, Sequence

from .training.hardware import GPUS, World, gpu_preset

__all__ = ["main", "parser"]

FLAGS = {"n_embd": "--width", "n_head": "--heads", "n_layer": "--layers", "block_size": "--context",
         "vocab_size": "--vocab"}
TOKENS_PER_STEP = 2**22   # the default global batch: about 4M tokens a step (Llama 2's), in whole sequences


class _Parser(argparse.ArgumentParser):
    """Errors in one line (``plan: error: ...``) and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"plan: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value
    return parse


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is above 1")
    return float(value)


def parser() -> argparse.ArgumentParser:
    presets = importlib.import_module("pipeengine.models.presets")   # torch-free: --help stays quick
    names = [*presets.PRESETS["gpt"], *presets.PLAN_SIZES]
    p = _Parser(prog="python -m pipeengine.plan",
                description="A dry run for the cluster: the pp x dp, schedule, recompute and microbatches with the "
                            "most predicted tokens/s that fit the GPUs' memory (a projection, not a measurement; "
                            "nothing runs).",
                epilog="The GPT is GPT-2-shaped (MLP 4x, learned positions, LayerNorm, the head tied to the "
                       "embedding): a '70b' is a GPT-2-shaped model of about that size, not Llama 2. Every figure is "
                       "a prediction of the twin; it assumes what the last line of the output says.")
    m = p.add_argument_group("model (the built-in GPT; flags override the preset's sizes)")
    m.add_argument("--model", default="gpt", choices=["gpt"], help="the model (only the built-in GPT)")
    m.add_argument("--preset", default="7b", choices=names, help="its size (default 7b: 32 x 4096, 32 heads, "
                   "context 4096, vocab 32000; 13b 40 x 5120; 70b 80 x 8192, 64 heads)")
    for flag, what in (("layers", "transformer blocks"), ("width", "model width (n_embd)"),
                       ("heads", "attention heads (must divide the width)"), ("context", "tokens per sequence"),
                       ("vocab", "vocabulary size")):
        m.add_argument(f"--{flag}", type=_positive(int), metavar="N", help=what)
    w = p.add_argument_group("world")
    w.add_argument("--nodes", type=_positive(int), metavar="N", help="nodes (default 1)")
    w.add_argument("--gpus", type=_positive(int), metavar="N", help="GPUs in all, instead of --nodes (a multiple of "
                   "--gpus-per-node)")
    w.add_argument("--gpus-per-node", type=_positive(int), default=8, metavar="N", help="GPUs per node (default 8)")
    h = p.add_argument_group("hardware (a preset, any figure overridden)")
    h.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(GPUS)} (default h100; --list-gpus)")
    h.add_argument("--list-gpus", action="store_true", help="print the presets and their sources, and exit")
    for flag, what in (("tflops", "dense bf16 peak TFLOP/s"), ("memory-gib", "memory per GPU, GiB"),
                       ("memory-gbs", "memory bandwidth, GB/s"), ("intra-gbs", "to a GPU of the same node, GB/s"),
                       ("inter-gbs", "to a GPU of another node, GB/s (the network per GPU)")):
        h.add_argument(f"--{flag}", type=_positive(float), metavar="X", help=what)
    r = p.add_argument_group("run")
    r.add_argument("--global-batch", type=_positive(int), metavar="N", help="sequences a step (default: about 4M "
                   "tokens, 2^22 / context, rounded up to a multiple of GPUs x micro batch)")
    r.add_argument("--micro-batch", type=_positive(int), default=1, metavar="N", help="sequences per microbatch "
                   "(default 1)")
    r.add_argument("--mfu", type=_fraction, default=0.5, metavar="X",
                   help="fraction of the dense peak the layers' kernels reach (default 0.5)")
    r.add_argument("--reserve", type=float, default=0.10, metavar="X",
                   help="fraction of each GPU's memory kept back for what the twin does not count: CUDA context, NCCL "
                        "buffers, fragmentation (default 0.10)")
    r.add_argument("--zero", type=int, default=0, choices=(0, 1), help="1: ZeRO-1, the optimizer state sharded over "
                   "dp (default 0, as the trainer)")
    r.add_argument("--json", metavar="PATH", help="also write the projection as JSON")
    return p


def _world(args: argparse.Namespace) -> World:
    gpu = gpu_preset(args.gpu, tflops=args.tflops, memory_gib=args.memory_gib, memory_gbs=args.memory_gbs,
                     intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs)
    if args.gpus is not None and args.nodes is not None:
        raise ValueError("give --nodes or --gpus, not both")
    if args.gpus is not None:
        if args.gpus % args.gpus_per_node:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}")
        return World(args.gpus // args.gpus_per_node, args.gpus_per_node, gpu)
    return World(args.nodes or 1, args.gpus_per_node, gpu)


def _model_text(args: argparse.Namespace, cfg: Any) -> str:
    resized = any(getattr(args, k) for k in ("layers", "width", "heads", "context", "vocab"))
    named = args.preset + (" resized" if resized else "")
    return (f"GPT-2-shaped {named}: {cfg.n_layer} blocks x {cfg.n_embd} wide, {cfg.n_head} heads, context "
            f"{cfg.block_size}, vocab {cfg.vocab_size}")


def _run(args: argparse.Namespace) -> int:
    world = _world(args)
    if not 0 <= args.reserve < 1:
        raise ValueError(f"--reserve must be in [0, 1) (got {args.reserve:g})")
    from .training.meta_costs import gpt_config, gpt_work   # torch: not for --help
    from .training.projection import NoFit, Settings, project
    from .training.projection_report import as_json, describe
    cfg = gpt_config(args.preset, n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                     block_size=args.context, vocab_size=args.vocab)
    unit = world.size * args.micro_batch
    batch = args.global_batch or -(-max(TOKENS_PER_STEP // cfg.block_size, 1) // unit) * unit
    settings = Settings(batch, args.micro_batch, cfg.block_size, mfu=args.mfu, reserve=args.reserve,
                        zero=bool(args.zero))
    model = _model_text(args, cfg)
    out = open(args.json, "w") if args.json else None   # a path that cannot be written fails before the search
    try:
        projection = project(gpt_work(cfg, args.micro_batch), world, settings)
        print(describe(projection, model, world, settings))
        if out is not None:
            json.dump(as_json(projection, model, world, settings), out, indent=1)
            out.write("\n")
    except NoFit as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    finally:
        if out is not None:
            out.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = parser().parse_args(argv)
    if args.list_gpus:
        for name, gpu in GPUS.items():
            print(f"{name:6} {gpu.describe()}\n       source: {gpu.source}")
        return 0
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        text = str(e)
        for field, flag in FLAGS.items():   # the model's checks name its fields: say the flags instead
            text = text.replace(field, flag)
        print(f"plan: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
