"""The fault channel: a failure, a wait-for report and what rank 0 printed, told to every rank through the process
group's own c10d store (see [Note: the fault channel] in faults.py).

[Note: hang reports at scale]
A hang report costs O(world) store requests, not O(world^2): every rank's line is one key
(``wait/<rank>``) and one count (``waits``); the first rank to time out (the winner of ``hang``)
polls the count until every rank published or a grace period passed, then checks each key once and
reads them all in one ``multi_get``; the ranks that time out after it wait for its ``report`` key
instead of collecting again (one key polled), and make their own only if none comes.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from typing import Any, Sequence

from .hangs import doing_text, dump_flight_recorder, wait_for_report
from .logs import log
from .numerics import NonFiniteError
from .options import STARTUP_TIMEOUT

__all__ = ["EXPLAINED", "PREFIX", "PeerFailed", "WaitTimeout", "FaultChannel"]

EXPLAINED = 3            # exit status of a rank that stopped because of an explained fault elsewhere
PREFIX = "pipeengine/faults/"


class WaitTimeout(RuntimeError):
    """A wait did not complete in time; the message is this rank's line, then the wait-for report."""


class PeerFailed(RuntimeError):
    """Another rank failed (or the launcher or the store went away); the message says which and why."""


class FaultChannel:
    """This rank's messages on the fault channel: its failure (:meth:`report`, :meth:`fail`), its line of a
    wait-for report (:meth:`_hang`), and what was printed once for the job (:meth:`print_once`)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout = STARTUP_TIMEOUT
        self.context = ""                  # "position 1, replica 0, step 3", set by the engine
        self.doing: Any = ""               # what the main thread runs (a program step or a phrase), set by the engine
        self.exit_status = EXPLAINED
        self._published = False

    def report(self, exc: BaseException) -> None:
        """Publish an exception leaving the engine on this rank, unless every rank raises it alike. A
        ValueError or TypeError raised by pipeengine itself (e.g. a layer that cannot take its input)
        counts as bad input."""
        if isinstance(exc, (NonFiniteError, PeerFailed, WaitTimeout)):
            return
        frames = traceback.extract_tb(exc.__traceback__)
        ours = bool(frames) and "pipeengine" in frames[-1].filename
        # an internal error (raised by the engine's own code or by torch called from it, not by the user's layers
        # or loss): its place in the engine names its cause, besides the traceback rank 0 shows
        at = next((f for f in reversed(frames) if f"{os.sep}torch{os.sep}" not in f.filename), None)
        internal = at is not None and f"pipeengine{os.sep}" in at.filename and not isinstance(exc, ValueError)
        where = f" (in {at.filename.rpartition('pipeengine' + os.sep)[2]}:{at.lineno}, {at.name})" \
            if at is not None and internal else ""
        self.fail(exc, f"error: rank {self.rank} ({self.context}) failed in {doing_text(self.doing)}{where}: "
                       f"{type(exc).__name__}: {exc}", ours and isinstance(exc, (ValueError, TypeError)))

    def fail(self, exc: BaseException, summary: str, input_error: bool = False) -> None:
        """Tell every rank that this one failed (the first failure wins); called before the exception leaves."""
        if isinstance(exc, (PeerFailed, WaitTimeout)):
            return
        record = {"rank": self.rank, "summary": summary, "input_error": input_error,
                  "traceback": "".join(traceback.format_exception(exc))}
        try:
            if self.store.compare_set(PREFIX + "failed", "", json.dumps(record)) == json.dumps(record).encode():
                self.store.add(PREFIX + "events", 1)
        except Exception:   # the store itself is gone: nothing left to tell
            pass

    def wait_shown(self, limit: float) -> bool:
        """Before this rank exits over a failure: when a failure or a wait-for report was published, wait up to
        ``limit`` seconds until it has been printed (by rank 0, the rank on screen; the launcher stops every
        rank as soon as one exits). Whether it was; False at once when nothing was published."""
        deadline = time.monotonic() + limit
        try:
            if not self.store.check([PREFIX + "failed"]) and not self.store.check([PREFIX + "report"]):
                return False
            while self.store.add(PREFIX + "printed", 0) == 0:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
            return True
        except Exception:   # the store is gone
            return False

    def mark_shown(self) -> None:
        """Rank 0 printed the failure itself (its own crash's traceback): ranks waiting in :meth:`wait_shown` go."""
        try:
            self.store.add(PREFIX + "printed", 1)
        except Exception:
            pass

    def _gone(self, what: Any, why: str) -> str | None:
        """After a connection broke and no rank reported why: the ranks on this host whose process has ended
        (killed: SIGKILL, out of memory), published as the failure so every rank names the same (the first
        rank to look sees only the dead one: the others stop after it). None if none is found here."""
        host, gone = socket.gethostname(), []
        try:
            for r in range(self.world):
                if r != self.rank and self.store.check([f"{PREFIX}where/{r}"]):
                    where = self.store.get(f"{PREFIX}where/{r}").decode()   # "pid N on host"
                    pid, _, on = where[len("pid "):].partition(" on ")
                    if on == host and not _process_alive(int(pid)):
                        gone.append(f"rank {r} ({where})")
            if not gone:
                return None
            summary = (f"error: {', '.join(gone)} ended without a word (killed: SIGKILL, out of memory?); rank "
                       f"{self.rank} ({self.context}) lost its connection in {doing_text(what)}: "
                       f"{why.split('. This is')[0]}")
            record = json.dumps({"rank": -1, "summary": summary, "input_error": False, "traceback": ""})
            if self.store.compare_set(PREFIX + "failed", "", record) == record.encode():
                self.store.add(PREFIX + "events", 1)
            return self._failure_text() or summary
        except Exception:   # the store is gone
            return None

    # ------------------------------------------------------------------ hang reports

    def _line(self, state: str, what: Any = "", peers: Sequence[int] = (), secs: float = 0.0) -> dict[str, Any]:
        return {"rank": self.rank, "context": self.context, "state": state, "what": doing_text(what),
                "peers": list(peers), "secs": round(secs, 1)}

    def _publish(self, line: dict[str, Any]) -> None:
        """This rank's line of a hang report, counted once (the collector waits for the count, not for each key)."""
        self.store.set(f"{PREFIX}wait/{self.rank}", json.dumps(line))
        if not self._published:
            self.store.add(PREFIX + "waits", 1)

    def _hang(self, line: dict[str, Any]) -> str:
        """Publish this rank's line; the first rank to time out collects the others' for a grace period and makes
        the report, the later ones take it (a rank that finds none in time makes its own); print it once.
        O(world) store requests in all, whatever the world ([Note: hang reports at scale])."""
        try:
            self._publish(line)
            self._published = True
            grace = min(5.0, max(1.5, self.timeout / 2))
            first = self.store.compare_set(PREFIX + "hang", "", str(self.rank)) == str(self.rank).encode()
            if first:
                self.store.add(PREFIX + "events", 1)
            elif (made := self._await_report(grace + 5.0)) is not None:
                self.print_once(made, only_rank0=True)
                return made
            lines = self._collect(grace)
            silent = [r for r in range(self.world) if r not in lines and self.store.check([f"{PREFIX}where/{r}"])]
            where = {r: v.decode() for r, v in zip(silent, self._read([f"{PREFIX}where/{r}" for r in silent]))}
            report = wait_for_report(lines, self.world, self.timeout, where, dump_flight_recorder(self.rank))
            if self.store.compare_set(PREFIX + "report", "", report) == report.encode():
                self.store.add(PREFIX + "events", 1)
            else:
                report = self.store.get(PREFIX + "report").decode()
        except Exception as exc:   # the store is gone (its host died): this rank's view only
            return f"(no wait-for report: the store is unreachable: {exc})"
        self.print_once(report, only_rank0=0 in lines)
        return report

    def _collect(self, grace: float) -> dict[int, dict[str, Any]]:
        """Every published line, once all ranks published or ``grace`` seconds passed (one counter polled)."""
        deadline = time.monotonic() + grace
        while self.store.add(PREFIX + "waits", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.1)
        present = [r for r in range(self.world) if self.store.check([f"{PREFIX}wait/{r}"])]
        return {r: json.loads(v) for r, v in zip(present, self._read([f"{PREFIX}wait/{r}" for r in present]))}

    def _read(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, all present (``multi_get`` would wait for a missing one), in one request."""
        return list(self.store.multi_get(keys)) if keys else []

    def _await_report(self, seconds: float) -> str | None:
        """The report the first rank to time out is making, once it is there (None after ``seconds``)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check([PREFIX + "report"]):
                return str(self.store.get(PREFIX + "report").decode())
            time.sleep(0.1)
        return None

    def print_once(self, text: str, only_rank0: bool = False) -> None:
        """Rank 0 prints (the rank whose output ``launch/pipe.sh`` shows); if rank 0 is silent, the first caller."""
        if only_rank0 and self.rank != 0:
            return
        try:
            if self.store.add(PREFIX + "printed", 1) != 1:
                return
        except Exception:
            pass
        log.error(text)
        logs = os.environ.get("PIPEENGINE_RANK_LOGS")
        if self.rank != 0 and logs:   # launch/pipe.sh shows only rank 0's output: it shows this file at the end
            try:
                with open(os.path.join(logs, f"shown-by-rank{self.rank}.txt"), "w") as fh:
                    fh.write(text + "\n")
            except OSError:
                pass

    def _failure_text(self, wait: float = 0.0) -> str | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check([PREFIX + "failed"]):
                    rec = json.loads(self.store.get(PREFIX + "failed"))
                    self.exit_status = 2 if rec["input_error"] else EXPLAINED
                    text = rec["summary"] if rec["input_error"] else f"{rec['summary']}\n{rec['traceback']}"
                    return str(text).rstrip()
                if self.store.check([PREFIX + "report"]):
                    return str(self.store.get(PREFIX + "report").decode())
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs: not gone, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
