"""Run the benchmark matrix and write benchmarks/results/sweep.jsonl plus the table in benchmarks/README.md.

    python -m benchmarks.sweep                 # pp in {2,4,8} x m in {8,32} x 4 schedules, then real compute
    python -m benchmarks.sweep --pp 2 --steps 4

Run from the repository root. Times per stage: t_f = 10 ms, backward 20 ms split as t_b = 10 ms
(input grad) + t_w = 10 ms (weight grad), activations 8 x 1024 float32. Each pp is one torchrun
invocation of ``-m benchmarks.efficiency``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from benchmarks.common import (RESULTS, ROOT, describe_real, efficiency_table, read_jsonl, torchrun_command,
                               write_readme_block)


def torchrun(n: int, args: list[str]) -> None:
    cmd = torchrun_command(n, "benchmarks.efficiency", args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--microbatches", nargs="+", default=["8", "32"])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-real", action="store_true", help="skip the real-compute pp=2 run")
    args = p.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    out = str(RESULTS / "sweep.jsonl")
    if os.path.exists(out):
        os.replace(out, out + ".prev")
    t0 = time.time()
    for pp in args.pp:
        torchrun(pp, ["--schedules", *args.schedules, "--microbatches", *args.microbatches, "--steps",
                      str(args.steps), "--tf", "0.01", "--tb", "0.01", "--tw", "0.01", "--out", out])
    if not args.no_real:
        torchrun(2, ["--real", "--microbatches", "8", "--steps", str(args.steps), "--out", out])
    rows = read_jsonl(out)
    sleep_rows = [r for r in rows if r.get("mode") != "real"]
    real = [r for r in rows if r.get("mode") == "real"]
    text = [f"Command: `python -m benchmarks.sweep` ({time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s, "
            f"2-core machine, Gloo on CPU, one run: ratios are from that run).", "", efficiency_table(sleep_rows), ""]
    text += [describe_real(r) for r in real]
    write_readme_block("sweep", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
