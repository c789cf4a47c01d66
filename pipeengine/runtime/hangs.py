"""What a hang leaves to read: the wait-for report (who waits on whom) and NCCL's flight recorder."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

__all__ = ["wait_for_report", "describe_line", "doing_text", "ranks_text", "enable_flight_recorder",
           "flight_recorder_into", "dump_flight_recorder"]


DUMP_PREFIX = os.path.join(tempfile.gettempdir(), "pipeengine_nccl_trace_rank_")   # until the run folder is known


def enable_flight_recorder() -> str:
    """Before an NCCL group starts: record each communicator's recent ops (torch's flight recorder), dumped on
    NCCL's own timeout and by :func:`dump_flight_recorder` on a hang this engine finds first. The user's own
    settings win. Returns the dump files' prefix (the rank follows)."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_FR_DUMP_TEMP_FILE" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", DUMP_PREFIX)
    return _dump_prefix()


def _dump_prefix() -> str:
    """Where the dumps go: torch's newer name for the setting is read first."""
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")


def flight_recorder_into(folder: str) -> str:
    """Once the run's folder is known (every rank's, the same): the dumps go there (``<folder>/nccl_trace_rank_<r>``,
    beside the run's logs, rather than each node's temporary folder), unless the user chose a place. This engine's
    dumps (:func:`dump_flight_recorder`) read it when they write; torch's own, on NCCL's timeout, where torch makes
    its writer at its first dump. Returns the prefix in force."""
    if _dump_prefix() == DUMP_PREFIX:   # ours, not the user's
        os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(os.path.abspath(folder), "nccl_trace_rank_")
    return _dump_prefix()


def dump_flight_recorder(rank: int) -> str | None:
    """Write this rank's flight-recorder buffer (NCCL groups with the recorder on); the file, else None."""
    prefix = _dump_prefix()
    if not prefix or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") in ("", "0"):
        return None
    try:
        from .device import nccl
        if not nccl():
            return None
        import torch._C._distributed_c10d as c10d
        dump = getattr(c10d, "_dump_nccl_trace")   # (private, but the flight recorder's own entry point)
        data = dump(True, True, False)   # collectives, stack traces, not only the active ones
        with open(f"{prefix}{rank}", "wb") as fh:
            fh.write(data)
        return f"{prefix}{rank}"
    except Exception:   # no NCCL build, or the recorder is off: the report says nothing about it
        return None


def doing_text(what: Any) -> str:
    """A program step (a tuple of actions) as ``F3`` or ``sendF3>1 recvB2<1``; anything else as str()."""
    return " ".join(map(str, what)) if isinstance(what, tuple) else str(what)


def ranks_text(peers: Sequence[int]) -> str:
    """``0..511, 513, 600..1023``: runs of consecutive numbers as ranges (a world-wide wait stays one line)."""
    runs: list[list[int]] = []   # [first, last] of each run
    for p in peers:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)


def describe_line(line: dict[str, Any]) -> str:
    head = f"rank {line['rank']}" + (f" ({line['context']})" if line["context"] else "")
    if line["state"] == "waits":
        return f"{head}: waits {line['secs']:.1f} s in {line['what']} for rank(s) {ranks_text(line['peers'])}"
    return f"{head}: runs {line['what']}"


def wait_for_report(lines: dict[int, dict[str, Any]], world: int, timeout: float,
                    where: dict[int, str] | None = None, recorder: str | None = None) -> str:
    """Who waits on whom: every rank's line, the ranks that said nothing (``where`` they run, if known), a
    cycle of waits if there is one, and where NCCL's flight recorder dumped (``recorder``: one rank's file)."""
    out = [f"pipeengine: wait-for report (a wait exceeded {timeout:g} s; {len(lines)} of {world} ranks answered)"]
    out += ["  " + describe_line(lines[r]) for r in sorted(lines)]
    silent = [r for r in range(world) if r not in lines]
    out += [f"  rank {r}" + (f" ({where[r]})" if where and r in where else "")
            + ": said nothing: stopped, dead or stuck outside the engine" for r in silent]
    edges = {r: [p for p in ln["peers"]] for r, ln in lines.items() if ln["state"] == "waits"}
    cycle = _cycle(edges)
    if cycle:
        out.append("  cycle: " + " -> ".join(f"rank {r}" for r in cycle + cycle[:1])
                   + " (each waits on the next: the ranks run programs that do not match)")
    culprits = silent or sorted(r for ln in lines.values() if ln["state"] == "waits"
                                for r in ln["peers"] if r in lines and lines[r]["state"] == "runs")
    if culprits:
        out.append(f"  likely culprit: rank {ranks_text(sorted(set(culprits)))}"
                   + (" (said nothing)" if silent else " (busy while others wait on it)"))
    if recorder:
        out.append(f"  NCCL flight recorder: every rank's last collectives and p2p ops in {recorder[:-1]}<rank> "
                   f"(python -m torch.distributed.flight_recorder.fr_trace reads them)")
    return "\n".join(out)


def _cycle(edges: dict[int, list[int]]) -> list[int]:
    """One cycle in the wait-for graph (ranks in order), or [] if there is none."""
    for start in sorted(edges):
        path, seen = [start], {start}
        node = start
        while True:
            nxt = next((p for p in edges.get(node, []) if p in edges), None)
            if nxt is None:
                break
            if nxt in seen:
                return path[path.index(nxt):]
            path.append(nxt)
            seen.add(nxt)
            node = nxt
    return []
