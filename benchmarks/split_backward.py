"""Zero-bubble B + W against the fused backward, on GPT blocks (one process, one thread).

    python -m benchmarks.split_backward            # 4 blocks, batch 8, seq 128, width 256 (the issue's case)
    python -m benchmarks.split_backward --blocks 8 --width 512
    python -m benchmarks.split_backward --keep-freed-memory   # glibc tuned as the trainer tunes it on CPU

Run from the repository root. A middle pipeline stage of GPT blocks runs F then either the fused
backward or B then W (see [Note: split backward] in pipeengine/runtime/backward.py), alternating,
after two warm-up rounds; printed: median milliseconds of each and the ratio (B + W) / fused. 1.0
means W costs only the weight part.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeengine.models import gpt
from pipeengine.runtime.hostalloc import keep_freed_memory
from pipeengine.runtime.chain import LayerChain
from pipeengine.runtime.stage import Stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="tune glibc malloc first, as the trainer does on CPU (pipeengine/runtime/hostalloc.py)")
    a = p.parse_args()
    if a.keep_freed_memory:
        keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = gpt.Config(block_size=a.seq, n_layer=a.blocks, n_head=8, n_embd=a.width)
    chain = LayerChain([gpt.Block(cfg) for _ in range(a.blocks)], 1)
    # a middle stage of a zero-bubble schedule (segmented=True asks for segments, as the engine does): GPT blocks
    # are torch's Linear and LayerNorm only, so it runs in one part all the same and W makes no autograd call
    # ([Note: W without the engine] in pipeengine/runtime/direct.py); the fused backward is the same stage's B
    # without a W
    stage = Stage(chain, 1, 3, gpt.loss_fn, 1, segmented=True)
    x = torch.randn(a.batch, a.seq, a.width)
    gy = torch.randn(a.batch, a.seq, a.width)
    times: dict[str, list[float]] = {"fused": [], "B": [], "W": []}
    for r in range(a.rounds + 2):
        for split in (False, True) if r % 2 else (True, False):
            stage.reset()
            stage.forward(0, x.clone(), None, True)
            t0 = time.perf_counter()
            stage.backward(0, (gy,), split)
            t1 = time.perf_counter()
            if split:
                stage.backward_weight(0)
            t2 = time.perf_counter()
            if r >= 2:
                if split:
                    times["B"].append(t1 - t0)
                    times["W"].append(t2 - t1)
                else:
                    times["fused"].append(t1 - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    allocator = "kept freed memory" if a.keep_freed_memory else "glibc defaults"
    print(f"{allocator}: {a.blocks} GPT blocks, batch {a.batch}, seq {a.seq}, width {a.width}, one thread, "
          f"{a.rounds} rounds: "
          f"fused backward {med['fused']:.1f} ms, B {med['B']:.1f} ms + W {med['W']:.1f} ms = "
          f"{med['B'] + med['W']:.1f} ms, (B + W) / fused = {(med['B'] + med['W']) / med['fused']:.3f}")


if __name__ == "__main__":
    main()
