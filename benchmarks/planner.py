"""The partition planner on 20 layer-cost profiles: planning time and chosen makespan against the best known split.

``python -m benchmarks.planner`` (one process, no torch compute): for each profile and schedule it
prints the planner's seconds, the simulated makespan of its split, that of the equal-count split, of
the exact min-max split of the layer costs, and of the best split a much longer search found (local
search from 20 random starts and the planner's own split, finished with the simulator itself). The
profiles are the ones ``tests/runtime/test_planner.py`` checks.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Callable

from pipeengine.runtime.planner import LayerCost, balance_min_max, choose_bounds, even_bounds
from pipeengine.schedule import Costs, Schedule, compile_schedule, simulate
from pipeengine.schedule.simulate import Dataflow

__all__ = ["PROFILES", "profile_costs", "makespan_of"]


def _block(scale: float = 1.0, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> LayerCost:
    return LayerCost(f * scale, b * scale, w * scale, (b + w) * scale, int(1000 * scale), int(4000 * scale))


def _layers(n: int, scale: Callable[[int], float],
            phases: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[LayerCost]:
    return [_block(scale(i), *phases) for i in range(n)]


def _random(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0.5, 1.5) for _ in range(n)]


def _with_ends(n: int, first: float = 1.0, last: float = 1.0) -> Callable[[int], float]:
    return lambda i: first if i == 0 else last if i == n - 1 else 1.0


PROFILES: dict[str, Callable[[], list[LayerCost]]] = {
    "uniform 48": lambda: _layers(48, lambda i: 1.0),
    "uniform 82": lambda: _layers(82, lambda i: 1.0),
    "head x3, 48": lambda: _layers(48, _with_ends(48, last=3.0)),
    "head x3, 82": lambda: _layers(82, _with_ends(82, last=3.0)),
    "head x6, 48": lambda: _layers(48, _with_ends(48, last=6.0)),
    "head x6, 82": lambda: _layers(82, _with_ends(82, last=6.0)),
    "embedding x2, 48": lambda: _layers(48, _with_ends(48, first=2.0)),
    "embedding x2, 82": lambda: _layers(82, _with_ends(82, first=2.0)),
    "embedding x2 + head x6, 82": lambda: _layers(82, _with_ends(82, first=2.0, last=6.0)),
    **{f"random +-50% #{seed}, 82": (lambda seed=seed: _layers(82, _random(82, seed).__getitem__))
       for seed in range(5)},
    "one huge layer (x10) in the middle, 82": lambda: _layers(82, lambda i: 10.0 if i == 41 else 1.0),
    "one huge layer (x10) first, 82": lambda: _layers(82, lambda i: 10.0 if i == 0 else 1.0),
    "MoE-like alternating x1/x2, 82": lambda: _layers(82, lambda i: 2.0 if i % 2 else 1.0),
    "MoE-like alternating x1/x2, 48": lambda: _layers(48, lambda i: 2.0 if i % 2 else 1.0),
    "b = 2f, w = f/2, 64": lambda: _layers(64, lambda i: 1.0, (1.0, 2.0, 0.5)),
    "random +-50% + head x6, 64": lambda: _layers(64, lambda i: 6.0 if i == 63 else _random(64, 7)[i]),
}
assert len(PROFILES) == 20


def profile_costs(name: str) -> list[LayerCost]:
    return PROFILES[name]()


def stage_costs(costs: list[LayerCost], schedule: Schedule, bounds: list[int]) -> list[Costs]:
    """Each stage's (f, b, w): its layers' sums, as the schedule runs them (fused backward without W)."""
    split = schedule.split_backward
    out = []
    for a, z in zip(bounds, bounds[1:]):
        phases = [c.phases(split) for c in costs[a:z]]
        out.append(Costs(*(sum(x[k] for x in phases) for k in range(3))))
    return out


def makespan_of(costs: list[LayerCost], schedule: Schedule, bounds: list[int]) -> float:
    """The simulated makespan of a split, every stage with its own costs."""
    return simulate(schedule, stage_costs(costs, schedule, bounds)).makespan


def _descend(current: list[int], score: Callable[[list[int]], float], reach: int) -> tuple[list[int], float]:
    """Move single boundaries by 1..reach while the score drops."""
    best = score(current)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(current) - 1):
            for step in (s for r in range(1, reach + 1) for s in (-r, r)):
                moved = current[i] + step
                if not current[i - 1] < moved < current[i + 1]:
                    continue
                trial = current[:i] + [moved] + current[i + 1:]
                t = score(trial)
                if t < best - 1e-12:
                    current, best, improved = trial, t, True
    return current, best


def best_known(costs: list[LayerCost], schedule: Schedule, seeds: list[list[int]], starts: int,
               rng: random.Random) -> float:
    """A longer search than the planner's: from ``seeds`` and ``starts`` random splits, descend on the
    dependency-only makespan with moves of 1..4, then descend on the simulator itself from the best 3."""
    n, stages = len(costs), schedule.num_stages
    timer = Dataflow(schedule)
    pool = [list(s) for s in seeds] + [[0, *sorted(rng.sample(range(1, n), stages - 1)), n] for _ in range(starts)]
    found = sorted((_descend(p, lambda b: timer.makespan(timer.durations(stage_costs(costs, schedule, b))), 4)[::-1]
                    for p in pool))
    best = float("inf")
    for _, bounds in found[:3]:
        best = min(best, _descend(bounds, lambda b: makespan_of(costs, schedule, b), 2)[1])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=20, help="random starts of the best-known search per row")
    parser.add_argument("--only", default=None, help="run only profiles whose name contains this")
    args = parser.parse_args()
    configs = [("1f1b", 8, 16, 1), ("zb-h1", 8, 16, 1), ("interleaved-1f1b", 8, 64, 4)]
    print("| profile | schedule | planner s | chosen | equal count | min-max | best known | chosen/best |", flush=True)
    print("|---|---|---|---|---|---|---|---|")
    worst, slowest = 1.0, 0.0
    for name in PROFILES:
        if args.only and args.only not in name:
            continue
        costs = profile_costs(name)
        for sched_name, pp, m, v in configs:
            schedule = compile_schedule(sched_name, pp, m, v)
            t0 = time.perf_counter()
            choice = choose_bounds(costs, schedule)
            took = time.perf_counter() - t0
            even = even_bounds(len(costs), schedule.num_stages)
            minmax = balance_min_max([c.total for c in costs], schedule.num_stages)
            t_even, t_minmax = makespan_of(costs, schedule, even), makespan_of(costs, schedule, minmax)
            known = min(choice.makespan, best_known(costs, schedule, [choice.bounds, even, minmax], args.starts,
                                                    random.Random(0)))
            ratio = choice.makespan / known
            worst, slowest = max(worst, ratio), max(slowest, took)
            label = f"{sched_name} pp {pp} m {m}" + (f" v {v}" if v > 1 else "")
            print(f"| {name} | {label} | {took:.2f} | {choice.makespan:.1f} | {t_even:.1f} | {t_minmax:.1f} | "
                  f"{known:.1f} | {ratio:.4f} |", flush=True)
    print(f"\nworst chosen/best known {worst:.4f}; slowest planning {slowest:.2f} s")


if __name__ == "__main__":
    main()
