"""Run the benchmark matrix and write benchmarks/results/sweep.jsonl plus the table in benchmarks/README.md.

    python benchmarks/sweep.py                 # pp in {2,4,8} x m in {8,32} x 4 schedules, then real compute
    python benchmarks/sweep.py --pp 2 --steps 4

Times per stage: t_f = 10 ms, backward 20 ms split as t_b = 10 ms (input grad) + t_w = 10 ms (weight
grad), activations 8 x 1024 float32. Each pp is one torchrun invocation of benchmarks/efficiency.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"


def torchrun(n: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           os.path.join(HERE, "efficiency.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--microbatches", nargs="+", default=["8", "32"])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-real", action="store_true", help="skip the real-compute pp=2 run")
    args = p.parse_args()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "sweep.jsonl")
    if os.path.exists(out):
        os.replace(out, out + ".prev")
    t0 = time.time()
    for pp in args.pp:
        torchrun(pp, ["--schedules", *args.schedules, "--microbatches", *args.microbatches, "--steps",
                      str(args.steps), "--tf", "0.01", "--tb", "0.01", "--tw", "0.01", "--out", out])
    if not args.no_real:
        torchrun(2, ["--real", "--microbatches", "8", "--steps", str(args.steps), "--out", out])
    rows = [json.loads(line) for line in open(out)]
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.efficiency import describe_real, table
    sleep_rows = [r for r in rows if r.get("mode") != "real"]
    real = [r for r in rows if r.get("mode") == "real"]
    text = [f"Command: `python benchmarks/sweep.py` ({time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s, "
            f"2-core machine, Gloo on CPU, one run: ratios are from that run).", "", table(sleep_rows), ""]
    text += [describe_real(r) for r in real]
    readme = os.path.join(HERE, "README.md")
    doc = open(readme).read() if os.path.exists(readme) else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(readme, "w") as fh:
        fh.write(head + BEGIN + "\n" + "\n".join(text) + "\n" + END + tail)
    print("\n".join(text))


if __name__ == "__main__":
    main()
