"""What the benchmark scripts share: paths, process groups, timed steps, JSON lines, README blocks, result tables."""

from __future__ import annotations

import json
import os
import signal
import statistics
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import torch
import torch.distributed as dist

__all__ = ["ROOT", "HERE", "README", "RESULTS", "torchrun_command", "excess_fits", "free_port", "init_from_env",
           "finish_and_exit", "timed_steps", "mean_loss", "append_jsonl", "read_jsonl", "write_readme_block",
           "efficiency_table", "describe_real", "process_tree", "kill_tree", "start_ranks", "wait_ranks"]

ROOT = Path(__file__).resolve().parent.parent      # the repository root: scripts run from here, as ``-m benchmarks.X``
HERE = ROOT / "benchmarks"
README = HERE / "README.md"
RESULTS = HERE / "results"


# ---------------------------------------------------------------------------------------------- processes

def process_tree(root: int) -> set[int]:
    """``root`` and every process below it now (read from /proc)."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def torchrun_command(nproc: int, module: str, args: Iterable[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node N -m benchmarks.X ...`` (run with cwd=ROOT)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", module, *args]


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (those gone meanwhile are passed over)."""
    for pid in process_tree(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_ranks(cmd: list[str], nproc: int, env: dict[str, str] | None = None,
                **popen: Any) -> list[subprocess.Popen[Any]]:
    """``nproc`` processes of ``cmd``, ranks of one process group: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1 and a free MASTER_PORT in their environment, as ``torchrun --standalone`` sets them,
    without torchrun's own interpreter (one import of torch fewer on a 2-core machine). ``popen``: Popen's
    arguments (``stdout`` may be a list, one per rank)."""
    base = dict(os.environ if env is None else env, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    outs = popen.pop("stdout", None)
    return [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=outs[r] if isinstance(outs, list) else outs, **popen) for r in range(nproc)]


def wait_ranks(procs: list[subprocess.Popen[Any]], timeout: float) -> tuple[str, int]:
    """Wait for every rank; when one fails, or ``timeout`` seconds pass, kill the others (they would wait for it in a
    collective), as torchrun's agent does. Returns what went wrong ("" if nothing: the first rank that failed by
    itself and its exit status, or the time out) and the rank whose output says why (the failed one, else 0)."""
    deadline, failed, culprit = time.monotonic() + timeout, "", 0
    while True:
        alive = [p for p in procs if p.poll() is None]
        bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if not failed and bad:
            failed, culprit = f"rank {bad[0]} exited with {procs[bad[0]].returncode}", bad[0]
        elif not failed and alive and time.monotonic() > deadline:
            failed = f"timed out after {timeout:.0f} s"
        if not alive:
            return failed, culprit
        if failed:
            for p in alive:
                kill_tree(p.pid)
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str = "gloo", timeout: float | None = None) -> None:
    """One thread per rank, then the process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
    torch.set_num_threads(1)
    if timeout is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


def finish_and_exit() -> NoReturn:
    """Barrier, tear the group down, flush, ``os._exit(0)``.

    The barrier keeps any rank from tearing the group down while another still uses it. ``os._exit``
    because torch.distributed's C++ objects (store, Gloo threads) sometimes abort at interpreter exit
    (see pipeengine/training/cli.py).
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- measuring

def timed_steps(run_step: Callable[[], Any], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``run_step``, every one between barriers (all ranks take part)."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        run_step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def timed_run(run_step: Callable[[], Any], steps: int) -> float:
    """Seconds of ``steps`` calls of ``run_step`` one after the other, between two barriers (all ranks take part)."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        run_step()
    dist.barrier()
    return time.perf_counter() - t0


def mean_loss(out: torch.Tensor, target: Any) -> torch.Tensor:
    """The synthetic models' loss: the output's mean (targets unused)."""
    return out.float().mean()


# ---------------------------------------------------------------------------------------------- results

def append_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> None:
    """Append one JSON line per row to ``path`` (its folder is created if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_readme_block(name: str, text: str, heading: str | None = None) -> None:
    """Replace what benchmarks/README.md holds between ``<!-- name:begin -->`` and ``<!-- name:end -->``
    with ``text``; if the markers are missing, append them (under ``## heading`` if given)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = README.read_text(encoding="utf-8") if README.exists() else "# Benchmarks\n"
    if begin not in doc or end not in doc:
        doc = doc.rstrip("\n") + "\n\n" + (f"## {heading}\n\n" if heading else "") + f"{begin}\n{end}\n"
    head, rest = doc.split(begin, 1)
    README.write_text(head + begin + "\n" + text.rstrip("\n") + "\n" + end + rest.split(end, 1)[1], encoding="utf-8")


def efficiency_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of efficiency.py's sleep-mode rows (printed by it, written to the README by sweep.py)."""
    head = ("| schedule | pp | m | ideal (s) | ours (s) | ours eff. | ours eff. (measured costs) | ovh/action (ms) | "
            "torch (s) | torch eff. | ours/torch throughput |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        def f(key: str, fmt: str = "{:.3f}") -> str:
            return _or_na(r, key, fmt)
        lines.append(f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['ideal_s']:.3f} | "
                     f"{f('ours_median_s')} | {f('ours_efficiency')} | {f('ours_efficiency_vs_measured_costs')} | "
                     f"{f('ours_overhead_ms_per_action', '{:.2f}')} | {f('torch_median_s')} | "
                     f"{f('torch_efficiency')} | {f('ratio_ours_over_torch', '{:.2f}x')} |")
    fits, cpu, main = (excess_fits(rows, key) for key in ("median_s", "cpu_ms_per_step", "cpu_main_ms_per_step"))
    if fits:   # the host's cost per microbatch: the excess over the ideal, fitted as intercept + slope x m; and the CPU
        lines += ["", "| schedule | pp | engine | excess slope (ms per microbatch) | excess intercept (ms) | "
                  "host CPU per microbatch, all ranks (ms) | host CPU per step, fixed (ms) | of the CPU per "
                  "microbatch, the main threads' (ms) |", "|---" * 8 + "|"]
        lines += [f"| {name} | {pp} | {engine} | {1e3 * slope:.3f} | {1e3 * icept:.2f} | "
                  + (" | ".join(f"{v:.3f}" for v in cpu[(name, pp, engine)]) if (name, pp, engine) in cpu
                     else "n/a | n/a")
                  + (f" | {main[(name, pp, engine)][0]:.3f} |" if (name, pp, engine) in main else " | n/a |")
                  for (name, pp, engine), (slope, icept) in fits.items()]
    if any("ratio_ours_over_torch_back_to_back" in r for r in rows):   # --back-to-back
        lines += ["", "| schedule | pp | m | ours back to back (s per step) | torch | torch + training loop | "
                  "ours/torch back to back | ours/torch training back to back |", "|---" * 8 + "|"]
        lines += [f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['ours_back_to_back_s']:.4f} | "
                  f"{r['torch_back_to_back_s']:.4f} | {_or_na(r, 'torch-train_back_to_back_s', '{:.4f}')} | "
                  f"{r['ratio_ours_over_torch_back_to_back']:.2f}x | "
                  f"{_or_na(r, 'ratio_ours_over_torch_training_back_to_back', '{:.2f}x')} |"
                  for r in rows if "ratio_ours_over_torch_back_to_back" in r]
    if any("ratio_ours_over_torch_training" in r for r in rows):   # --engines ... torch-train
        lines += ["", "| schedule | pp | m | torch step() + training loop (s) | ours/torch training step |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['torch-train_median_s']:.3f} | "
                  f"{r['ratio_ours_over_torch_training']:.2f}x |" for r in rows if "torch-train_median_s" in r]
    return "\n".join(lines)


def _or_na(row: dict[str, Any], key: str, fmt: str) -> str:
    return fmt.format(row[key]) if key in row else "n/a"


def excess_fits(rows: list[dict[str, Any]], key: str = "median_s") -> dict[tuple[str, int, str], tuple[float, float]]:
    """Per (schedule, pp, engine) measured at two or more microbatch counts: the least-squares line in m of the step's
    excess over the ideal (``median_s``: measured - ideal seconds), or of another per-step figure of the engine's
    (``cpu_ms_per_step``: the step's CPU time summed over the ranks, the host's own cost apart from how long it
    waited; ``cpu_main_ms_per_step``: their main threads'), as (slope, intercept)."""
    fits = {}
    for name, pp in dict.fromkeys((r["schedule"], r["pp"]) for r in rows):
        mine = [r for r in rows if (r["schedule"], r["pp"]) == (name, pp)]
        for engine in ("ours", "torch", "torch-train"):
            k = f"{engine}_{key}"
            points = [(r["microbatches"], r[k] - (r["ideal_s"] if key == "median_s" else 0.0)) for r in mine if k in r]
            if len({m for m, _ in points}) < 2:
                continue
            fits[(name, pp, engine)] = tuple(statistics.linear_regression(*zip(*points)))
    return fits


def describe_real(r: dict[str, Any]) -> str:
    """One sentence for efficiency.py's real-mode row (printed by it, written to the README by sweep.py)."""
    return (f"Real compute (MLP {r['depth']} x {r['hidden']}, global batch {r['global_batch']}, "
            f"{r['microbatches']} microbatches): single process {r['single_s']:.3f} s/step, pp=2 "
            f"{r['pp2_s']:.3f} s/step, speedup {r['speedup']:.2f} of ideal {r['ideal_speedup']:.2f} "
            f"(ratio {r['ratio_to_ideal']:.3f}). What this machine allows: the slower half alone "
            f"{r['half_alone_s']:.3f} s, with the other half running at once {r['halves_together_s']:.3f} s "
            f"(x{r['slowdown_together']:.2f}), so a free pipeline would reach {r['machine_bound_speedup']:.2f} "
            f"({r['machine_bound_speedup'] / r['ideal_speedup']:.3f} of ideal); ours is "
            f"{r['ratio_to_machine_bound']:.3f} of that.")
