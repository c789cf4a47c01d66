"""Failing loudly: every wait is watched, a failure reaches every rank, a hang is explained once.

[Note: the fault channel]
The ranks talk about faults through the process group's own c10d store (the key-value store
every rank already shares: torchrun's, or rank 0's TCPStore), under ``pipeengine/faults/``:

- ``failed``: the first rank whose step raised writes what and where (rank, position, replica,
  step, action, the exception and its traceback) before the exception leaves the engine.
- ``wait/<rank>``: what a rank is waiting on, for how long, and on which peers; written by a rank
  whose wait timed out and, once a hang is announced (``hang``), by every other rank's watcher.
- ``report``: the assembled wait-for picture, written by the first rank that timed out.

Each rank's :class:`Watch` runs a daemon thread that polls one counter of the store twice a
second. A rank blocked in a wait cannot be woken on Gloo (its waits are not interruptible, and
aborting the group does not end them), so when another rank failed or a report was made, a
rank still blocked ``kill_after`` (2) seconds later ends its own process, as NCCL's watchdog
does (exit status ``EXPLAINED``); its peers then see closed connections and stop at once. A
rank that is not blocked raises :class:`PeerFailed` at its next wait. Rank 0 prints the
failure or the report once (pipe.sh shows only rank 0); a rank stopping over a published failure
first waits (``SHOW_LIMIT``) until it was printed (the launcher stops every rank once one exits);
a report printed by another rank is also left in ``shown-by-rank<r>.txt`` for pipe.sh. A rank
silent during a hang is stopped, dead or stuck outside the engine: the report names it the likely
culprit; a rank whose connection broke with nothing published names the ranks on its host whose
process ended. Workers of a launcher also stop when it dies (``watch_parent``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from .logs import log
from .hangs import describe_line, doing_text, dump_flight_recorder, ranks_text, wait_for_report
from .numerics import NonFiniteError
from .options import STARTUP_TIMEOUT

__all__ = ["EXPLAINED", "SHOW_LIMIT", "PeerFailed", "WaitTimeout", "Watch", "watch", "adaptive_timeout"]

EXPLAINED = 3            # exit status of a rank that stopped because of an explained fault elsewhere
PREFIX = "pipeengine/faults/"
POLL = 0.5               # seconds between the watcher's looks at the store
SHOW_LIMIT = 10.0        # seconds a rank stopping over a failure waits for rank 0 to have printed it


class WaitTimeout(RuntimeError):
    """A wait did not complete in time; the message is this rank's line, then the wait-for report."""


class PeerFailed(RuntimeError):
    """Another rank failed (or the launcher or the store went away); the message says which and why."""


def adaptive_timeout(step_times: Sequence[float]) -> float:
    """The wait limit once steps have been timed: max(60 s, 20 x the median step)."""
    if not step_times:
        return STARTUP_TIMEOUT
    ordered = sorted(step_times)
    return max(60.0, 20.0 * ordered[len(ordered) // 2])


class Watch:
    """This rank's side of the fault channel (see the module note); one per process group."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout = STARTUP_TIMEOUT
        self.context = ""                  # "position 1, replica 0, step 3", set by the engine
        self.doing: Any = ""               # what the main thread runs (a program step or a phrase), set by the engine
        self.peer_failure: str | None = None
        self.exit_status = EXPLAINED
        self.kill_after = 2.0              # seconds a blocked rank may still unblock by itself after a failure
        self._noticed = 0.0
        self._waiting: dict[str, Any] | None = None   # what the main thread is blocked on
        self._events = 0
        self._published = False
        self._store_errors = 0
        self._ppid: int | None = None
        self._group = dist.group.WORLD
        self.event_factory: Callable[[], Any] = _cuda_event   # what host_values records (a test's fake here)
        try:   # where this rank runs: a silent rank in a report can then be inspected (py-spy, gdb)
            store.set(f"{PREFIX}where/{rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        except Exception:
            pass
        self._thread = threading.Thread(target=self._run, name="pipeengine-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread

    def watch_parent(self) -> None:
        """Also stop this process when its launcher dies (its parent changes), even by ``kill -9``."""
        self._ppid = os.getppid()

    def wait(self, work: Any, what: Any, peers: Sequence[int], cuda: bool = False,
             error: type[WaitTimeout] = WaitTimeout) -> None:
        """Wait for ``work`` (a c10d Work) within ``timeout``; on a timeout, assemble the wait-for report.

        ``what`` is formatted only if it is reported (waits are on the hot path); a timeout raises
        ``error``. On CUDA (NCCL) the compute stream waits, not the host: the host blocks only where it
        reads what the device computed, and :meth:`host_values` / :meth:`poll` watch those waits.
        """
        if self.peer_failure:
            raise PeerFailed(self.peer_failure)
        if cuda:
            work.wait()
            return
        self._waiting = {"what": what, "peers": list(peers), "since": time.monotonic()}
        why = ""
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            ok, why = False, (str(exc).splitlines() or [repr(exc)])[0]
        finally:
            waited = time.monotonic() - self._waiting["since"]
            self._waiting = None
        if ok is not False:
            return
        if "timed out" not in why.lower() and waited < self.timeout:   # a closed connection: a peer is gone
            raise PeerFailed(self._failure_text(wait=2.0) or self._gone(what, why) or
                             f"rank {self.rank} ({self.context}): {doing_text(what)} with rank(s) "
                             f"{ranks_text(peers)} broke after {waited:.1f} s, and no rank reported a failure "
                             f"(killed or crashed without a trace: see its log): {why}")
        line = self._line("waits", what, peers, waited)
        raise error(f"{describe_line(line)}: no completion after {self.timeout:g} s\n{self._hang(line)}")

    def poll(self, done: Callable[[], bool], what: Any, peers: Sequence[int],
             error: type[WaitTimeout] = WaitTimeout) -> None:
        """Wait until ``done()`` (a CUDA event's or an NCCL work's completion query) without blocking the
        host: a peer's failure raises :class:`PeerFailed` within milliseconds, and ``timeout`` seconds
        without completion raise ``error`` with the wait-for report, as a Gloo wait does."""
        if done():
            return
        since = time.monotonic()
        self._waiting = {"what": what, "peers": list(peers), "since": since}
        try:
            pause = 1e-4
            while not done():
                if self.peer_failure:
                    raise PeerFailed(self.peer_failure)
                waited = time.monotonic() - since
                if waited > self.timeout:
                    line = self._line("waits", what, peers, waited)
                    raise error(f"{describe_line(line)}: no completion after {self.timeout:g} s\n{self._hang(line)}")
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        finally:
            self._waiting = None

    def host_values(self, t: Any, what: Any, peers: Sequence[int], error: type[WaitTimeout] = WaitTimeout) -> Any:
        """``t.tolist()``: on CUDA only once the device got there (polled, see :meth:`poll`), so a hang in the
        work queued before it is reported instead of blocking the host for good."""
        if t.device.type == "cuda":
            event = self.event_factory()
            event.record()
            self.poll(event.query, what, peers, error)
        return t.tolist()

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
        self.store.set(f"{PREFIX}wait/{self.rank}", json.dumps(line))

    def _hang(self, line: dict[str, Any]) -> str:
        """Publish this rank's line, collect the others' for a grace period, print the report once."""
        try:
            self._publish(line)
            self._published = True
            if self.store.compare_set(PREFIX + "hang", "", str(self.rank)) == str(self.rank).encode():
                self.store.add(PREFIX + "events", 1)
            lines = self._collect(grace=min(5.0, max(1.5, self.timeout / 2)))
            where = {r: self.store.get(f"{PREFIX}where/{r}").decode() for r in range(self.world)
                     if r not in lines and self.store.check([f"{PREFIX}where/{r}"])}
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
        deadline = time.monotonic() + grace
        lines: dict[int, dict[str, Any]] = {}
        while True:
            for r in range(self.world):
                if r not in lines and self.store.check([f"{PREFIX}wait/{r}"]):
                    lines[r] = json.loads(self.store.get(f"{PREFIX}wait/{r}"))
            if len(lines) == self.world or time.monotonic() > deadline:
                return lines
            time.sleep(0.1)

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

    # ------------------------------------------------------------------ the watcher thread

    def _run(self) -> None:
        while True:
            time.sleep(POLL)
            if not dist.is_initialized() or dist.group.WORLD is not self._group:
                return   # the process group this watch belongs to is gone
            if self._ppid is not None and os.getppid() != self._ppid:
                self._stop_process(f"rank {self.rank}: the launcher (pid {self._ppid}) died; stopping this worker")
            try:
                if self._store_errors >= 3:   # the store is gone: stop asking (each try logs a C++ warning)
                    raise RuntimeError("unreachable")
                events = self.store.add(PREFIX + "events", 0)
                self._store_errors = 0
                if events != self._events:
                    self._events = events
                    self._on_event()
            except Exception as exc:
                self._store_errors += 1
                if self._store_errors == 3 and self.peer_failure is None:
                    self.peer_failure = (f"rank {self.rank} ({self.context}): the process group's store is "
                                         f"unreachable (its host, rank 0 or the launcher, died): {exc}")
                    self._noticed = time.monotonic()
            waiting = self._waiting
            if (self.peer_failure and waiting is not None
                    and time.monotonic() - max(self._noticed, waiting["since"]) > self.kill_after):
                self._stop_process(self.peer_failure)

    def _on_event(self) -> None:
        if self.store.check([PREFIX + "hang"]) and not self._published:
            waiting = self._waiting
            if waiting is not None:
                line = self._line("waits", waiting["what"], waiting["peers"], time.monotonic() - waiting["since"])
            else:
                line = self._line("runs", self.doing or "outside the engine")
            self._publish(line)
            self._published = True
            dump_flight_recorder(self.rank)   # NCCL: what this rank's communicators last did
        failed = self.store.check([PREFIX + "failed"])
        if failed and json.loads(self.store.get(PREFIX + "failed"))["rank"] == self.rank:
            return   # this rank's own failure: its exception is on its way
        if (failed or self.store.check([PREFIX + "report"])) and self.peer_failure is None:
            self.peer_failure = self._failure_text()
            self._noticed = time.monotonic()
            if self.peer_failure and self.rank == 0:
                self.print_once(self.peer_failure)

    def _stop_process(self, text: str) -> None:
        """End this process: it is blocked in a wait that nothing else will end (see the module note)."""
        if self.rank == 0:
            self.print_once(text)
        else:
            self.wait_shown(SHOW_LIMIT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_status)


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


def _cuda_event() -> Any:
    import torch
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


_WATCHES: dict[int, Watch] = {}


def watch() -> Watch:
    """The :class:`Watch` of the current default process group (created on first use)."""
    group = dist.group.WORLD
    w = _WATCHES.get(id(group))
    if w is None or w._group is not group:
        store = dist.distributed_c10d._get_default_store()   # the group's own store (no public accessor)
        w = _WATCHES[id(group)] = Watch(store, dist.get_rank(), dist.get_world_size())
    return w
