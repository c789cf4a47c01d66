"""What a run tells its user: the progress line, the summary (dict, JSON file and text block)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Mapping, Sequence

import torch

from .batch import Batch
from .resources import memory_text

__all__ = ["progress_line", "summary_text", "write_json", "oversubscribed", "mean", "world_change_text"]


def progress_line(step: int, total: int, loss: float, val: float, rates: Mapping[str, float | None], memory: str,
                  width: int = 24) -> str:
    """``[####....] step 40/100  loss 2.9876  val 2.8765  3.1 steps/s  99 samples/s  6,336 tokens/s  412 MiB RSS
    ETA 0:00:19``: the rates are :meth:`Reporter.rates` (one wall time), the ETA follows from steps/s."""
    done = int(width * step / total)
    steps_s = rates["steps_per_s"] or 0.0
    eta = int((total - step) / steps_s) if steps_s > 0 else 0
    val_s = f"  val {val:.4f}" if math.isfinite(val) else ""
    tokens = f"  {rates['tokens_per_s']:,.0f} tokens/s" if rates.get("tokens_per_s") else ""
    if rates.get("padding_fraction") is not None:
        tokens += f" (padding {100 * (rates['padding_fraction'] or 0):.1f}%)"
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}{val_s}  {steps_s:.2f} "
            f"steps/s  {rates['samples_per_s'] or 0:,.1f} samples/s{tokens}  {memory}  "
            f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")


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


def _memory_beside(mem: dict[str, float], predicted: float | None) -> str:
    """``726 MiB RSS (215 MiB above the baseline, predicted 230 MiB)``: the measured peak and the twin's."""
    text = memory_text(mem)
    above = mem.get("above_baseline")
    parts = ([f"{above:,.0f} MiB above the baseline"] if above is not None else []) + (
        [f"predicted {predicted:,.0f} MiB"] if predicted is not None else [])
    return f"{text} ({', '.join(parts)})" if parts else text


def _si(x: float) -> str:
    """``1.38 G`` for 1.38e9."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.3g} "


def _compute_text(s: dict[str, Any]) -> str:
    if not s.get("flops_per_sample"):
        return "n/a (the model's FLOPs could not be counted on the meta device)"
    what = "3 x forward" if s.get("padding_fraction") is None else "3 x its real tokens' forward, a mean"
    text = f"{s['tflops_per_rank']:.3g} model TFLOP/s per rank ({_si(s['flops_per_sample'])}FLOP per sample = {what})"
    if s.get("mfu") is not None:
        return text + f"  MFU {100 * s['mfu']:.1f}% of {s['peak_tflops']:g}"
    return text + "  MFU n/a: no known peak (--peak-tflops)"


def world_change_text(c: dict[str, Any]) -> str:
    """What a group restarted at another size became (resume.py's world change)."""
    return (f"{c['from']} -> {c['to']} processes at step {c['step']}: re-planned as pp {c['pp']} x dp {c['dp']}, "
            f"up to {c['microbatches']} microbatches per replica (the same global batch), from the step {c['step']} "
            f"checkpoint")


def summary_text(s: dict[str, Any]) -> str:
    """The block printed at the end of a run (``s``: the Trainer's summary)."""
    cfg = s["config"]
    tok = f"  {s['tokens_per_s']:,.0f} tokens/s" if s["tokens_per_s"] else ""
    if s.get("padding_fraction") is not None:
        tok += f" (real tokens; padding {100 * s['padding_fraction']:.1f}% of the positions)"
    bub, parts = "n/a", "n/a"
    if s["measured_bubble"] is not None:
        bub = (f"measured {s['measured_bubble']:.3f}  simulated {s['theoretical_bubble']:.3f}  closed form "
               f"{s['closed_form_bubble']:.3f}  ({len(s['timed_steps'])} timed steps, the first "
               f"{s['warmup_steps']} left out as warm-up)")
        parts = f"{1000 * (s['wall_s_per_step'] or 0):.1f} ms per step: " + "  ".join(
            f"{k} {100 * v:.0f}%" for k, v in s["step_parts"].items())
        parts += ("\n           (compute to sync: the pipeline step, mean over positions; other: evaluation, saves, "
                  "logging)")
        if s["oversubscribed"]:
            parts += f"\n           ({s['oversubscribed']}: the ranks take turns, waits include CPU contention)"
    memory = "  ".join(f"{p}: {_memory_beside(m, s['predicted_peak_memory_mib'].get(p))}"
                       for p, m in s["peak_memory_mib"].items()) or "n/a"
    predicted, median = s.get("predicted_step_s"), s["median_step_s"]
    predicted = (f", predicted {1e3 * predicted:.1f} ms ({100 * (predicted / median - 1):+.0f}%)"
                 if predicted and median == median else "")   # (NaN: no step timed)
    g = s["global_batch"]
    name, ran = cfg["schedule"]["name"], s.get("schedule_run", cfg["schedule"]["name"])
    model = cfg["model"]["name"] + (f"/{cfg['model']['preset']}" if cfg["model"]["preset"] else "")
    return "\n".join([
        "=" * 72,
        f"model {model}  schedule {name if ran == name else f'{name} ({ran})'}"
        f"  pp {s['pp']} x "
        f"dp {s['dp']}{'  zero 1' if cfg['parallel'].get('zero') and s['dp'] > 1 else ''}  "
        f"{Batch(g, cfg['schedule']['microbatches'], cfg['data']['micro_batch_size']).describe(s['dp'])}  "
        f"steps {cfg['optimizer']['steps']}",
        f"loss       first {s['first_loss']:.4f}  final {s['final_loss']:.4f}  validation "
        + ("n/a (no validation data)" if s["val_loss"] is None else f"{s['val_loss']:.4f}"),
        f"throughput {s['steps_per_s']:.2f} steps/s  {s['samples_per_s']:,.1f} samples/s{tok}  (wall time of the "
        f"steps after warm-up,\n           data, evaluation, saves and logging included; median pipeline step "
        f"{s['median_step_s'] * 1000:.1f} ms{predicted})",
        f"compute    {_compute_text(s)}",
        f"wall time  {s['elapsed_s']:.1f} s since the process started: start-up {s['startup_s'] or 0:.1f} s, "
        f"{len(s['losses'])} steps {s['steps_s']:.1f} s, final evaluation and summary "
        f"{max(0.0, s['elapsed_s'] - (s['startup_s'] or 0) - s['steps_s']):.1f} s",
        f"memory     peak per position (the whole process; above its baseline before the model was built, beside the "
        f"twin's prediction)\n           {memory}",
        f"bubble     {bub}",
        f"step time  {parts}",
        *([f"world      {world_change_text(s['world_change'])}"] if s.get("world_change") else []),
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


def _umask() -> int:
    """The process's umask, read without changing it (other threads may be creating files)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as strict JSON (NaN and inf become null), atomically: a reader sees the old file or the new."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + "-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())   # as open() would make it (mkstemp makes it private)
        with os.fdopen(fd, "w") as fh:
            json.dump(_strict(doc), fh, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
