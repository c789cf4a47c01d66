"""Documents of their own lengths through the pipeline: real tokens/s with --packing pad, pack and ragged.

    python -m benchmarks.packing                      # GPT tiny-1k and small at --context 1024, pp 2
    python -m benchmarks.packing --presets tiny-1k --steps 10

Run from the repository root. Each configuration is one trainer run (``launch/pipe.sh 2 cpus``, pp 2, the
built-in document corpus, the same seed and global batch: the same documents every step whatever the
packing); the figures are its summary.json's: real tokens/s and the padding fraction over the steps after
warm-up (wall time, everything included), the median pipeline step, the peak RSS per position. The table goes
to benchmarks/README.md (block ``packing``).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import subprocess
import tempfile
import time
from array import array
from typing import Any

from benchmarks.common import ROOT, write_readme_block

MODES = ("pad", "pack", "ragged")
CORPORA = {"pieces": "every token (long ones in context pieces)",
           "truncated": "one a sequence (cut at the context)"}


def truncated_corpus(folder: str, context: int) -> str:
    """The built-in documents, each cut at ``context`` + 1 tokens (one document a sequence: what users who pad do,
    the tails of longer ones dropped), as a token file with its document index (``--data`` of the second table)."""
    from pipeengine.models.documents import _stdlib_documents
    docs = [d[:context + 1] for d in _stdlib_documents(4_000_000)]
    path = os.path.join(folder, "truncated.bin")
    with open(path, "wb") as fh:
        fh.write(array("H", list(b"".join(docs))).tobytes())   # a byte a token
    with open(path[:-4] + ".idx", "wb") as fh:
        fh.write(array("q", itertools.accumulate([0] + [len(d) for d in docs])).tobytes())
    return path


def run(preset: str, mode: str, args: argparse.Namespace, data: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:
        cmd = [str(ROOT / "launch" / "pipe.sh"), "2", "cpus", "--model", "gpt", "--preset", preset, "--context",
               str(args.context), "--packing", mode, "--steps", str(args.steps), "--global-batch",
               str(args.global_batch), "--microbatches", str(args.microbatches), "--eval-interval", "0",
               "--log-dir", logs, *(["--data", data] if data else [])]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        (path,) = glob.glob(os.path.join(logs, "*", "summary.json"))
        with open(path) as fh:
            s = json.load(fh)
    peak = max(m["rss"] for m in s["peak_memory_mib"].values())
    return {"preset": preset, "mode": mode, "corpus": "truncated" if data else "pieces",
            "tokens_per_s": s["tokens_per_s"], "padding": s["padding_fraction"], "step_s": s["median_step_s"],
            "peak_mib": peak}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| documents | model | packing | real tokens/s | vs pad | padding | median step (ms) | peak RSS per rank "
             "(MiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pad = next(x for x in rows if (x["preset"], x["corpus"], x["mode"]) == (r["preset"], r["corpus"], "pad"))
        lines.append(f"| {CORPORA[r['corpus']]} | GPT {r['preset']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / pad['tokens_per_s']:.2f}x | {100 * r['padding']:.1f}% | "
                     f"{1000 * r['step_s']:.0f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny-1k", "small"])
    p.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--no-readme", action="store_true", help="print the table only")
    args = p.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as folder:
        data = {"pieces": None, "truncated": truncated_corpus(folder, args.context)}
        rows = [run(preset, mode, args, data[corpus]) for corpus in args.corpora for preset in args.presets
                for mode in MODES]
    text = (f"Command: `python -m benchmarks.packing --presets {' '.join(args.presets)} --steps {args.steps}` "
            f"({time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s, 2-core machine, pp 2 on CPU, context "
            f"{args.context}, global batch {args.global_batch} sequences in {args.microbatches} microbatches, "
            f"one run each, the same documents every step):\n\n" + table(rows))
    print(text)
    if not args.no_readme:
        write_readme_block("packing", text, heading="Documents of their own lengths: pad, pack, ragged")


if __name__ == "__main__":
    main()
