"""The layer profile on a busy machine: identical GPT blocks timed as ``partition="profile"`` times them, with
``--busy K`` processes spinning beside it, and what the planner makes of the result.

    python -m benchmarks.profile_noise                 # 8 blocks, machine as it is
    python -m benchmarks.profile_noise --busy 2        # two busy loops beside it (on 2 cores: heavily loaded)

Printed: each layer's measured F + B + W and its runs' spread; the lines the profile prints for alike layers
measured apart (each then planned with their median); and for pp 2 and 4 (1F1B, 8 microbatches) the split chosen
from the raw measurements and from the shared costs with the noise rule (the equal split kept when the gain is
inside the noise), with the makespan each would have with the layers' true (equal) cost.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from pipeengine.models import gpt
from pipeengine.runtime.planner import LayerCost, choose_bounds
from pipeengine.runtime.profile import profile_layers, shared_costs
from pipeengine.schedule import Costs, compile_schedule, simulate


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _plain(costs: list[LayerCost]) -> list[LayerCost]:
    """The costs as the profile measured them, without kinds or spread (the planner before this rule)."""
    return [LayerCost(c.f, c.b, c.w, c.fused, c.activation_bytes, c.param_bytes) for c in costs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the profile (default 0)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = gpt.Config(block_size=64, n_layer=a.blocks, n_head=4, n_embd=a.width)
    blocks = [gpt.Block(cfg) for _ in range(a.blocks)]
    x = torch.randn(4, cfg.block_size, a.width)
    busy = [mp.Process(target=_spin, args=(600.0,), daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    try:
        t0 = time.perf_counter()
        measured = profile_layers(blocks, 1, a.blocks + 2, x, loss_fn=lambda y, t: y.sum(), target=None,
                                  device=torch.device("cpu"))
        took = time.perf_counter() - t0
    finally:
        for p in busy:
            p.kill()
    totals = [c.total for c in measured]
    print(f"{a.blocks} identical GPT blocks (width {a.width}), {a.busy} busy loop(s) beside; profile took {took:.1f} s")
    for i, c in enumerate(measured):
        print(f"  layer {i}: F + B + W {1e3 * c.total:7.2f} ms   spread {100 * c.noise:5.1f}%")
    print(f"  apart: max / min = {max(totals) / min(totals):.2f}; median {1e3 * statistics.median(totals):.2f} ms")
    shared, lines = shared_costs(measured)
    for line in lines:
        print(f"  profile says: {line}")
    # the blocks' true cost: each phase's median over the blocks (they are identical)
    f, b, w = (statistics.median(c.phases(False)[k] for c in measured) for k in range(3))
    for pp in (2, 4):
        schedule = compile_schedule("1f1b", pp, 8)
        for name, costs in (("raw measurements", _plain(measured)), ("shared + noise rule", shared)):
            choice = choose_bounds(costs, schedule)
            size = [choice.bounds[s + 1] - choice.bounds[s] for s in range(pp)]
            real = simulate(schedule, [Costs(f * n, b * n, w * n) for n in size]).makespan
            print(f"  pp {pp}, {name:20s}: bounds {choice.bounds}, predicted {1e3 * choice.makespan:.1f} ms, "
                  f"at the true cost {1e3 * real:.1f} ms{'  (' + choice.kept_equal + ')' if choice.kept_equal else ''}")


if __name__ == "__main__":
    main()
