"""The twin against the stopwatch: predicted step time and peak memory per rank beside the measured ones.

    python -m benchmarks.twin                  # the ten configurations and the two with shared cores
    python -m benchmarks.twin --only "gpt small" --steps 20

Run from the repository root. Each configuration is one trainer run (``launch/pipe.sh N cpus``, global batch 32,
the built-in data); the figures are its summary.json's: ``predicted_step_s`` against ``median_step_s`` (the
pipeline step) and, per position, ``predicted_peak_memory_mib`` against the peak resident set above the process's
baseline before the model was built. Memory is compared where the model's state and activations exceed 50 MiB
(below that the process's own allocations, a few MiB either way, decide). The table goes to
benchmarks/README.md (block ``twin``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
from typing import Any

from benchmarks.common import ROOT, write_readme_block

# (label, processes, pp, model flags, schedule): ten configurations on a core each, then two sharing cores
CONFIGS: list[tuple[str, int, int, list[str], str]] = [
    ("mlp small", 1, 1, ["--model", "mlp", "--preset", "small"], "1f1b"),
    ("mlp small", 2, 2, ["--model", "mlp", "--preset", "small"], "1f1b"),
    ("gpt tiny", 1, 1, ["--model", "gpt", "--preset", "tiny"], "1f1b"),
    ("gpt tiny", 2, 2, ["--model", "gpt", "--preset", "tiny"], "1f1b"),
    ("gpt tiny", 2, 2, ["--model", "gpt", "--preset", "tiny"], "zbv"),
    ("gpt small", 1, 1, ["--model", "gpt", "--preset", "small"], "1f1b"),
    ("gpt small", 2, 2, ["--model", "gpt", "--preset", "small"], "auto"),
    ("resnet18", 2, 2, ["--model", "resnet", "--preset", "resnet18"], "auto"),
    ("resnet50", 1, 1, ["--model", "resnet", "--preset", "resnet50"], "1f1b"),
    ("resnet50", 2, 2, ["--model", "resnet", "--preset", "resnet50"], "zbv"),
    ("gpt tiny", 4, 4, ["--model", "gpt", "--preset", "tiny"], "auto"),
    ("resnet18", 4, 4, ["--model", "resnet", "--preset", "resnet18"], "1f1b"),
]


def run(config: tuple[str, int, int, list[str], str], steps: int) -> dict[str, Any]:
    label, procs, pp, flags, schedule = config
    with tempfile.TemporaryDirectory() as logs:
        cmd = [str(ROOT / "launch" / "pipe.sh"), str(procs), "cpus", "--pp", str(pp), *flags, "--schedule", schedule,
               "--steps", str(steps), "--global-batch", "32", "--eval-interval", "0", "--log-dir", logs]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        (path,) = glob.glob(os.path.join(logs, "*", "summary.json"))
        with open(path) as fh:
            s = json.load(fh)
    print(f"  predicted {1e3 * s['predicted_step_s']:.1f} ms = " + "  ".join(
        f"{k} {1e3 * v:.1f}" for k, v in s["predicted_step_parts_s"].items()) + f"; measured median "
        f"{1e3 * s['median_step_s']:.1f} ms, mean wall {1e3 * s['wall_s_per_step']:.1f} ms = " + "  ".join(
        f"{k} {1e3 * v * s['wall_s_per_step']:.1f}" for k, v in s["step_parts"].items()), flush=True)
    measured = {p: m["above_baseline"] for p, m in s["peak_memory_mib"].items()}
    parts = s["predicted_memory_parts_mib"]
    model = max(sum(v for k, v in parts[p].items() if k != "buffers") for p in parts)
    worst = max(measured, key=lambda p: abs(s["predicted_peak_memory_mib"][p] / measured[p] - 1))
    return {"label": label, "pp": pp, "procs": procs, "schedule": s["schedule_run"] if schedule == "auto" else schedule,
            "asked": schedule, "predicted_s": s["predicted_step_s"], "measured_s": s["median_step_s"],
            "predicted_mib": s["predicted_peak_memory_mib"][worst], "measured_mib": measured[worst],
            "position": worst, "model_mib": model}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | pp | schedule | predicted step (ms) | measured (ms) | error | predicted peak (MiB) | measured "
             "above baseline (MiB) | error | model state + activations (MiB) |", "|---" * 10 + "|"]
    for r in rows:
        shared = " (4 ranks, 2 cores)" if r["procs"] > 2 else ""
        ran = r["schedule"] if r["asked"] != "auto" else f"auto ({r['schedule']})"
        memory_error = r["predicted_mib"] / r["measured_mib"] - 1
        lines.append(f"| {r['label']}{shared} | {r['pp']} | {ran} | {1e3 * r['predicted_s']:.1f} | "
                     f"{1e3 * r['measured_s']:.1f} | {100 * (r['predicted_s'] / r['measured_s'] - 1):+.0f}% | "
                     f"{r['predicted_mib']:,.0f} | {r['measured_mib']:,.0f} | {100 * memory_error:+.0f}%"
                     f"{'' if r['model_mib'] > 50 else ' (n/a: < 50 MiB)'} | {r['model_mib']:,.0f} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    alone = [r for r in rows if r["procs"] <= 2]
    shared = [r for r in rows if r["procs"] > 2]
    within = sum(abs(r["predicted_s"] / r["measured_s"] - 1) <= 0.10 for r in alone)
    within_shared = sum(abs(r["predicted_s"] / r["measured_s"] - 1) <= 0.25 for r in shared)
    big = [r for r in rows if r["model_mib"] > 50]
    memory = sum(abs(r["predicted_mib"] / r["measured_mib"] - 1) <= 0.10 for r in big)
    return (f"step time within 10%: {within} of {len(alone)}; with shared cores within 25%: {within_shared} of "
            f"{len(shared)}; peak memory within 10%: {memory} of {len(big)} configurations above 50 MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", help="run the configurations whose label is this")
    p.add_argument("--no-readme", action="store_true", help="print the table only")
    args = p.parse_args()
    rows = [run(c, args.steps) for c in CONFIGS if args.only in (None, c[0])]
    text = table(rows) + "\n\n" + summary(rows)
    print(text)
    if not args.no_readme and args.only is None:
        write_readme_block("twin", text + "\n\n(`python -m benchmarks.twin`, one run)")


if __name__ == "__main__":
    main()
