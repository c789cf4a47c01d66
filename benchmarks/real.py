"""Real models, real compute: our engine against torch.distributed.pipelining, in one run, engines alternating.

    python -m benchmarks.real --all                # every configuration below + the README table (~15 min)
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.real \\
        --model gpt --preset small                 # one configuration (pp = world size / dp)

Run from the repository root (the scripts are modules of the ``benchmarks`` package).

Per configuration every variant is built once, then each round runs one training step of every
variant, the order rotated by one each round (so no variant always follows the same one), with a
barrier before and after each step; the figure is the median step over the timed rounds (one
warm-up round left out), as examples (images, or tokens for GPT) per second. Variants:

- ours with ``partition="profile"`` (1f1b, zb-h1, zbv, dualpipev, and auto: the schedule chosen with the split),
  ``"parameters"`` and ``"uniform"`` (1f1b);
  "uniform" is the equal-layer split a torch.distributed.pipelining user writes;
- torch.distributed.pipelining with that equal split: ``Schedule1F1B``,
  ``ScheduleInterleavedZeroBubble`` (one stage per rank), ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV`` (2 pp equal stages in V placement);
- with dp = 1 and pp = 2: the single-process model with gradient accumulation over the same
  microbatches (rank 0; rank 1 waits), and the machine bound: both halves of the profile split
  running at once without communication, giving ``single / (slow + fast / m)``, the throughput of a
  pipeline with free transfers on this machine;
- with dp > 1: ours with the DP all-reduce inside backward (``overlap_grad_sync=True``, the engine's
  default on CUDA only) and after it (``overlap_grad_sync=False``, its default on CPU); the exposed
  wait for the DP all-reduce at pipeline position 0.

Every rank uses one thread and glibc malloc keeps freed memory for reuse (pipeengine/runtime/hostalloc.py,
as the trainer does on CPU). Also printed: the profile partition's predicted step (compute only,
simulated from the measured layer costs) against its measured step.
Output: one JSON line per configuration (stdout and --out); ``--all`` runs the set of
configurations and rewrites the table in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import (RESULTS, ROOT, append_jsonl, finish_and_exit, init_from_env, read_jsonl,
                               torchrun_command, write_readme_block)
from pipeengine.models.data import ByteCorpus
from pipeengine.runtime.engine import PipelineEngine
from pipeengine.runtime.hostalloc import keep_freed_memory
from pipeengine.runtime.layers import build_layer, build_layers
from pipeengine.runtime.planner import partition as split_bounds
from pipeengine.runtime.topology import Topology
from pipeengine.schedule.builders import PLACEMENT
from pipeengine.training.data import batches

# (model, preset, processes, pp, microbatches, micro batch size, timed rounds)
CONFIGS = [("gpt", "small", 2, 2, 8, 8, 8), ("resnet", "resnet18", 2, 2, 8, 16, 6),
           ("resnet", "resnet50", 2, 2, 8, 8, 4), ("gpt", "small", 4, 2, 8, 8, 4), ("gpt", "small", 4, 4, 8, 8, 4)]


def _data(mod: Any, mcfg: Any, dp_rank: int, dp: int, m: int, mbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    fixed = hasattr(mcfg, "block_size")   # the GPT on fixed windows of one byte stream: every microbatch one shape
    source = ByteCorpus(block_size=mcfg.block_size) if fixed else mod.make_source(mcfg, None)
    return list(batches(source, "train", 0, 0, dp_rank, dp, m, mbs))


def _opt(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-4)


def ours(mod: Any, mcfg: Any, topo: Topology, m: int, data: list[Any], schedule: str, partition: str,
         overlap: bool = True, bucket_mb: float = 25.0) -> tuple[Callable[[], Any], PipelineEngine]:
    engine = PipelineEngine(mod.layer_factories(mcfg), mod.loss_fn, _opt, topology=topo, schedule=schedule,
                            microbatches=m, partition=partition, sample=data[0], bucket_mb=bucket_mb,
                            tied=mod.tied_parameters(len(mod.layer_factories(mcfg))), overlap_grad_sync=overlap)

    def step() -> Any:
        return engine.train_batch(iter(data) if engine.needs_data else None)
    return step, engine


def theirs(mod: Any, mcfg: Any, pp: int, m: int, data: list[Any], schedule: str) -> Callable[[], Any]:
    """torch.distributed.pipelining with the equal-layer split, pp ranks, dp = 1."""
    from torch.distributed import pipelining
    rank = dist.get_rank()
    factories = mod.layer_factories(mcfg)
    v = 2 if PLACEMENT.get(schedule) == "v" else 1   # V: 2 pp equal stages, rank r runs r and 2 pp - 1 - r
    bounds = split_bounds(factories, pp * v, "uniform")
    mine = [rank, 2 * pp - 1 - rank] if v == 2 else [rank]
    modules = [nn.Sequential(*[build_layer(factories[i], i, 0) for i in range(bounds[s], bounds[s + 1])])
               for s in mine]
    stages = [pipelining.PipelineStage(mo, s, pp * v, torch.device("cpu")) for mo, s in zip(modules, mine)]
    cls = {"1f1b": pipelining.Schedule1F1B, "zb": pipelining.ScheduleInterleavedZeroBubble,
           "zbv": pipelining.ScheduleZBVZeroBubble, "dualpipev": pipelining.ScheduleDualPipeV}[schedule]
    sched = cls(stages if schedule != "1f1b" else stages[0], n_microbatches=m, loss_fn=mod.loss_fn)
    opt = _opt([p for mo in modules for p in mo.parameters()])
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        kw: dict[str, Any] = {}
        if rank == (0 if v == 2 else pp - 1):   # the loss: the V ends on rank 0
            kw["target"] = y
            kw["losses"] = []
        if rank == 0:
            sched.step(x, **kw)
        else:
            sched.step(**kw)
        opt.step()
    return step


def single(mod: Any, mcfg: Any, m: int, data: list[Any]) -> Callable[[], None]:
    """The unsplit model on rank 0, gradient accumulation over the same microbatches."""
    net = nn.Sequential(*build_layers(mod.layer_factories(mcfg)))
    opt = _opt(net.parameters())

    def step() -> None:
        if dist.get_rank() != 0:
            return
        opt.zero_grad(set_to_none=True)
        for x, y in data:
            (mod.loss_fn(net(x), y) / m).backward()
        opt.step()
    return step


def halves(mod: Any, mcfg: Any, bounds: list[int], data: list[Any]) -> Callable[[], float]:
    """This rank's half of ``bounds`` alone, F and B of every microbatch, no communication."""
    rank = dist.get_rank()
    factories = mod.layer_factories(mcfg)
    half = nn.Sequential(*[build_layer(factories[i], i, 0) for i in range(bounds[rank], bounds[rank + 1])])
    opt = _opt(half.parameters())
    with torch.no_grad():
        first = nn.Sequential(*[build_layer(factories[i], i, 0) for i in range(bounds[0], bounds[1])])
        inputs = [first(x) for x, _ in data] if rank == 1 else [x for x, _ in data]

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for x, (_, y) in zip(inputs, data):
            if rank == 0:
                out = half(x)
                out.backward(torch.ones_like(out))
            else:
                mod.loss_fn(half(x.detach().requires_grad_(True)), y).backward()
        opt.step()
        return time.perf_counter() - start   # this half's own time (the barrier after waits for the other)
    return step


def run_config(model: str, preset: str, pp: int, m: int, mbs: int, rounds: int,
               only: list[str] | None = None, bucket_mb: float = 25.0) -> dict[str, Any] | None:
    world, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology.from_world(world, pp=pp)
    mod = importlib.import_module(f"pipeengine.models.{model}")
    mcfg = mod.presets()[preset]()
    data = _data(mod, mcfg, topo.replica_of(rank), topo.dp, m, mbs)
    variants: dict[str, Callable[[], Any]] = {}
    engines: dict[str, PipelineEngine] = {}
    t0 = time.perf_counter()
    profiled = ("1f1b", "zb-h1", "zbv", "dualpipev", "auto")
    for schedule in profiled:
        name = f"ours profile {schedule}"
        variants[name], engines[name] = ours(mod, mcfg, topo, m, data, schedule, "profile", bucket_mb=bucket_mb)
    profile_s = time.perf_counter() - t0
    for partition in ("parameters", "uniform"):
        name = f"ours {partition} 1f1b"
        variants[name], engines[name] = ours(mod, mcfg, topo, m, data, "1f1b", partition, bucket_mb=bucket_mb)
    if topo.dp == 1:
        variants["torch 1F1B (uniform)"] = theirs(mod, mcfg, pp, m, data, "1f1b")
        variants["torch ZB (uniform)"] = theirs(mod, mcfg, pp, m, data, "zb")
        variants["torch ZBV (uniform)"] = theirs(mod, mcfg, pp, m, data, "zbv")
        variants["torch DualPipeV (uniform)"] = theirs(mod, mcfg, pp, m, data, "dualpipev")
    else:
        name = "ours uniform 1f1b, all-reduce after backward"   # the twin of "ours uniform 1f1b"
        variants[name], engines[name] = ours(mod, mcfg, topo, m, data, "1f1b", "uniform", overlap=False,
                                             bucket_mb=bucket_mb)
    if topo.dp == 1 and pp == 2:
        variants["single process (accumulation)"] = single(mod, mcfg, m, data)
        variants["halves at once"] = halves(mod, mcfg, engines["ours profile 1f1b"].bounds, data)
    names = [n for n in variants if not only or any(o in n for o in only)]
    times: dict[str, list[float]] = {n: [] for n in names}
    sync_wait: dict[str, list[float]] = {n: [] for n in engines}
    own: list[float] = []   # halves at once: this rank's own time
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            result = variants[name]()
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
                if name in engines and engines[name].position == 0:
                    sync_wait[name].append(result.grad_sync_wait)
                if name == "halves at once":
                    own.append(result)
    med = {n: statistics.median(v) for n, v in times.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ({n: statistics.median(v) for n, v in sync_wait.items() if v}, own))
    if rank != 0:
        return None
    per_step = topo.dp * m * mbs * (getattr(mcfg, "block_size", 1) if model == "gpt" else 1)
    unit = "tokens/s" if model == "gpt" else "images/s"
    row: dict[str, Any] = {"model": f"{model}/{preset}", "world": world, "pp": pp, "dp": topo.dp,
                           "microbatches": m, "micro_batch_size": mbs, "rounds": rounds, "unit": unit,
                           "profile_s": profile_s / len(profiled), "step_s": med, "times": times,
                           "throughput": {n: per_step / t for n, t in med.items() if n != "halves at once"},
                           "bounds": {n: e.bounds for n, e in engines.items()}}
    ref = "torch 1F1B (uniform)"
    if ref in times:   # per round, then the median: a slow spell of the machine hits both sides of a pair
        row["vs_torch"] = {n: statistics.median(t / o for t, o in zip(times[ref], times[n]))
                           for n in names if n != "halves at once"}
    choice = engines["ours profile 1f1b"].plan.choice
    if choice is not None and "ours profile 1f1b" in med:
        row["predicted_s"] = choice.makespan
        row["predicted_over_measured"] = choice.makespan / med["ours profile 1f1b"]
    if "halves at once" in med:
        both = list(zip(*(g[1] for g in gathered)))   # per round: (rank 0's half, rank 1's half)
        slow, fast = statistics.median(max(x) for x in both), statistics.median(min(x) for x in both)
        row["halves_at_once_s"] = [slow, fast]
        row["throughput"]["machine bound"] = per_step / (slow + fast / m)   # a 2-stage 1F1B, free transfers
    if topo.dp > 1:
        pos0 = [g[0] for g in gathered if g[0]]   # the replicas of position 0
        row["dp_wait_position0_s"] = {n: statistics.median(w[n] for w in pos0) for n in pos0[0]}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per configuration and variant, throughput and the speed ratio to torch's 1F1B
    (median over the rounds of torch's step / this variant's step in the same round)."""
    out = ["| model | pp x dp | variant | bounds | median step (s) | throughput | vs torch 1F1B |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        ref = row["throughput"].get("torch 1F1B (uniform)")
        for name, tput in row["throughput"].items():
            step = row["step_s"].get(name)
            ratio = row.get("vs_torch", {}).get(name)
            if ratio is None and ref is not None:   # the machine bound: its throughput over torch's
                ratio = tput / ref
            out.append(f"| {row['model']} | {row['pp']} x {row['dp']} | {name} | {row['bounds'].get(name, '')} | "
                       f"{'' if step is None else f'{step:.3f}'} | {tput:,.0f} {row['unit']} | "
                       f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(out)


def notes(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        head = f"{row['model']} pp {row['pp']} x dp {row['dp']}"
        if "predicted_s" in row:
            lines.append(f"- {head}: profile partition {row['profile_s']:.1f} s per engine; predicted compute step "
                         f"{row['predicted_s']:.3f} s, measured {row['step_s']['ours profile 1f1b']:.3f} s "
                         f"(predicted / measured {row['predicted_over_measured']:.2f}).")
        if "dp_wait_position0_s" in row:
            w = row["dp_wait_position0_s"]
            lines.append(f"- {head}: wait for the DP all-reduce at position 0 (uniform split, 1f1b): inside "
                         f"backward {1e3 * w['ours uniform 1f1b']:.1f} ms, after backward "
                         f"{1e3 * w['ours uniform 1f1b, all-reduce after backward']:.1f} ms.")
        if "halves_at_once_s" in row:
            slow, fast = row["halves_at_once_s"]
            lines.append(f"- {head}: halves of the profile split at once without communication: {slow:.3f} s and "
                         f"{fast:.3f} s.")
    return "\n".join(lines)


def run_all(out: str, table_only: bool = False) -> None:
    """Every configuration in its own torchrun, one after the other, then the README table (``table_only``:
    the table from the newest row of each configuration in ``out``, e.g. after re-running one)."""
    started = time.time()
    rows = []
    for model, preset, procs, pp, m, mbs, rounds in CONFIGS:
        if table_only:
            key = (f"{model}/{preset}", procs, pp)
            found = [r for r in read_jsonl(out) if (r["model"], r["world"], r["pp"]) == key]
            rows += found[-1:]
            continue
        cmd = torchrun_command(procs, "benchmarks.real", [
            "--model", model, "--preset", preset, "--pp", str(pp), "-m", str(m), "--micro-batch-size", str(mbs),
            "--rounds", str(rounds), "--out", os.path.abspath(out)])
        print("+", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise SystemExit(f"{model}/{preset} failed (exit {proc.returncode}):\n{proc.stdout}")
        rows.append(json.loads(lines[-1]))
    took = "" if table_only else f", {time.time() - started:.0f} s"
    text = (f"Command: `python -m benchmarks.real --all` ({time.strftime('%Y-%m-%d')}{took}, "
            f"{os.cpu_count()}-core machine, Gloo on CPU, one thread per rank, one run: ratios are from that run).\n\n"
            + table(rows) + "\n\n" + notes(rows) + "\n")
    write_readme_block("real", text, heading="Real models")
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="run every configuration and rewrite the README table")
    p.add_argument("--table", action="store_true",
                   help="only rewrite the README table from the newest row of each configuration in --out")
    p.add_argument("--model", default="gpt", choices=("gpt", "resnet", "mlp"))
    p.add_argument("--preset", default="small")
    p.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: the world size)")
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (one more warms up)")
    p.add_argument("--out", default=str(RESULTS / "real.jsonl"))
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DP all-reduce bucket size of our engines (MiB)")
    p.add_argument("--only", nargs="*", help="time only the variants whose names contain one of these")
    a = p.parse_args()
    if a.all or a.table:
        run_all(a.out, table_only=a.table)
        return
    keep_freed_memory()   # as the trainer does on CPU; both engines share the process, so both gain
    init_from_env()
    row = run_config(a.model, a.preset, a.pp or dist.get_world_size(), a.microbatches, a.micro_batch_size, a.rounds,
                     a.only, a.bucket_mb)
    if row is not None:
        print(json.dumps(row), flush=True)
        append_jsonl(a.out, [row])
        print(table([row]) + "\n" + notes([row]), file=sys.stderr, flush=True)
    finish_and_exit()


if __name__ == "__main__":
    main()
