"""``python -m pipeengine.plan``: a dry run for the cluster, a projection of the best pp x dp, schedule and recompute.

Nothing runs and no process starts: the model (the built-in GPT, its size by preset or flags) is built on the
meta device one layer kind at a time, its FLOPs and the bytes it keeps for backward counted
(training/meta_costs.py); every pp x dp of the world, schedule and recompute policy is scored by the twin
(runtime/twin.py) for the GPU's spec-sheet figures (training/hardware.py), and the fitting one with the most
tokens/s is printed (training/projection.py). A projection, not a measurement: its assumptions are printed with it.

    python -m pipeengine.plan --preset 7b --nodes 8 --gpu h100
    python -m pipeengine.plan --preset 70b --nodes 128 --gpu h100 --json plan.json
    python -m pipeengine.plan --layers 48 --width 6144 --heads 48 --context 8192 --gpus 256 --gpu h200

Exit status 0 with the projection, 2 with one line when the input is wrong or nothing fits the GPU's memory
(``--json`` is written only with a projection).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, NoReturn, Sequence

from .training.checks import output_problem
from .training.hardware import GPUS, RANGES, World, gpu_preset

__all__ = ["main", "parser"]

FLAGS = {"n_embd": "--width", "n_head": "--heads", "n_layer": "--layers", "block_size": "--context",
         "vocab_size": "--vocab"}
TOKENS_PER_STEP = 2**22   # the default global batch: about 4M tokens a step (Llama 2's), in whole sequences
# the most each size may be: well past today's models, small enough that every tensor's byte count fits torch's
# int64 (a model past them is refused in one line, not with a traceback; within them a deep pipeline, pp in the
# hundreds, can still take minutes to search)
MOST = {"layers": 1024, "width": 131072, "heads": 1024, "context": 2**20, "vocab": 2**24, "nodes": 16384,
        "gpus": 131072, "gpus_per_node": 64, "global_batch": 2**24, "micro_batch": 4096}


class _Parser(argparse.ArgumentParser):
    """Errors in one line (``plan: error: ...``) and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"plan: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind: type, most: float = float("inf")) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not abs(value) < float("inf"):   # inf and nan
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        if value > most:
            raise argparse.ArgumentTypeError(f"{text} is above {most:,} (the most accepted)")
        return value
    return parse


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is above 1")
    if value < 0.01:
        raise argparse.ArgumentTypeError(f"{text} is below 0.01 (1% of peak)")
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
        m.add_argument(f"--{flag}", type=_positive(int, MOST[flag]), metavar="N", help=f"{what} (at most "
                       f"{MOST[flag]:,})")
    w = p.add_argument_group("world")
    w.add_argument("--nodes", type=_positive(int, MOST["nodes"]), metavar="N", help="nodes (default 1)")
    w.add_argument("--gpus", type=_positive(int, MOST["gpus"]), metavar="N", help="GPUs in all, instead of --nodes "
                   "(a multiple of --gpus-per-node; fewer than a node's: one node of that many)")
    w.add_argument("--gpus-per-node", type=_positive(int, MOST["gpus_per_node"]), metavar="N",
                   help="GPUs per node (default 8)")
    h = p.add_argument_group("hardware (a preset, any figure overridden)")
    h.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(GPUS)} (default h100; --list-gpus)")
    h.add_argument("--list-gpus", action="store_true", help="print the presets and their sources, and exit")
    for flag, what in (("tflops", "dense bf16 peak TFLOP/s"), ("memory-gib", "memory per GPU, GiB"),
                       ("memory-gbs", "memory bandwidth, GB/s"), ("intra-gbs", "to a GPU of the same node, GB/s"),
                       ("inter-gbs", "to a GPU of another node, GB/s (the network per GPU)")):
        low, high, _ = RANGES[flag.replace("-", "_")]
        h.add_argument(f"--{flag}", type=_positive(float), metavar="X", help=f"{what} ({low:,g} to {high:,g})")
    r = p.add_argument_group("run")
    r.add_argument("--global-batch", type=_positive(int, MOST["global_batch"]), metavar="N", help="sequences a step, "
                   "kept: a pp whose dp x micro batch does not divide it is skipped (default: about 4M tokens, 2^22 "
                   "/ context sequences, rounded for each pp to the nearest multiple of its dp x micro batch)")
    r.add_argument("--micro-batch", type=_positive(int, MOST["micro_batch"]), default=1, metavar="N",
                   help="sequences per microbatch (default 1)")
    r.add_argument("--mfu", type=_fraction, default=0.5, metavar="X",
                   help="fraction of the dense peak the layers' kernels reach, 0.01 to 1 (default 0.5)")
    r.add_argument("--reserve", type=float, default=0.10, metavar="X",
                   help="fraction of each GPU's memory kept back for what the twin does not count: CUDA context, NCCL "
                        "buffers, fragmentation (default 0.10)")
    r.add_argument("--zero", type=int, default=0, choices=(0, 1), help="1: ZeRO-1, the optimizer state sharded over "
                   "dp (default 0, as the trainer)")
    r.add_argument("--json", metavar="PATH", help="also write the projection as JSON (only when there is one)")
    return p


def _world(args: argparse.Namespace) -> World:
    gpu = gpu_preset(args.gpu, tflops=args.tflops, memory_gib=args.memory_gib, memory_gbs=args.memory_gbs,
                     intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs)
    if args.gpus is not None and args.nodes is not None:
        raise ValueError("give --nodes or --gpus, not both")
    per_node = args.gpus_per_node or 8
    if args.gpus is not None:
        if args.gpus < per_node:   # part of one node: its GPUs are the node's as far as the links go
            return World(1, args.gpus, gpu)
        if args.gpus % per_node:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {per_node}: give whole nodes, "
                             f"or --gpus-per-node as the nodes have")
        return World(args.gpus // per_node, per_node, gpu)
    return World(args.nodes or 1, per_node, gpu)


def _model_text(args: argparse.Namespace, cfg: Any) -> str:
    resized = any(getattr(args, k) for k in ("layers", "width", "heads", "context", "vocab"))
    named = args.preset + (" resized" if resized else "")
    return (f"GPT-2-shaped {named}: {cfg.n_layer} blocks x {cfg.n_embd} wide, {cfg.n_head} heads, context "
            f"{cfg.block_size}, vocab {cfg.vocab_size}")


def _writable(path: str) -> None:
    """ValueError when ``path`` cannot be written (checked before the search; nothing is created until the end)."""
    problem = output_problem(path)
    if problem:
        raise ValueError(f"--json: {problem}")


def _work(cfg: Any, micro_batch: int) -> Any:
    """The model's layers' work on the meta device; a size torch cannot represent is a ValueError saying which."""
    from .training.meta_costs import gpt_work   # torch: not for --help
    try:
        return gpt_work(cfg, micro_batch)
    except (RuntimeError, OverflowError) as e:   # e.g. "Storage size calculation overflowed with sizes=[...]"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the model is too large to build on the meta device ({why}); lower --vocab, --width, "
                         f"--context or --micro-batch") from None


def _run(args: argparse.Namespace) -> int:
    world = _world(args)
    if not 0 <= args.reserve < 1:
        raise ValueError(f"--reserve must be in [0, 1) (got {args.reserve:g})")
    if args.json:
        _writable(args.json)
    from .training.meta_costs import gpt_config   # torch: not for --help
    from .training.projection import NoFit, Settings, project
    from .training.projection_report import as_json, describe
    cfg = gpt_config(args.preset, n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                     block_size=args.context, vocab_size=args.vocab)
    batch = args.global_batch or max(TOKENS_PER_STEP // cfg.block_size, 1)   # the default: rounded per pp
    settings = Settings(batch, args.micro_batch, cfg.block_size, mfu=args.mfu, reserve=args.reserve,
                        zero=bool(args.zero), round_batch=args.global_batch is None)
    model = _model_text(args, cfg)
    try:
        projection = project(_work(cfg, args.micro_batch), world, settings)
    except NoFit as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print(describe(projection, model, world, settings))
    if args.json:   # written only now: a failed run leaves no file behind (nor an empty one)
        text = json.dumps(as_json(projection, model, world, settings), indent=1) + "\n"
        with open(args.json, "w") as out:
            out.write(text)
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
