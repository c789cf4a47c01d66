"""Peak memory per rank: our engine against torch.distributed.pipelining, same model, microbatches and partition.

    python -m benchmarks.memory                  # full matrix (pp 2, 4; m 4, 16, 64; A = 16 MiB) + extras + big GPT
                                                 # (estimated 15-20 minutes on the 2-core VM)
    python -m benchmarks.memory --quick          # smoke test: pp 2, m 4 and 16, A = 4 MiB, 1 measured step,
                                                 # small GPT at pp 2 (about 1.5 minutes on the 2-core VM)
    python -m benchmarks.memory --microbatches 4 16 --act-mib 4 --write-readme
                                                 # pp 2 and 4, the big GPT; rewrites the table between
                                                 # <!-- memory:begin --> and <!-- memory:end --> in benchmarks/README.md

Run from the repository root. This script is the launcher: per configuration it starts P fresh worker
processes ``python -m benchmarks.memory_worker ...`` (memory_worker.py) itself, in the repository root
(RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT in their environment, as ``torchrun --standalone`` would
set them), with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc returns big freed blocks at once, so RSS follows
live memory) and ``OMP_NUM_THREADS=1``; every configuration starts from a clean process. One
configuration by hand:

    MALLOC_MMAP_THRESHOLD_=65536 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m benchmarks.memory_worker --model boundary --schedule 1f1b -m 16 --act-mib 16 \\
        --variants ours torch --out-dir /tmp/mem     # per-rank JSON files in /tmp/mem

What it measures, per rank:

* Matrix (``boundary`` model): one layer per stage, ``y = x * w + b`` with ``w, b`` of shape (cols,),
  so a microbatch's only stored activation is the stage's input, one float32 tensor of A MiB
  (rows x 1024). Loss ``out.float().mean()``. Schedules 1f1b, gpipe, zb-h1 (torch: Schedule1F1B,
  ScheduleGPipe, ScheduleInterleavedZeroBubble with one stage per rank), dp = 1. Both engines run in
  the same worker processes, one after the other (ours first; ``warm_process()`` pays the one-time
  lazy imports before either is measured), on the same pre-split microbatches
  (torch gets them through ``arg_mbs=`` and ``return_outputs=False``, so it neither splits a batch
  nor keeps the outputs). For each engine: RSS before it is built (*pre*), one warm-up step, then
  the kernel's peak-RSS counter is reset (``5 > /proc/self/clear_refs``) and VmRSS read (*baseline*),
  the measured steps run, and VmHWM is read. *growth* = VmHWM - baseline (what a step allocates and
  frees), *held* = baseline - pre (what the engine keeps between steps, e.g. preallocated receive
  buffers), *peak* = held + growth. Also in units of A ("activations"). On CUDA the same with
  ``torch.cuda.reset_peak_memory_stats`` / ``memory_allocated`` / ``max_memory_allocated``.
  Step times are recorded but are not performance figures: with the mmap threshold every large
  allocation is a fresh mmap whose pages fault in, which slows both engines.
* Extra rows, ours only: ``precision="bf16"`` on the boundary model and, fp32 against bf16, on a
  ``weights`` model (4 Linear(1024, 1024) per stage, 8-row microbatches, GPipe m = 8: where a bf16
  copy of the weights per microbatch in flight would show), and a ``deep`` model (4 layers
  ``relu(x * w + b)`` per stage, each saving its A-MiB output) with ``recompute="none"`` and
  ``"full"``: peak and step time. Skipped with a note if PipelineEngine has no such argument.
* Big GPT (models/gpt.py), pp = 4 (pp = 2 with --quick), AdamW, 2 steps: each rank's peak RSS over
  its RSS at process start (after importing torch and ``warm_process()``, whose first optimizer
  imports torch._dynamo: ~150 MiB that is not model memory), against the whole model's fp32
  param + grad + AdamW bytes (16 bytes per parameter). Built from per-layer factories when
  pipeengine.models.gpt has them (each rank builds only its stages), and, for comparison, as the full module
  list that every rank builds and keeps, as in the README's usage example.

Output: a table on stdout, one JSON line per (configuration, engine variant) in
benchmarks/results/memory.jsonl (the previous file is kept as memory.jsonl.prev).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import pipeengine.models.gpt as gpt
from benchmarks.common import RESULTS, ROOT, append_jsonl, start_ranks, wait_ranks, write_readme_block
from benchmarks.memory_tables import extra_table, gpt_table, matrix_table, table_head
from benchmarks.memory_worker import COLS, DEEP_LAYERS, MIB, TORCH_SCHEDULES, key_of
from pipeengine.runtime.engine import PipelineEngine

WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------- launcher

def launch(nproc: int, wargs: list[str], out_dir: str, timeout: float) -> tuple[bool, str]:
    """Start ``nproc`` fresh worker processes of this module (env:// rendezvous on a free port); wait for them.

    The same as ``torchrun --standalone --nproc_per_node nproc`` without torchrun's own process (which
    would import torch once more on this 2-core machine). If one worker fails or the time runs out,
    the others (which would wait in a collective) are killed. Returns (ok, tail of rank 0's output).
    """
    cmd = [sys.executable, "-m", "benchmarks.memory_worker", *wargs]
    print("+", " ".join(cmd[1:]), flush=True)
    logs = [open(os.path.join(out_dir, f"log.rank{r}.txt"), "w") for r in range(nproc)]
    try:
        failed, rank = wait_ranks(start_ranks(cmd, nproc, dict(os.environ, **WORKER_ENV), cwd=ROOT, stdout=logs,
                                              stderr=subprocess.STDOUT), timeout)
    finally:
        for fh in logs:
            fh.close()
    with open(os.path.join(out_dir, f"log.rank{rank}.txt")) as fh:
        tail = fh.read()[-2000:]
    return not failed, (failed + "\n" + tail) if failed else tail


def collect(out_dir: str, variant: str, nproc: int) -> tuple[list[dict[str, Any]], str | None]:
    """Per-rank records of one variant, or the first error a rank wrote (None if none wrote anything)."""
    recs: list[dict[str, Any]] = []
    for r in range(nproc):
        path = os.path.join(out_dir, f"{key_of(variant)}.rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                recs.append(json.load(fh))
    errors = [r["error"] for r in recs if "error" in r]
    if errors:
        return [], errors[0]
    return (recs, None) if len(recs) == nproc else ([], "no result (a process died; see the launch output)")


def run_config(nproc: int, variants: list[str], wargs: list[str], timeout: float) -> dict[str, Any]:
    """Run variants in one launch; a variant that fails is reported and the rest get a launch of their own."""
    results: dict[str, Any] = {}
    todo = list(variants)
    while todo:
        with tempfile.TemporaryDirectory(prefix="memory-") as out_dir:
            ok, tail = launch(nproc, [*wargs, "--out-dir", out_dir, "--variants", *todo], out_dir, timeout)
            done = []
            for v in todo:
                recs, err = collect(out_dir, v, nproc)
                if recs:
                    results[v] = recs
                    done.append(v)
                elif err and not err.startswith("no result"):
                    results[v] = err
                    done.append(v)
            if not done:   # nothing came back: report every remaining variant with the launch output
                print(tail, file=sys.stderr)
                for v in todo:
                    lines = tail.strip().splitlines() or ["?"]
                    results[v] = f"launch failed: {lines[0]}; {lines[-1]}"
                break
            if not ok:
                print(f"  (launch failed after {', '.join(done)}; rerunning the rest)\n{tail[-800:]}", file=sys.stderr)
            todo = [v for v in todo if v not in done]
    return results


ZERO_LAYOUTS = ((2, 2), (1, 4))   # pp x dp, 4 ranks


def zero_section(a: argparse.Namespace) -> None:
    """ZeRO-1 rows: GPT small (models/gpt.py "small" preset), AdamW, 1f1b, m 4, with and without sharding; each
    configuration launched ``--rounds`` times, alternating, so both see the same machine."""
    t0 = time.time()
    cfg = dataclasses.asdict(gpt.presets()["small"]())
    steps = a.steps or 6
    runs: dict[tuple[int, int, int], list[list[dict[str, Any]]]] = {}
    for _ in range(a.rounds):
        for pp, dp in ZERO_LAYOUTS:
            for zero in (0, 1):
                res = run_config(4, ["factories"], ["--model", "gpt", "-m", "4", "--steps", str(steps), "--timeout",
                                                    str(a.timeout), "--gpt-config", json.dumps(cfg), "--gpt-batch",
                                                    "4", "--dp", str(dp), "--zero", str(zero)], a.timeout)
                if not isinstance(res["factories"], list):
                    raise SystemExit(f"pp {pp} x dp {dp} zero {zero}: {res['factories']}")
                runs.setdefault((pp, dp, zero), []).append(res["factories"])
    lines = table_head("pp x dp", "zero", "rank", "optimizer state MiB", "peak growth MiB",
                       "step (s), median per round", "step time / unsharded")
    for (pp, dp, zero), rounds in runs.items():
        base = [statistics.median(x["step_s"]) for recs in runs[(pp, dp, 0)] for x in recs if x["rank"] == 0]
        for x in sorted(rounds[-1], key=lambda x: x["rank"]):
            mine = [statistics.median(y["step_s"]) for recs in rounds for y in recs if y["rank"] == x["rank"]]
            # each round's ratio against the unsharded launch just before it, then the median over rounds
            ratio = statistics.median(a / b for a, b in zip(mine, base)) if x["rank"] == 0 else None
            lines.append(f"| {pp} x {dp} | {zero} | {x['rank']} | {x['optimizer_state_mib']:.1f} | "
                         f"{x['growth_mib']:.0f} | {', '.join(f'{t:.3f}' for t in mine)} | "
                         f"{'' if ratio is None else f'{ratio:.3f}'} |")
    n = gpt_full_params(gpt.Config(**cfg))
    print(f"Command: `python -m benchmarks.memory {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}, "
          f"{time.time() - t0:.0f} s). GPT small ({n / 1e6:.2f} M parameters; AdamW state of the whole model "
          f"{n * 8 / MIB:.1f} MiB), m 4 x 4 sequences of {cfg['block_size']} per replica, 1f1b, {steps} measured "
          f"steps per launch after 1 warm-up; step-time ratio on rank 0: each round's against the unsharded launch "
          f"before it, median over rounds.\n")
    print("\n".join(lines))
    append_jsonl(a.out, [{"section": "zero", "pp": pp, "dp": dp, "zero": z, "rounds": r}
                         for (pp, dp, z), r in runs.items()])


def engine_options() -> tuple[bool, bool]:
    """Does PipelineEngine take recompute= and precision= (the extra rows need them)?"""
    params = inspect.signature(PipelineEngine.__init__).parameters
    return "recompute" in params, "precision" in params


def gpt_full_params(cfg: gpt.Config) -> int:
    """Parameters of the whole model, the tied head counted once (built on meta: allocates nothing)."""
    with torch.device("meta"):
        layers = gpt.build(cfg)
    return sum(p.numel() for p in {id(p): p for m in layers for p in m.parameters()}.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="pp 2, m 4 and 16, A = 4 MiB, 1 measured step, small GPT at pp 2 (overrides --pp, "
                        "--microbatches, --act-mib)")
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4])
    p.add_argument("--microbatches", nargs="+", type=int, default=[4, 16, 64])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zb-h1"], choices=list(TORCH_SCHEDULES))
    p.add_argument("--act-mib", type=int, default=16, help="A: MiB of one microbatch's activation (float32)")
    p.add_argument("--steps", type=int, default=None, help="measured steps after one warm-up step (2; --quick: 1)")
    p.add_argument("--no-extra", action="store_true", help="skip the bf16 and recompute rows")
    p.add_argument("--no-gpt", action="store_true", help="skip the big GPT section")
    p.add_argument("--gpt-layers", choices=["auto", "factories", "modules", "both"], default=None,
                   help="how the GPT is given to the engine (auto: factories if pipeengine.models.gpt has them, else "
                        "modules; default both, --quick: auto)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--write-readme", action="store_true", help="rewrite the memory section of benchmarks/README.md")
    p.add_argument("--out", default=str(RESULTS / "memory.jsonl"))
    p.add_argument("--only-zero", action="store_true",
                   help="only the ZeRO-1 rows: GPT small, AdamW, pp 2 x dp 2 and pp 1 x dp 4, with and without "
                        "sharding, alternated over --rounds rounds (about 2 minutes per round on the 2-core VM)")
    p.add_argument("--rounds", type=int, default=2, help="ZeRO-1 rows: launches per configuration, alternated")
    a = p.parse_args()

    if a.only_zero:
        zero_section(a)
        return
    if a.quick:
        a.pp, a.microbatches, a.act_mib = [2], [4, 16], 4
    a.steps = a.steps or (1 if a.quick else 2)
    a.gpt_layers = a.gpt_layers or ("auto" if a.quick else "both")
    t0 = time.time()
    notes: list[str] = []
    has_ckpt, has_prec = engine_options()
    common = ["--act-mib", str(a.act_mib), "--steps", str(a.steps), "--timeout", str(a.timeout)]

    # 1. the matrix, both engines (plus ours in bf16 on 1f1b at the largest m, in the same launch)
    matrix, extras = [], []
    for pp in a.pp:
        for sched in a.schedules:
            for m in a.microbatches:
                variants = ["ours", "torch"]
                bf16 = not a.no_extra and has_prec and sched == "1f1b" and m == max(a.microbatches)
                if bf16:
                    variants.append("ours:precision=bf16")
                res = run_config(pp, variants, ["--model", "boundary", "--schedule", sched, "-m", str(m), *common],
                                 a.timeout)
                row = {"section": "matrix", "model": "boundary", "schedule": sched, "pp": pp, "m": m,
                       "act_mib": a.act_mib, "steps": a.steps, "torch_schedule": TORCH_SCHEDULES[sched]}
                matrix.append(dict(row, results={k: res[k] for k in ("ours", "torch")}))
                if bf16:
                    extras.append(dict(row, section="extra", results={"ours:precision=bf16": res[variants[2]]}))
    if not a.no_extra and not has_prec:
        notes.append("bf16 rows skipped: engine has no precision= argument yet")

    # 2. recompute (activation checkpointing) on the deep model (ours only): same schedule and m, with and without
    if not a.no_extra:
        if has_ckpt:
            m = sorted(a.microbatches)[len(a.microbatches) // 2]   # the middle m (16): deep stages hold 5 A each
            for pp in a.pp:
                for sched in (["1f1b"] if a.quick else ["1f1b", "gpipe"]):
                    res = run_config(pp, ["ours", "ours:recompute=full"],
                                     ["--model", "deep", "--schedule", sched, "-m", str(m), *common], a.timeout)
                    extras.append({"section": "extra", "model": f"deep ({DEEP_LAYERS} relu layers/stage)",
                                   "schedule": sched, "pp": pp, "m": m, "act_mib": a.act_mib, "steps": a.steps,
                                   "results": res})
        else:
            notes.append("recompute rows skipped: engine has no recompute= argument yet")
        if has_prec:   # bf16 against fp32 where the weights dominate: GPipe holds every microbatch in flight
            for pp in a.pp:
                res = run_config(pp, ["ours", "ours:precision=bf16"],
                                 ["--model", "weights", "--schedule", "gpipe", "-m", "8", *common], a.timeout)
                name = f"weights ({DEEP_LAYERS} Linear({COLS}, {COLS})/stage, 8-row microbatches)"
                extras.append({"section": "extra", "model": name, "schedule": "gpipe", "pp": pp, "m": 8,
                               "act_mib": 8 * COLS * 4 / MIB, "steps": a.steps, "results": res})
    for r in matrix + extras:
        for recs in r["results"].values():
            if isinstance(recs, list):
                for x in recs:
                    x["peak"] = x["held_mib"] + x["growth_mib"]

    # 3. big GPT: factories when pipeengine.models.gpt provides them (per-stage construction), modules for comparison
    gpt_rows: list[dict[str, Any]] = []
    if not a.no_gpt:
        cfg_kw: dict[str, Any]
        if a.quick:
            cfg_kw, gpt_pp = {"n_layer": 4, "n_head": 8, "n_embd": 512, "block_size": 64}, 2
        else:
            cfg_kw, gpt_pp = {"n_layer": 12, "n_head": 16, "n_embd": 1024, "block_size": 64}, 4
        ways = {"auto": ["factories" if hasattr(gpt, "layer_factories") else "modules"],
                "both": ["factories", "modules"] if hasattr(gpt, "layer_factories") else ["modules"],
                "factories": ["factories"], "modules": ["modules"]}[a.gpt_layers]
        if not hasattr(gpt, "layer_factories"):
            notes.append("pipeengine.models.gpt has no layer_factories yet: the GPT is given as modules "
                         "(every rank builds all)")
        full = gpt_full_params(gpt.Config(**cfg_kw)) * 16
        for way in ways:
            res = run_config(gpt_pp, [way], ["--model", "gpt", "-m", "4", "--steps", "2", "--timeout", str(a.timeout),
                                             "--gpt-config", json.dumps(cfg_kw)], a.timeout)
            gpt_rows.append({"section": "gpt", "variant": way, "pp": gpt_pp, "m": 4, "gpt_config": cfg_kw,
                             "full_params": full // 16, "full_state_bytes": full, "results": res[way]})

    elapsed = time.time() - t0
    if os.path.exists(a.out):
        shutil.move(a.out, a.out + ".prev")
    append_jsonl(a.out, matrix + extras + gpt_rows)

    cmd = " ".join(["python -m benchmarks.memory", *(x for x in sys.argv[1:] if x != "--write-readme")])
    text = [f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {elapsed:.0f} s, "
            f"{'CUDA' if torch.cuda.is_available() else '2-core machine, Gloo on CPU'}, "
            f"A = {a.act_mib} MiB, {a.steps} measured step{'s' if a.steps > 1 else ''} after 1 warm-up; MiB per rank, "
            f"rank 0 first).", "",
            matrix_table(matrix)]
    if extras:
        text += ["", extra_table(extras)]
    if gpt_rows:
        g = gpt_rows[0]
        text += ["", f"Big GPT ({g['gpt_config']}, {g['full_params'] / 1e6:.1f} M parameters, full fp32 param + grad "
                 f"+ AdamW = {g['full_state_bytes'] / 2**30:.2f} GiB), pp = {g['pp']}, 1f1b, m = 4, 2 AdamW steps; "
                 f"growth over each rank's RSS at process start (after importing torch and warm_process()):", "",
                 gpt_table(gpt_rows)]
    if notes:
        text += [""] + [f"Note: {n}." for n in notes]
    print("\n".join(text))
    print(f"\n({elapsed:.0f} s; JSON lines in {os.path.relpath(a.out, ROOT)})")
    if a.write_readme:
        write_readme_block("memory", "\n".join(text))


if __name__ == "__main__":
    main()
