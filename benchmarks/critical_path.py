"""Where a pipeline step's time goes, engine against engine: its start, the fill's hops, the cooldown's, its end.

``python -m benchmarks.efficiency --critical-path ...`` (sleep stages, gpipe or 1f1b: one stage per rank, rank =
position) has every sleep stage stamp its parts in each engine's timed steps (sleep_stages.RECORD;
``time.perf_counter``: CLOCK_MONOTONIC, one clock for the processes of a host). Per step,
with t0 the earliest rank's call of its step:

- start: t0 to position 0's first forward;
- fill hops: position k's first forward ends -> position k + 1's first forward starts (k = 0, 1, ...);
- cooldown hops: position k + 1's last backward ends -> position k's last backward starts;
- end: the last compute anywhere ends -> the last rank returns from its step (ours: the gradient norm's sum, the
  decision, the optimizer step; torch's ``step()``: none of them; torch-train: what a training loop adds);
- rest: the step less all of those (the computes, and the steady state's waits).

The parts of a step add up to it; the table gives each part's median over the steps (so its rows add up only
about). A hop cannot be negative: a receiver starts after its sender's part ended.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import benchmarks.sleep_stages as sleep_stages

__all__ = ["RankStep", "stamped", "decompose", "summarise", "critical_path_table"]

Stamp = tuple[str, float, float]     # (F | B | W, start, end) of one sleep-stage part
RankStep = tuple[float, float, Sequence[Stamp]]   # one rank's step: its call, its return, its parts' stamps


def stamped(step: Callable[[], Any], into: list[RankStep]) -> Callable[[], None]:
    """``step``, its call, return and sleep-stage stamps appended to ``into`` (to time between barriers as usual)."""
    def run() -> None:
        sleep_stages.RECORD = []
        t0 = time.perf_counter()
        try:
            step()
            into.append((t0, time.perf_counter(), sleep_stages.RECORD))
        finally:
            sleep_stages.RECORD = None
    return run


def decompose(ranks: Sequence[RankStep], microbatches: int) -> dict[str, Any]:
    """One step's parts in seconds (see the module docstring) from every rank's step, in position order, of a
    schedule whose backward is whole (gpipe, 1f1b: the caller's to know, a split one's stamps count alike): a rank's
    last backward is its last ``1/microbatches`` of B and W stamps (the first position has no input gradient, so W
    only)."""
    t0, end = min(r[0] for r in ranks), max(r[1] for r in ranks)
    firsts, lasts = [], []
    for _, _, stamps in ranks:
        forwards = sorted((s for s in stamps if s[0] == "F"), key=lambda s: s[1])
        backwards = sorted((s for s in stamps if s[0] in "BW"), key=lambda s: s[1])
        if not forwards or not backwards or len(backwards) % microbatches:
            raise ValueError(f"a rank stamped {len(forwards)} forwards and {len(backwards)} backward parts: not a "
                             f"whole number per microbatch ({microbatches}), as a whole backward per microbatch gives")
        last = backwards[-(len(backwards) // microbatches):]
        firsts.append(forwards[0])
        lasts.append((min(s[1] for s in last), max(s[2] for s in last)))
    fill = [firsts[k + 1][1] - firsts[k][2] for k in range(len(ranks) - 1)]
    cooldown = [lasts[k][0] - lasts[k + 1][1] for k in range(len(ranks) - 1)]
    start = firsts[0][1] - t0
    tail = end - max(s[2] for _, _, stamps in ranks for s in stamps)
    step = end - t0
    return {"step": step, "start": start, "fill": fill, "cooldown": cooldown, "end": tail,
            "rest": step - start - sum(fill) - sum(cooldown) - tail}


def summarise(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each part's median over the steps (hops: per hop), in milliseconds."""
    def med(values: Sequence[float]) -> float:
        return round(statistics.median(values) * 1e3, 3)
    out: dict[str, Any] = {k: med([p[k] for p in parts]) for k in ("step", "start", "end", "rest")}
    for k in ("fill", "cooldown"):
        out[k] = [med([p[k][i] for p in parts]) for i in range(len(parts[0][k]))]
    return out


def critical_path_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per configuration and engine, the median parts (ms), and ours less torch's."""
    lines = ["| schedule | pp | m | engine | start | fill hops | cooldown hops | end of step | rest | step |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cells(p: dict[str, Any]) -> str:
        return (f"{p['start']:.2f} | {' / '.join(f'{h:.2f}' for h in p['fill'])} | "
                f"{' / '.join(f'{h:.2f}' for h in p['cooldown'])} | {p['end']:.2f} | {p['rest']:.2f} | "
                f"{p['step']:.2f} |")
    for r in rows:
        paths = r.get("critical_path_ms", {})
        head = f"| {r['schedule']} | {r['pp']} | {r['microbatches']} |"
        lines += [f"{head} {engine} | {cells(p)}" for engine, p in paths.items()]
        if "ours" in paths and "torch" in paths:
            ours, torch_ = paths["ours"], paths["torch"]
            diff = {k: ours[k] - torch_[k] for k in ("start", "end", "rest", "step")}
            diff.update({k: [a - b for a, b in zip(ours[k], torch_[k])] for k in ("fill", "cooldown")})
            lines.append(f"{head} ours - torch | {cells(diff)}")
    return "\n".join(lines)
