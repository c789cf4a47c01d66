"""The tables benchmarks/memory.py prints and writes into benchmarks/README.md, from its per-rank records."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.memory_worker import MIB


def _per_rank(recs: list[dict[str, Any]], key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(r[key] / scale) for r in sorted(recs, key=lambda r: r["rank"]))


def _max(recs: Any, key: str) -> float | None:
    return max(r[key] for r in recs) if isinstance(recs, list) else None


def table_head(*columns: str) -> list[str]:
    """A Markdown table's header and rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def matrix_table(rows: list[dict[str, Any]]) -> str:
    lines = table_head("schedule", "pp", "m", "ours growth MiB (A) per rank", "torch growth MiB (A) per rank",
                       "ours/torch growth", "ours held MiB", "torch held MiB", "ours/torch peak")
    for r in rows:
        a = r["act_mib"]
        cells = []
        for e in ("ours", "torch"):
            v = r["results"].get(e)
            cells.append(f"{_per_rank(v, 'growth_mib')} ({_per_rank(v, 'growth_mib', a, '{:.1f}')})"
                         if isinstance(v, list) else f"n/a ({v})")
        ratios = []
        for key in ("growth_mib", "peak"):
            o, t = (_max(r["results"].get(e), key) for e in ("ours", "torch"))
            ratios.append(f"{o / t:.2f}" if o is not None and t else "n/a")
        held = [_per_rank(r["results"][e], "held_mib") if isinstance(r["results"].get(e), list) else "n/a"
                for e in ("ours", "torch")]
        lines.append(f"| {r['schedule']} | {r['pp']} | {r['m']} | {cells[0]} | {cells[1]} | {ratios[0]} | "
                     f"{held[0]} | {held[1]} | {ratios[1]} |")
    return "\n".join(lines)


def extra_table(rows: list[dict[str, Any]]) -> str:
    lines = table_head("model", "variant", "schedule", "pp", "m", "growth MiB (A) per rank", "held MiB per rank",
                       "peak MiB per rank", "step (s)")
    for r in rows:
        for v, recs in r["results"].items():
            head = f"| {r['model']} | {v} | {r['schedule']} | {r['pp']} | {r['m']} |"
            if not isinstance(recs, list):
                lines.append(f"{head} n/a ({recs}) | | | |")
                continue
            a = r["act_mib"]
            lines.append(f"{head} {_per_rank(recs, 'growth_mib')} ({_per_rank(recs, 'growth_mib', a, '{:.1f}')}) | "
                         f"{_per_rank(recs, 'held_mib')} | {_per_rank(recs, 'peak')} | "
                         f"{statistics.median(x['step_s'] for x in recs):.3f} |")
    return "\n".join(lines)


def gpt_table(rows: list[dict[str, Any]]) -> str:
    lines = table_head("layers given as", "rank", "params on rank (M)", "growth by end of build MiB", "peak growth MiB",
                       "peak growth / full model's 16 B/param", "rank's own share of it",
                       "peak growth / full params + AdamW state (12 B/param)", "step (s)")
    for r in rows:
        full = r["full_state_bytes"]
        if not isinstance(r["results"], list):
            lines.append(f"| {r['variant']} | n/a ({r['results']}) | | | | | | | |")
            continue
        for x in sorted(r["results"], key=lambda x: x["rank"]):
            lines.append(f"| {r['variant']} | {x['rank']} | {x['local_params'] / 1e6:.1f} | "
                         f"{x['build_peak_mib'] - x['start_mib']:.0f} | {x['growth_mib']:.0f} | "
                         f"{x['growth_mib'] * MIB / full:.2f} | {x['local_params'] * 16 / full:.2f} | "
                         f"{x['growth_mib'] * MIB / (full * 12 / 16):.2f} | {statistics.median(x['step_s']):.2f} |")
    return "\n".join(lines)
