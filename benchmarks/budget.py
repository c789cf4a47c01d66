"""A memory budget the planner keeps: 20 budgets from the least feasible to unconstrained, each run and measured.

    python -m benchmarks.budget                    # GPT small, pp 2, --schedule auto, 20 budgets
    python -m benchmarks.budget --budgets 5 --steps 4
    python -m benchmarks.budget --simulate         # the twin alone: the half budget at pp 2, 4 and 8

Run from the repository root. First three dry runs (``--dry-run``, nothing trained): with a budget far too small
(its one-line refusal names the least feasible budget), with none (the unconstrained plan's predicted peak)
and with 1F1B (its activations at the fullest position). Then one trainer run per budget (``launch/pipe.sh 2
cpus --schedule auto --memory-budget B``), from the least feasible to 10% above the unconstrained peak, and one
at the 1F1B peak less half its activations. Each row: what the planner chose, its predicted peak, the measured
peak above the process's baseline (the most over the positions) and whether it kept the budget, and tokens/s.
The table goes to benchmarks/README.md (block ``budget``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import tempfile
from typing import Any

from benchmarks.common import ROOT, write_readme_block

MODEL = ["--model", "gpt", "--preset", "small"]


def trainer(flags: list[str], steps: int) -> tuple[dict[str, Any] | None, str]:
    """One run of ``launch/pipe.sh 2 cpus`` (its summary.json, or None) and its output."""
    with tempfile.TemporaryDirectory() as logs:
        cmd = [str(ROOT / "launch" / "pipe.sh"), "2", "cpus", *MODEL, "--steps", str(steps), "--eval-interval", "0",
               "--log-dir", logs, *flags]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        found = glob.glob(os.path.join(logs, "*", "summary.json"))
        summary = json.load(open(found[0])) if found else None
    return summary, proc.stdout + proc.stderr


def least_feasible() -> float:
    """GiB: the least budget the planner accepts (from its refusal of a far too small one)."""
    _, out = trainer(["--schedule", "auto", "--dry-run", "--memory-budget", "0.01"], 1)
    found = re.search(r"needs is ([0-9.]+) GiB", out)
    if found is None:
        raise SystemExit(f"the refusal named no least budget:\n{out[-2000:]}")
    return float(found.group(1))


def predicted_peak(flags: list[str]) -> dict[str, Any]:
    summary, out = trainer(["--dry-run", *flags], 1)
    if summary is None:
        raise SystemExit(out[-2000:])
    return summary


def row(budget_gib: float, steps: int, label: str = "") -> dict[str, Any]:
    s, out = trainer(["--schedule", "auto", "--memory-budget", f"{budget_gib:.4f}"], steps)
    if s is None or s.get("status") != "done":
        return {"budget": budget_gib, "label": label, "error": out.strip().splitlines()[-1][:200]}
    chosen = re.search(r"memory budget [0-9.]+ GiB per rank \(90% planned\): (.*?); predicted step", out)
    return {"budget": budget_gib, "label": label, "chosen": chosen.group(1) if chosen else "?",
            "predicted_mib": max(s["predicted_peak_memory_mib"].values()),
            "measured_mib": max(m["above_baseline"] for m in s["peak_memory_mib"].values()),
            "tokens_per_s": s["tokens_per_s"], "median_step_s": s["median_step_s"]}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| budget (GiB) | chosen (schedule on bounds, recompute) | predicted peak (MiB) | measured peak above "
             "baseline (MiB) | kept | tokens/s | vs unconstrained |", "|---" * 7 + "|"]
    best = max((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), default=1.0)
    for r in rows:
        name = f"{r['budget']:.3f}{' ' + r['label'] if r['label'] else ''}"
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        kept = "yes" if r["measured_mib"] <= r["budget"] * 1024 else "**no**"
        lines.append(f"| {name} | {r['chosen']} | {r['predicted_mib']:,.0f} | {r['measured_mib']:,.0f} | {kept} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / best:.2f}x |")
    return "\n".join(lines)


def simulated_half() -> None:
    """The twin alone (nothing runs): on 4pp alike GPT-small-like blocks (F = B = W = 1 ms; 16 MiB kept a block, 11
    MiB of gradients B keeps for W, 7 MiB of the 16 that a split B frees), per pp and microbatches the unconstrained
    best plan and the best at 1F1B's peak less half its activations: with whole microbatches, and with each run as
    2 or 4 pieces of a k-th the cost and bytes (linear: on this CPU a piece of GPT small costs about that; a GPU
    computes small pieces less efficiently, which the trainer's budget measures by profiling a piece)."""
    import dataclasses

    from pipeengine.runtime.budget import HEADROOM, fit_budget
    from pipeengine.runtime.measured import LayerCost
    from pipeengine.runtime.planner import PartitionError
    from pipeengine.runtime.twin import Host

    mib, free = 2**20, Host(per_step=0.0, per_post=0.0, post_bandwidth=float("inf"))
    print("| pp | m | unconstrained best | 1F1B | at half 1F1B's activations | vs best | with pieces | vs best |\n"
          "|---|---|---|---|---|---|---|---|")
    for pp in (2, 4, 8):
        block = LayerCost(1e-3, 1e-3, 1e-3, 2e-3, 17 * mib, 0, output_bytes=mib, held_for_w=11 * mib,
                          freed_at_b=7 * mib, direct_w=True)
        for m in (2 * pp, 4 * pp):
            costs = [block] * (4 * pp)
            best = fit_budget(costs, pp, m, 1e15, host=free)
            one = fit_budget(costs, pp, m, 1e15, host=free, schedules=["1f1b"])
            full = max(one.twin.memory, key=lambda part: part.total)
            budget = (full.total - full.activations / 2) / (1 - HEADROOM)
            half = fit_budget(costs, pp, m, budget, host=free)
            cut = []
            for k in (2, 4):
                piece = dataclasses.replace(block, **{f: getattr(block, f) / k for f in ("f", "b", "w", "fused")},
                                            **{f: getattr(block, f) // k for f in (
                                                "activation_bytes", "output_bytes", "held_for_w", "freed_at_b")})
                try:
                    cut.append(fit_budget([piece] * (4 * pp), pp, m * k, budget, host=free, pieces=k))
                except PartitionError:
                    pass
            pieces = min([half, *cut], key=lambda c: c.twin.step_s)
            print(f"| {pp} | {m} | {best.schedule.name} {1e3 * best.twin.step_s:.0f} ms | "
                  f"{1e3 * one.twin.step_s:.0f} ms | {_plan_text(half)} | {best.twin.step_s / half.twin.step_s:.2f}x | "
                  f"{_plan_text(pieces)} | {best.twin.step_s / pieces.twin.step_s:.2f}x |")


def _plan_text(c: Any) -> str:
    shown = ", ".join(sorted(set(c.recompute) - {"none"})) or "none"
    cut = f", {c.pieces} pieces" if c.pieces > 1 else ""
    return f"{c.schedule.name}{cut} (recompute {shown}) {1e3 * c.twin.step_s:.0f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-readme", action="store_true", help="print the table only")
    p.add_argument("--simulate", action="store_true", help="only the twin's half-budget plans on alike blocks at pp "
                   "2, 4 and 8 (nothing runs)")
    args = p.parse_args()
    if args.simulate:
        simulated_half()
        return
    least = least_feasible()
    free = max(predicted_peak(["--schedule", "auto"])["predicted_peak_memory_mib"].values()) / 1024
    one = predicted_peak(["--schedule", "1f1b"])
    fullest = max(one["predicted_peak_memory_mib"], key=lambda k: one["predicted_peak_memory_mib"][k])
    half = (one["predicted_peak_memory_mib"][fullest] - one["predicted_memory_parts_mib"][fullest]["activations"] / 2)
    top = free / 0.9 * 1.1   # unconstrained: the plan's peak with the planner's headroom, and 10% more
    budgets = [least + (top - least) * i / max(1, args.budgets - 1) for i in range(args.budgets)]
    rows = [row(b, args.steps) for b in budgets]
    rows.append(row(half / 1024 / 0.9, args.steps, "(1F1B's peak less half its activations)"))
    kept = sum(1 for r in rows if "measured_mib" in r and r["measured_mib"] <= r["budget"] * 1024)
    text = (table(rows) + f"\n\nleast feasible {least:.3f} GiB, unconstrained plan's predicted peak {free:.3f} GiB; "
            f"the budget kept on {kept} of {len(rows)} runs")
    print(text)
    if not args.no_readme:
        write_readme_block("budget", text + "\n\n(`python -m benchmarks.budget`, one run)")


if __name__ == "__main__":
    main()
