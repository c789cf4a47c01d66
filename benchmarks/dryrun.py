"""The dry run's own time: ``python -m pipeengine.plan`` at 8, 64 and 1,024 GPUs, wall clock, as a user runs it.

    python -m benchmarks.dryrun                          # 7b, 13b and 70b on 8, 64 and 1,024 H100s
    python -m benchmarks.dryrun --presets 7b --gpus 8 64 --no-readme

Run from the repository root. Each configuration is one ``python -m pipeengine.plan --json`` process (its start,
torch's import, the meta-device layers and the search: what the user waits for); *search* is the search alone (the
projection's own ``seconds``). A model that fits nowhere on the world exits with status 2, one line: timed the same.
The table goes to benchmarks/README.md (block ``dryrun``); *batch* is the chosen plan's global batch in sequences
(the default, about 4M tokens, rounded to its dp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import ROOT, write_readme_block

__all__ = ["run", "table", "main"]


def run(preset: str, gpus: int, gpu: str = "h100", extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One dry run: its wall time, exit status and (when it found a plan) the projection's JSON."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "plan.json")
        cmd = [sys.executable, "-m", "pipeengine.plan", "--preset", preset, "--gpus", str(gpus), "--gpu", gpu,
               "--json", out, *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        plan = json.load(open(out)) if proc.returncode == 0 else None
    return {"preset": preset, "gpus": gpus, "gpu": gpu, "wall_s": wall, "returncode": proc.returncode,
            "plan": plan, "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else ""}


def _row(r: dict[str, Any]) -> str:
    if r["plan"] is None:
        return (f"| {r['preset']} | {r['gpus']:,} | {r['wall_s']:.1f} | | nothing fits (exit {r['returncode']}): "
                f"{r['error'].split(': ', 2)[-1].split(';')[0]} | | | |")
    p, c = r["plan"], r["plan"]["chosen"]
    return (f"| {r['preset']} | {r['gpus']:,} | {r['wall_s']:.1f} | {p['seconds']:.1f} | pp {c['pp']} x dp {c['dp']}, "
            f"{c['schedule']}, recompute {c['recompute']}, m {c['microbatches']}, batch {c['global_batch']} | "
            f"{c['step_s']:.2f} | "
            f"{100 * c['bubble']:.0f}% | {c['tokens_per_s']:,.0f} |")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | GPUs | wall s | search s | chosen | predicted step s | bubble | tokens/s |\n"
            "|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *(_row(r) for r in rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--presets", nargs="+", default=["7b", "13b", "70b"])
    p.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 1024])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--no-readme", action="store_true", help="print the table only")
    args = p.parse_args()
    t0 = time.time()
    rows = [run(preset, gpus, args.gpu) for preset in args.presets for gpus in args.gpus]
    text = (f"Command: `python -m benchmarks.dryrun --presets {' '.join(args.presets)} --gpus "
            f"{' '.join(map(str, args.gpus))}` ({time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s in all, "
            f"2-core shared machine, one run each; {args.gpu}, the default global batch of about 4M tokens):\n\n"
            + table(rows))
    print(text)
    if not args.no_readme:
        write_readme_block("dryrun", text, heading="The dry run for a cluster: its own time")


if __name__ == "__main__":
    main()
