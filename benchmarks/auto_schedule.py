"""``--schedule auto`` on the 20 layer-cost profiles: its choice, its gap to the lower bound, the best library one.

``python -m benchmarks.auto_schedule [--pp 8] [-m 32]`` (one process, no torch compute): per profile
the planning seconds, the schedule auto chose and its simulated makespan, the lower bound (the larger
of the busiest position's work and one microbatch's critical path) and the gap, the bound with the fill
(``fill_bound``: also what each position must wait before its first action) and that gap, and the best library
schedule's makespan under the same cap (auto is never slower by construction: it is one of the
candidates). With ``--memory-cap`` (bytes per position of the profiles' model) the same under a cap.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.planner import PROFILES, profile_costs
from pipeengine.runtime.auto import auto_schedule

__all__ = ["main"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("-m", "--microbatches", type=int, default=32)
    parser.add_argument("--memory-cap", type=float, default=None, help="bytes per position")
    args = parser.parse_args()
    print(f"pp {args.pp}, m {args.microbatches}, memory cap {args.memory_cap or 'none'}", flush=True)
    print("| profile | planning s | auto chose | makespan | lower bound | gap | with the fill | gap | best library "
          "| library makespan | auto/library |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    within, within_fill, slowest = 0, 0, 0.0
    for name in PROFILES:
        t0 = time.perf_counter()
        choice = auto_schedule(profile_costs(name), args.pp, args.microbatches, args.memory_cap)
        took = time.perf_counter() - t0
        slowest = max(slowest, took)
        best = choice.best_library()
        within += choice.gap <= 1.02
        within_fill += choice.fill_gap <= 1.02
        label = choice.schedule.name + (" (synthesised)" if choice.schedule.name == "auto" else "")
        print(f"| {name} | {took:.2f} | {label}, chunks {choice.schedule.chunks} | {choice.makespan:.1f} | "
              f"{choice.bound:.1f} | {choice.gap:.4f} | {choice.fill:.1f} | {choice.fill_gap:.4f} | "
              f"{best[0] if best else '-'} | "
              f"{best[1] if best else float('nan'):.1f} | {choice.makespan / best[1] if best else float('nan'):.4f} |",
              flush=True)
    print(f"\nwithin 1.02x of the bound: {within} of {len(PROFILES)}; of the bound with the fill: {within_fill} of "
          f"{len(PROFILES)}; slowest planning {slowest:.2f} s")


if __name__ == "__main__":
    main()
