"""Where a pipeline step's overhead goes: the cost of one Gloo post, and the engine's per-hop latency.

    python -m torch.distributed.run --standalone --nproc_per_node 8 -m benchmarks.overhead \\
        --schedule 1f1b --microbatches 32

Run from the repository root (the scripts are modules of the ``benchmarks`` package).

Part 1 (ranks 0 and 1, the others wait): how long the call that posts ONE 32 KB send takes on
rank 0 while rank 1's receive is already posted, three ways: ``dist.batch_isend_irecv`` with one
``P2POp`` (what torch.distributed.pipelining and our NCCL path use), ``dist.isend``, and the
process group's own ``send`` (our Gloo path); each right after a 10 ms sleep ("cold", as in a
pipeline where the rank slept in its stage or waited for a peer) and in a tight loop ("warm").

Part 2 (all ranks): our engine on sleep stages (10 ms per F, B and W part, 8 x 1024 float32
activations, as in the sweep). Per rank, the mean time per step in each kind of record
(F, B, W compute; COMM posting batches; WAIT blocked on a transfer; SYNC end of step). Per
transfer whose receiver was already blocked on it: the hop latency from the end of the sender's
compute to the return of the receiver's wait; and how long the sender's post took. Clocks are
``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process on a host). Also, on rank 0,
the Python time from the engine starting to post a comm batch to its first op reaching Gloo.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import finish_and_exit, init_from_env
from benchmarks.sleep_stages import sleep_layers
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.topology import Topology
from pipeengine.schedule import Costs
from pipeengine.schedule.builders import default_chunks


def _median_us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:.0f}"


def post_costs(reps: int) -> dict[str, dict[str, list[float]]]:
    """Seconds rank 0 spends in the call posting one 32 KB send (rank 1 pre-posts the receive)."""
    rank = dist.get_rank()
    pg: Any = dist.group.WORLD
    x = torch.zeros(8 * 1024)
    posts = {
        "batch_isend_irecv": lambda tag: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1, tag=tag)])[0],
        "dist.isend": lambda tag: dist.isend(x, 1, tag=tag),
        "group.send": lambda tag: pg.send([x], 1, tag),
    }
    out: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name in posts}
    tag = 0
    for _ in range(reps):   # round-robin, so the machine's drift reaches every way alike
        for name, post in posts.items():
            for state in ("cold", "warm"):
                dist.barrier()
                tag += 1
                if rank == 1:
                    dist.irecv(x, 0, tag=tag).wait()
                elif rank == 0:
                    if state == "cold":
                        time.sleep(0.010)
                    else:   # keep the core busy until the post
                        end = time.perf_counter() + 0.010
                        while time.perf_counter() < end:
                            pass
                    t0 = time.perf_counter()
                    work = post(tag)
                    out[name][state].append(time.perf_counter() - t0)
                    work.wait()
    return out


Records = list[list[list[tuple[str, int, float, float]]]]   # rank -> step -> (kind, microbatch, start, end)


def _time_python_before_first_op(engine: PipelineEngine, delays: list[float]) -> None:
    """Wrap the engine's batch posting to record, per batch, the seconds of Python before its first op
    reaches the process group (the engine building the ops, then the wire, runtime/wire.py, preparing them)."""
    post, issue = engine.wire.post, engine.wire._issue
    start: list[float] = []

    def timed_post(step: Any, *rest: Any, **options: Any) -> None:
        start[:] = [time.perf_counter()]
        post(step, *rest, **options)

    def timed_issue(ops: Any) -> Any:
        if start:
            delays.append(time.perf_counter() - start.pop())
        return issue(ops)

    engine.wire.post = timed_post                   # type: ignore[method-assign]
    engine.wire._issue = timed_issue                # type: ignore[method-assign]


def engine_profile(schedule: str, m: int, steps: int) -> tuple[Records, list[float]]:
    """Every rank's records of ``steps`` measured steps, as (kind, microbatch, start, end) on one clock,
    and this rank's Python time before the first op of each comm batch."""
    world = dist.get_world_size()
    v = default_chunks(schedule)   # stages per rank: each sleeps 1/v of the times, as in efficiency.py
    t = 0.010 / v
    engine = PipelineEngine(sleep_layers(world * v, t, t, t), lambda out, _: out.sum(),
                            lambda ps: torch.optim.SGD(ps, lr=0.0), topology=Topology(world, 1), schedule=schedule,
                            microbatches=m, chunks=v, partition=list(range(world * v + 1)), costs=Costs(t, t, t))
    x = torch.randn(8, 1024)
    mine = []
    delays: list[float] = []
    for step in range(steps + 2):   # 2 warm-up steps
        dist.barrier()
        if step == 2:
            _time_python_before_first_op(engine, delays)
        res = engine.train_batch(iter([(x, None)] * m) if engine.needs_data else None)
        if step >= 2:
            t0 = res.started_at   # the records' zero on the host's clock, which every rank shares
            mine.append([(r.kind, r.microbatch, r.start + t0, r.end + t0) for r in res.records])
    del engine.wire.post, engine.wire._issue   # unwrap: no reference cycle keeps the engine (and its groups) alive
    del engine
    gc.collect()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered, delays


def analyse(per_rank: Records) -> dict[str, Any]:
    """Per-rank ms per step by record kind, hop latencies (s) by transfer kind, post durations (s)."""
    world, steps = len(per_rank), len(per_rank[0])
    totals: list[dict[str, float]] = [{} for _ in range(world)]
    for r in range(world):
        for step in per_rank[r]:
            for kind, _, start, end in step:
                totals[r][kind] = totals[r].get(kind, 0.0) + (end - start) * 1e3 / steps
    hops: dict[str, list[float]] = {"F": [], "B": []}
    posts: list[float] = []
    for s in range(steps):
        ends = {(r, kind, mb): end for r in range(world) for kind, mb, _, end in per_rank[r][s] if kind in hops}
        for r in range(world):
            recs = per_rank[r][s]
            for prev, cur in zip(recs, recs[1:]):
                if cur[0] in hops and prev[0] == "WAIT" and prev[1] == cur[1]:
                    src = r - 1 if cur[0] == "F" else r + 1
                    sent = ends.get((src, cur[0], cur[1]))
                    if sent is not None and prev[2] < sent:   # the receiver was blocked before the data left
                        hops[cur[0]].append(prev[3] - sent)
                if cur[0] == "COMM" and prev[0] in ("F", "B", "W"):
                    posts.append(cur[3] - cur[2])
    return {"ms_per_step": totals, "hops": {k: sorted(v) for k, v in hops.items()}, "posts": posts}


def report(stats: dict[str, Any]) -> None:
    print("per rank, ms per step:")
    for r, totals in enumerate(stats["ms_per_step"]):
        print(f"  rank {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items())))
    for kind, v in stats["hops"].items():
        if v:
            print(f"hop latency, {kind} transfers ({len(v)}): median {statistics.median(v) * 1e3:.3f} ms, "
                  f"p90 {v[int(0.9 * len(v))] * 1e3:.3f} ms")
    if stats["posts"]:
        print(f"posting a comm batch after compute: median {statistics.median(stats['posts']) * 1e3:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="measured engine steps (after 2 warm-up steps)")
    p.add_argument("--reps", type=int, default=60, help="posts timed per way and state in part 1")
    args = p.parse_args()
    init_from_env()
    if dist.get_world_size() < 2:
        raise SystemExit("run with at least 2 processes, e.g. torchrun --nproc_per_node 8")
    costs = post_costs(args.reps)
    if dist.get_rank() == 0:
        print("part 1: posting one 32 KB send on Gloo, median microseconds in the call (rank 1 waiting):")
        for name, states in costs.items():
            print(f"  {name:18s} cold {_median_us(states['cold']):>5s}   warm {_median_us(states['warm']):>5s}")
    records, delays = engine_profile(args.schedule, args.microbatches, args.steps)
    if dist.get_rank() == 0:
        print(f"part 2: our engine, {args.schedule}, pp={dist.get_world_size()}, m={args.microbatches}")
        report(analyse(records))
        print(f"Python before a batch's first op reaches Gloo (rank 0): median {_median_us(delays)} us")
    finish_and_exit()


if __name__ == "__main__":
    main()
