"""What a run tells its user: the progress line, the summary (dict, JSON file and text block)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Sequence

import torch

__all__ = ["progress_line", "summary_text", "write_json", "oversubscribed", "mean"]


def progress_line(step: int, total: int, loss: float, val: float, samples_s: float, steps_s: float,
                  width: int = 24) -> str:
    """``[####....] step 40/100  loss 2.9876  val 2.8765  3.1 steps/s  190 samples/s  ETA 0:19``."""
    done = int(width * step / total)
    eta = int((total - step) / steps_s) if steps_s > 0 else 0
    val_s = f"  val {val:.4f}" if math.isfinite(val) else ""
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}{val_s}  {steps_s:.1f} steps/s"
            f"  {samples_s:,.0f} samples/s  ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def oversubscribed(device: torch.device) -> str | None:
    """"8 processes x 1 thread on 2 cores" when this node's ranks want more cores than it has (CPU runs)."""
    if device.type != "cpu":
        return None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    return f"{procs} processes x {threads} threads on {cores} cores" if procs * threads > cores else None


def summary_text(s: dict[str, Any]) -> str:
    cfg = s["config"]
    tok = f"  tokens/s {s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else ""
    bub, parts = "n/a", "n/a"
    if s["measured_bubble"] is not None:
        bub = (f"measured {s['measured_bubble']:.3f}  simulated {s['theoretical_bubble']:.3f}  closed form "
               f"{s['closed_form_bubble']:.3f}  ({len(s['timed_steps'])} timed steps, the first "
               f"{s['warmup_steps']} left out as warm-up)")
        parts = "  ".join(f"{k} {100 * v:.0f}%" for k, v in s["step_parts"].items())
        if s["oversubscribed"]:
            parts += f"\n           ({s['oversubscribed']}: the ranks take turns, waits include CPU contention)"
    return "\n".join([
        "=" * 72,
        f"model {cfg['model']['name']}/{cfg['model']['preset']}  schedule {cfg['schedule']['name']}  pp {s['pp']} x "
        f"dp {s['dp']}  microbatches {cfg['schedule']['microbatches']} x {cfg['data']['micro_batch_size']}  steps "
        f"{cfg['optimizer']['steps']}",
        f"loss       first {s['first_loss']:.4f}  final {s['final_loss']:.4f}  validation {s['val_loss']:.4f}",
        f"throughput {s['samples_per_s']:,.1f} samples/s{tok}  (median step {s['median_step_s'] * 1000:.1f} ms)",
        f"bubble     {bub}",
        f"step time  {parts}",
        "=" * 72,
    ])


def _strict(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as strict JSON (NaN and inf become null), atomically: a reader sees the old file or the new."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + "-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(_strict(doc), fh, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
