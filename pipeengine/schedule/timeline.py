"""The simulated timeline as text: one row per position, each compute action a box as wide as its duration."""

from __future__ import annotations

from .simulate import SimResult

__all__ = ["render_timeline"]


def render_timeline(result: SimResult, max_width: int = 200) -> str:
    """ASCII timeline: one row per position, each compute action a box as wide as its duration."""
    spans = [e - s for row in result.intervals for s, e, st in row if st[0].kind.is_compute and e > s]
    if not spans or result.makespan <= 0:
        return "(empty schedule)"
    labels = [str(st[0]) for row in result.intervals for _, _, st in row if st[0].kind.is_compute]
    cell = max(len(x) for x in labels) + 1
    scale = cell / min(spans)
    if result.makespan * scale > max_width:
        scale = max_width / result.makespan
    width = int(round(result.makespan * scale))
    lines = []
    for p, row in enumerate(result.intervals):
        line = ["."] * width
        for s, e, st in row:
            a = st[0]
            if not a.kind.is_compute or e <= s:
                continue
            lo, hi = int(round(s * scale)), max(int(round(e * scale)), int(round(s * scale)) + 1)
            text = str(a) if hi - lo > len(str(a)) else a.kind.value
            box = (text + " " * (hi - lo))[: hi - lo]
            line[lo:hi] = list(box)
        lines.append(f"position {p:<2}|" + "".join(line) + "|")
    return "\n".join(lines)
