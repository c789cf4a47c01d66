"""Engine efficiency against the ideal schedule, and against torch.distributed.pipelining, side by side.

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m benchmarks.efficiency \\
        --schedules 1f1b gpipe --microbatches 8 32 --tf 0.01 --tb 0.01 --tw 0.01
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.efficiency --real

Run from the repository root (the scripts are modules of the ``benchmarks`` package).

Sleep mode: every stage is a SleepStage (benchmarks/sleep_stages.py) whose F, B (input grad) and
W (weight grad) sleep the given seconds and pass a real activation (--act rows x cols float32).
A schedule without W runs B+W in its backward. For chunks > 1 each chunk sleeps 1/chunks of the
times, so every schedule does the same work. Per configuration it reports the median step time of
each engine, the simulator's ideal makespan for the same costs (free communication), efficiency =
ideal / measured, overhead per compute action, peak stored activations per stage, and the
throughput ratio ours / torch.distributed.pipelining, and each engine's CPU time per step summed over the
ranks (``time.process_time``: the host's own cost, apart from how long it waited; fitted in m with the excess when
two or more m are run), and of it the main threads' (``time.thread_time``: the engine's Python and the calls it
makes; the rest is the backend's own threads). Engines alternate (ours, theirs, ours, ...).
``--engines ours torch torch-train`` adds torch's step() followed by what a training loop adds to it
and ours does inside its step (the grad-norm all-reduce, the optimizer step, zero_grad), and the ratio
of training steps. Each step is timed between barriers, so a step's end counts in full (the decision
that ends ours: every rank waits for the first position's last backward); ``--back-to-back`` also
times the steps one after the other, as a training loop runs them (a step's end then overlaps the next
step's fill), and gives those ratios too. ``--critical-path`` (gpipe, 1f1b) splits each engine's step into its
start, the fill's and the cooldown's hops, its end and the rest (benchmarks/critical_path.py).

Real mode (2 processes): an MLP whose step takes about a second on one thread, run unsplit with
gradient accumulation on rank 0 and as pp=2 1F1B on both ranks, same global batch and microbatches;
reports the speedup and its ratio to the ideal p*m/(m+p-1), and what this machine allows: the two
halves run at once without communication, giving the speedup of a pipeline with free transfers.

Output: one JSON line per configuration on rank 0 (to stdout and --out), then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (append_jsonl, describe_real, efficiency_table, finish_and_exit, init_from_env,
                               mean_loss, timed_run, timed_steps)
from benchmarks.critical_path import RankStep, critical_path_table, decompose, stamped, summarise
from benchmarks.sleep_stages import sleep_layers
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.topology import Topology
from pipeengine.schedule import Costs, simulate
from pipeengine.schedule.builders import PLACEMENT, default_chunks

# ours -> torch.distributed.pipelining's schedule for the same work (zb-h1: torch's interleaved ZB on one stage)
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def ours(name: str, pp: int, m: int, t: tuple[float, float, float], act: tuple[int, int],
         static: bool = False) -> dict[str, Any]:
    v = default_chunks(name)
    layers = sleep_layers(pp * v, *(x / v for x in t))
    engine = PipelineEngine(layers, mean_loss, lambda ps: torch.optim.SGD(ps, lr=0.0), topology=Topology(pp, 1),
                            schedule=name, microbatches=m, chunks=v, partition=list(range(pp * v + 1)),
                            costs=Costs(*(x / v for x in t)), static_shapes=static)
    x = torch.randn(*act)
    results: list[Any] = []   # each step's result, read after the timed steps (torch's steps read nothing)
    split = engine.schedule.split_backwards()

    def step() -> None:
        results.append(engine.train_batch(iter([(x, None)] * m) if engine.needs_data else None))

    def stats() -> tuple[dict[int, int], dict[str, list[float]]]:
        """Peak stored activations per stage, and this rank's action times (B: split ones), over every step run."""
        peaks: dict[int, int] = {}
        durations: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        for res in results:
            peaks.update(res.peak_stored)
            for r in res.records:
                full = r.kind == "B" and split and (engine.position, r.microbatch,
                                                    engine.schedule.placement(r.stage)[1]) not in split
                if r.kind in durations and not full:   # a full B (of a schedule that also splits) is b + w
                    durations[r.kind].append(r.end - r.start)
        return peaks, durations

    return {"engine": engine, "step": step, "stats": stats}


def theirs(name: str, pp: int, m: int, t: tuple[float, float, float], act: tuple[int, int],
           training: bool = False) -> dict[str, Any]:
    """torch's schedule on the same stages; ``training``: step() and what a training loop adds to it, and ours
    does inside its step (the global gradient norm for clipping: one all-reduce over the pipeline, as ours sums it; the
    optimizer step; zeroing the gradients)."""
    import torch.distributed.pipelining as pipelining
    v = default_chunks(name)
    rank = dist.get_rank()
    n = pp * v
    mods = sleep_layers(v, *(x / v for x in t))
    v_shape = PLACEMENT.get(name) == "v"
    index = [rank, 2 * pp - 1 - rank] if v_shape else [rank + c * pp for c in range(v)]   # V or loop
    stages = [pipelining.PipelineStage(mods[c], index[c], n, torch.device("cpu"), input_args=(torch.randn(*act),))
              for c in range(v)]
    cls = getattr(pipelining, TORCH[name])
    multi = name in ("interleaved-1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev")   # these take a list
    sched = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=mean_loss)
    full = torch.randn(act[0] * m, act[1])
    first, last = rank == 0, rank == (0 if v_shape else (n - 1) % pp)
    params = [q for mod in mods for q in mod.parameters()]
    opt = torch.optim.SGD(params, lr=0.0)

    def step() -> None:
        kw: dict[str, Any] = {}
        if last:
            kw["target"] = torch.zeros(act[0] * m)
            kw["losses"] = []
        if first:
            sched.step(full, **kw)
        else:
            sched.step(**kw)
        if training:
            squares = torch.stack([q.grad.double().square().sum() for q in params if q.grad is not None]).sum()
            dist.all_reduce(squares)
            opt.step()
            opt.zero_grad()

    return {"step": step}


def cpu_timed(step: Callable[[], None], into: list[tuple[float, float]]) -> Callable[[], None]:
    """``step``, its CPU seconds appended to ``into``: this process's, every thread's (the host's cost, however long it
    waited), and the main thread's alone (the training loop's Python and what it calls; the rest is the backend's
    threads: Gloo's, moving the data)."""
    def run() -> None:
        start, main = time.process_time(), time.thread_time()
        step()
        into.append((time.process_time() - start, time.thread_time() - main))
    return run


def run_config(name: str, pp: int, m: int, t: tuple[float, float, float], act: tuple[int, int], steps: int,
               warmup: int, engines: list[str], back_to_back: bool = False, static: bool = False,
               critical: bool = False) -> dict[str, Any] | None:
    v = default_chunks(name)
    runners: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for e in engines:
        try:
            runners[e] = (ours(name, pp, m, t, act, static) if e == "ours"
                          else theirs(name, pp, m, t, act, e == "torch-train"))
            for _ in range(warmup):
                runners[e]["step"]()
        except Exception as exc:  # report, do not abort the sweep (e.g. an unsupported schedule)
            errors[e] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            runners.pop(e, None)
    times: dict[str, list[float]] = {e: [] for e in runners}
    cpu: dict[str, list[tuple[float, float]]] = {e: [] for e in runners}   # this rank's CPU seconds per timed step
    runs: dict[str, list[float]] = {e: [] for e in runners}   # --back-to-back: seconds of each run of steps
    paths: dict[str, list[RankStep]] = {e: [] for e in runners}   # --critical-path: each timed step's stamps
    critical = critical and name in ("gpipe", "1f1b")   # one stage per rank, a whole backward: critical_path.py
    half = max(1, steps // 2)
    for rnd in range(2):   # alternate engines so machine noise hits both
        for e in runners:
            run = stamped(runners[e]["step"], paths[e]) if critical else runners[e]["step"]
            times[e] += timed_steps(cpu_timed(run, cpu[e]), half if rnd == 0 else steps - half)
            if back_to_back:
                runs[e].append(timed_run(runners[e]["step"], half if rnd == 0 else steps - half))
    sched = runners["ours"]["engine"].schedule if "ours" in runners else None
    peaks, durations = runners["ours"]["stats"]() if "ours" in runners else ({}, {})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"peaks": peaks, "durations": durations, "paths": paths if critical else {},
                                      "cpu": {e: [statistics.median(c) for c in zip(*v)] for e, v in cpu.items()}})
    if dist.get_rank() != 0:
        return None
    costs = Costs(*(x / v for x in t))
    ideal = simulate(sched, costs).makespan if sched is not None else float("nan")
    row: dict[str, Any] = {"schedule": name, "pp": pp, "microbatches": m, "chunks": v, "tf": t[0], "tb": t[1],
                           "tw": t[2], "act": list(act), "steps": steps, "ideal_s": ideal, "errors": errors,
                           "ours_static_shapes": static}
    actions_per_rank = m * v * 2 + (len(sched.split_backwards()) // pp if sched is not None else 0)
    for e, ts in times.items():
        med = statistics.median(ts)
        row[f"{e}_median_s"] = med
        row[f"{e}_cpu_ms_per_step"] = 1e3 * sum(g["cpu"][e][0] for g in gathered)   # every rank's, every thread's
        row[f"{e}_cpu_main_ms_per_step"] = 1e3 * sum(g["cpu"][e][1] for g in gathered)   # every rank's main thread's
        row[f"{e}_efficiency"] = ideal / med
        row[f"{e}_overhead_ms_per_action"] = (med - ideal) / actions_per_rank * 1000
    if critical:   # each engine's step in parts (benchmarks/critical_path.py)
        row["critical_path_ms"] = {e: summarise([decompose([g["paths"][e][i] for g in gathered], m)
                                                 for i in range(steps)]) for e in runners}
    if "ours" in times and sched is not None:
        row["ours_peak_stored"] = {str(k): v for g in gathered for k, v in g["peaks"].items()}
        # the simulator fed each rank's measured mean action times: what is left is the engine's overhead
        per_rank = []
        for ds in (g["durations"] for g in gathered):
            mean = {k: statistics.mean(ds[k] or [0.0]) for k in ("F", "B", "W")}
            per_rank.append(Costs(mean["F"], mean["B"], mean["W"] if sched.split_backward else 0.0))
        row["measured_action_ms"] = [[round(c.f * 1000, 2), round(c.b * 1000, 2), round(c.w * 1000, 2)]
                                     for c in per_rank]
        row["ideal_measured_costs_s"] = simulate(sched, per_rank).makespan
        row["ours_efficiency_vs_measured_costs"] = row["ideal_measured_costs_s"] / row["ours_median_s"]
    for e, ts in runs.items():   # a training loop's pace: no barrier between the steps, a step's end overlaps the next
        if ts:
            row[f"{e}_back_to_back_s"] = sum(ts) / steps
    if "ours" in times and "torch" in times:
        row["ratio_ours_over_torch"] = row["torch_median_s"] / row["ours_median_s"]
        if back_to_back:
            row["ratio_ours_over_torch_back_to_back"] = row["torch_back_to_back_s"] / row["ours_back_to_back_s"]
    if back_to_back and "ours" in times and "torch-train" in times:
        row["ratio_ours_over_torch_training_back_to_back"] = (row["torch-train_back_to_back_s"]
                                                              / row["ours_back_to_back_s"])
    if "ours" in times and "torch-train" in times:
        row["ratio_ours_over_torch_training"] = row["torch-train_median_s"] / row["ours_median_s"]
    return row


def _half_step(half: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[torch.Tensor, torch.Tensor]],
               first: bool) -> float:
    """One rank's share of a pp=2 step with no communication: F and B of its half for every microbatch."""
    t0 = time.perf_counter()
    opt.zero_grad()
    for xb, yb in mbs:
        out = half(xb if first else xb.detach().requires_grad_(True))
        if first:
            out.backward(torch.ones_like(out))
        else:
            nn.functional.mse_loss(out, yb).backward()
    opt.step()
    return time.perf_counter() - t0


def real_mode(steps: int, hidden: int, depth: int, global_batch: int, m: int) -> dict[str, Any] | None:
    """pp=2 on 2 processes vs the unsplit model on one, same global batch and microbatches.

    Each round times, in turn: the unsplit model on rank 0 (rank 1 idle), a pp=2 engine step, each
    half alone (the other rank idle) and both halves at once without communication. Alternating
    spreads the machine's noise over all of them. The halves show what the machine allows: if two
    processes slow each other down (shared caches, memory bandwidth, a busy host), then even a
    free pipeline reaches only ``single / (slow + fast / m)`` with ``slow`` and ``fast`` the two
    halves' times when run at once (a 2-stage 1F1B takes m microbatches of the slower stage plus
    one of the faster).
    """
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(depth)]
    x = torch.randn(global_batch, hidden)
    y = torch.randn(global_batch, hidden)
    mbs = list(zip(x.chunk(m), y.chunk(m)))
    rank = dist.get_rank()
    net = nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    torch.manual_seed(0)
    engine = PipelineEngine([nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(depth)],
                            nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=1e-4),
                            topology=Topology(2, 1), schedule="1f1b", microbatches=m, partition="uniform")
    half = nn.Sequential(*layers[:depth // 2]) if rank == 0 else nn.Sequential(*layers[depth // 2:])
    half_opt = torch.optim.SGD(half.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"single": [], "pp2": [], "alone": [], "slow": [], "fast": []}
    for i in range(steps + 1):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            opt.zero_grad()
            for xb, yb in mbs:   # gradient accumulation over the same microbatches
                (nn.functional.mse_loss(net(xb), yb) / m).backward()
            opt.step()
            single = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(iter(mbs))
        pp2 = time.perf_counter() - t0
        for r in (0, 1):   # each half alone, the other rank idle at the barrier
            dist.barrier()
            if rank == r:
                alone = _half_step(half, half_opt, mbs, rank == 0)
        dist.barrier()
        together = _half_step(half, half_opt, mbs, rank == 0)
        both = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]   # per rank: (together, alone)
        dist.all_gather(both, torch.tensor([together, alone], dtype=torch.float64))
        if i and rank == 0:   # round 0 warms up
            (together0, alone0), (together1, alone1) = (b.tolist() for b in both)
            times["single"].append(single)
            times["pp2"].append(pp2)
            times["slow"].append(max(together0, together1))
            times["fast"].append(min(together0, together1))
            times["alone"].append(max(alone0, alone1))
    if rank != 0:
        return None
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = med["single"] / med["pp2"]
    ideal = 2 * m / (m + 1)
    machine = med["single"] / (med["slow"] + med["fast"] / m)
    return {"mode": "real", "hidden": hidden, "depth": depth, "global_batch": global_batch, "microbatches": m,
            "single_s": med["single"], "pp2_s": med["pp2"], "speedup": speedup, "ideal_speedup": ideal,
            "ratio_to_ideal": speedup / ideal, "half_alone_s": med["alone"], "halves_together_s": med["slow"],
            "slowdown_together": med["slow"] / med["alone"], "machine_bound_speedup": machine,
            "ratio_to_machine_bound": speedup / machine}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", nargs="+", default=["1f1b"],
                   help="gpipe, 1f1b, interleaved-1f1b (2 chunks), zb-h1, zb-h2, interleaved-zb, zbv, dualpipev, "
                        "v-half, v-min (torch's counterpart where it has one: "
                        + ", ".join(f"{k} = {v}" for k, v in TORCH.items()) + ")")
    p.add_argument("--microbatches", nargs="+", type=int, default=[8])
    p.add_argument("--tf", type=float, default=0.010, help="forward seconds per stage (default 0.010)")
    p.add_argument("--tb", type=float, default=0.010, help="input-grad seconds per stage (default 0.010)")
    p.add_argument("--tw", type=float, default=0.010, help="weight-grad seconds per stage (default 0.010)")
    p.add_argument("--act", default="8x1024", help="activation rows x cols, float32 (default 8x1024)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per engine")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=["ours", "torch"], choices=["ours", "torch", "torch-train"],
                   help="torch: its schedule's step(); torch-train: step() plus what a training loop adds (the "
                        "grad-norm all-reduce, the optimizer step, zero_grad), as ours does in its step")
    p.add_argument("--back-to-back", action="store_true",
                   help="also time the steps one after the other, without a barrier between them (a training "
                        "loop's pace: a step's end overlaps the next one's start), and the ratio of those")
    p.add_argument("--static-shapes", action="store_true",
                   help="ours with static training shapes (no shape header after the first step), as torch's are")
    p.add_argument("--critical-path", action="store_true",
                   help="stamp the sleep stages in each engine's timed steps and split each step into its "
                        "start, the fill's hops, the cooldown's hops, its end and the rest, per engine "
                        "(benchmarks/critical_path.py; gpipe and 1f1b only, other schedules' rows have none)")
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    p.add_argument("--real", action="store_true", help="real-compute pp=2 speedup mode (2 processes)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=1024)
    args = p.parse_args()
    init_from_env()
    rows: list[dict[str, Any]] = []
    if args.real:
        if dist.get_world_size() != 2:
            raise SystemExit("--real runs on exactly 2 processes (pp=2)")
        row = real_mode(args.steps, args.hidden, args.depth, args.global_batch, args.microbatches[0])
        rows = [row] if row else []
    else:
        rows_x = (int(a) for a in args.act.split("x"))
        act = (next(rows_x), next(rows_x))
        for name in args.schedules:
            for m in args.microbatches:
                row = run_config(name, dist.get_world_size(), m, (args.tf, args.tb, args.tw), act, args.steps,
                                 args.warmup, args.engines, args.back_to_back, args.static_shapes,
                                 args.critical_path)
                if row:
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        if args.out:
            append_jsonl(args.out, rows)
        if args.real:
            print(json.dumps(rows[0]))
            print(describe_real(rows[0]))
        else:
            print(efficiency_table(rows))
            if args.critical_path:
                print("\n" + critical_path_table(rows))
    finish_and_exit()


if __name__ == "__main__":
    main()
