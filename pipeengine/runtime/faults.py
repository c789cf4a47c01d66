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

Start-up (``starting``): the trainer creates its watch on the rendezvous store before the process
group exists, and until :meth:`Watch.started` (the end of set-up) each rank's watcher counts up
``alive/<rank>`` every poll and looks at the next rank's count (a ring: every rank is looked at by
one other, one store key each). A peer whose count has not moved for ``timeout`` seconds
(``--timeout``, else ``STARTUP_TIMEOUT``) is stopped or dead: the watcher makes the wait-for report
and ends its process, since its main thread may be blocked for good in the group's creation or a
set-up collective (those wait up to ``--collective-timeout``). A peer that is merely slow (a long
model load, a checkpoint read) keeps counting, so no start-up wait is cut short. The other ranks,
likely blocked in a set-up collective too, end ``kill_after`` seconds after they see the report.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import socket
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from .channel import EXPLAINED, PREFIX, FaultChannel, PeerFailed, WaitTimeout
from .hangs import describe_line, doing_text, dump_flight_recorder, ranks_text
from .options import STARTUP_TIMEOUT

__all__ = ["EXPLAINED", "SHOW_LIMIT", "PeerFailed", "WaitTimeout", "Watch", "watch", "adaptive_timeout"]

POLL = 0.5               # seconds between the watcher's looks at the store
STARTED = 1 << 40        # added to alive/<rank> when a rank's set-up is done: its start-up peer stops looking
SPIN = 50e-6             # seconds a device wait spins on the event's query before blocking (Watch.poll)
CHECK = 0.02             # seconds between a blocked device wait's looks at a peer's failure and its deadline
SHOW_LIMIT = 10.0        # seconds a rank stopping over a failure waits for rank 0 to have printed it


def adaptive_timeout(step_times: Sequence[float]) -> float:
    """The wait limit once steps have been timed: max(60 s, 20 x the median step)."""
    if not step_times:
        return STARTUP_TIMEOUT
    ordered = sorted(step_times)
    return max(60.0, 20.0 * ordered[len(ordered) // 2])


class Watch(FaultChannel):
    """This rank's side of the fault channel (see the module note; its messages: channel.py) and the waits it
    watches; one per process group."""

    def __init__(self, store: Any, rank: int, world: int, starting: str = "") -> None:
        """``starting``: what start-up does first (the trainer, before the process group exists): until
        :meth:`started`, a silent peer is reported (see the module note)."""
        super().__init__(store, rank, world)
        self.doing = starting
        self.peer_failure: str | None = None
        self.kill_after = 2.0              # seconds a blocked rank may still unblock by itself after a failure
        self._noticed = 0.0
        self._waiting: dict[str, Any] | None = None   # what the main thread is blocked on
        self._events = 0
        self._store_errors = 0
        self._ppid: int | None = None
        self._group = _ref(dist.group.WORLD)   # None before the process group exists (``starting``): see adopt()
        self._stop = threading.Event()     # close()
        self._starting = bool(starting) and world > 1
        self._peer = (rank + 1) % world                  # the rank this one looks at in start-up
        self._peer_seen = (0, time.monotonic())          # its alive count, and since when
        self.event_factory: Callable[[], Any] = _cuda_event   # what host_values records (a test's fake here)
        self.device_reads = 0                            # host reads of device values (host_values, poll)
        self._waiter_thread: _Waiter | None = None       # blocks on a device event for poll (made on first use)
        try:   # where this rank runs: a silent rank in a report can then be inspected (py-spy, gdb)
            store.set(f"{PREFIX}where/{rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        except Exception:
            pass
        self._thread = threading.Thread(target=self._run, name="pipeengine-watch", daemon=True)
        self._thread.start()
        _ALL.add(self)

    # ------------------------------------------------------------------ main thread

    def close(self) -> None:
        """Stop the watcher thread and wait for it (it ends by itself within ``POLL`` once the group is destroyed).
        At interpreter exit a thread still inside a store call aborts the process: Python 3.11 ends it with
        ``pthread_exit`` as it takes the GIL back, which unwinds a C++ frame that may not throw ("terminate called
        without an active exception"). Later calls do nothing; PipelineEngine.close and an atexit hook call it."""
        self._stop.set()
        if self._waiter_thread is not None:
            self._waiter_thread.stop()
            self._waiter_thread = None
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)   # a store call returns at once, or fails once the store is gone

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def adopt(self) -> None:
        """The process group now exists: this watch (made before it) is its watch (:func:`watch`)."""
        self._group = _ref(dist.group.WORLD)
        _WATCHES[id(dist.group.WORLD)] = self

    def started(self) -> None:
        """Set-up is done: silent peers are the engine's waits' business from here on (see the module note)."""
        if self._starting:
            self._starting = False
            try:
                self.store.add(f"{PREFIX}alive/{self.rank}", STARTED)
            except Exception:
                pass
        self.doing = ""

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

    def poll(self, event: Any, what: Any, peers: Sequence[int], error: type[WaitTimeout] = WaitTimeout) -> None:
        """Wait until ``event`` (a CUDA event: ``query()`` and a blocking ``synchronize()``) has happened, without
        blocking the host for good: a peer's failure raises :class:`PeerFailed` within ``CHECK`` seconds, and
        ``timeout`` seconds without completion raise ``error`` with the wait-for report, as a Gloo wait does.

        It never sleeps on a guess: it spins for ``SPIN`` seconds (most device reads at the end of a step are
        a few microseconds away), then hands ``synchronize()`` to this watch's waiter thread and blocks on its
        completion, which wakes it as soon as the device got there (``benchmarks.lateness`` measures it)."""
        self.device_reads += 1
        if event.query():
            return
        since = time.monotonic()
        while time.monotonic() - since < SPIN:
            if event.query():
                return
        self._waiting = {"what": what, "peers": list(peers), "since": since}
        try:
            done = self._waiter().submit(event.synchronize)
            while True:
                try:
                    done.result(timeout=CHECK)   # (the device's own error, if synchronize raised one)
                    return
                except FutureTimeout:
                    pass
                if self.peer_failure:
                    raise PeerFailed(self.peer_failure)
                waited = time.monotonic() - since
                if waited > self.timeout:
                    line = self._line("waits", what, peers, waited)
                    raise error(f"{describe_line(line)}: no completion after {self.timeout:g} s\n{self._hang(line)}")
        finally:
            self._waiting = None

    def host_values(self, t: Any, what: Any, peers: Sequence[int], error: type[WaitTimeout] = WaitTimeout) -> Any:
        """``t.tolist()``: on CUDA only once the device got there (see :meth:`poll`), so a hang in the work queued
        before it is reported instead of blocking the host for good. The runtime's only way to read what the
        device computed: ``device_reads`` counts them (a step makes a fixed number, whatever its size)."""
        if t.device.type == "cuda":
            event = self.event_factory()
            event.record()
            self.poll(event, what, peers, error)
        else:
            self.device_reads += 1
        return t.tolist()

    def _waiter(self) -> _Waiter:
        if self._waiter_thread is None:
            self._waiter_thread = _Waiter()
        return self._waiter_thread

    # ------------------------------------------------------------------ the watcher thread

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            if self._group is None and not self._starting:
                return   # no process group, and not the trainer's start-up
            if self._group is not None and (not dist.is_initialized() or dist.group.WORLD is not self._group()):
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
                if self._starting and self.peer_failure is None:
                    self._look_at_peer()
            except Exception as exc:
                self._store_errors += 1
                if self._store_errors == 3 and self.peer_failure is None:
                    self.peer_failure = (f"rank {self.rank} ({self.context}): the process group's store is "
                                         f"unreachable (its host, rank 0 or the launcher, died): {exc}")
                    self._noticed = time.monotonic()
            waiting = self._waiting
            if (self.peer_failure and (waiting is not None or self._starting)
                    and time.monotonic() - max(self._noticed, waiting["since"] if waiting else 0.0) > self.kill_after):
                self._stop_process(self.peer_failure)   # in start-up: blocked in a set-up collective, or soon will be

    def _look_at_peer(self) -> None:
        """Start-up: count this rank alive; report the next rank if its count has not moved for ``timeout``."""
        self.store.add(f"{PREFIX}alive/{self.rank}", 1)
        count = self.store.add(f"{PREFIX}alive/{self._peer}", 0)
        now = time.monotonic()
        if count >= STARTED:
            return   # its set-up is done
        if count != self._peer_seen[0]:
            self._peer_seen = (count, now)
        elif now - self._peer_seen[1] > self.timeout and not self._published:
            line = self._line("waits", self.doing or "start-up", [self._peer], now - self._peer_seen[1])
            self._stop_process(self._hang(line))

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


class _Waiter:
    """A daemon thread that runs blocking device waits (``event.synchronize``) one after another, so the main thread
    blocks on a future it can leave on a deadline or a peer's failure. A device that never gets there keeps
    this thread for good; the main thread reports the hang and the process ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pipeengine-device-wait", daemon=True).start()

    def submit(self, block: Callable[[], Any]) -> Future[Any]:
        """``block()`` run on this thread (a daemon: unlike an executor's, it never holds up the interpreter's exit
        when a device never got there)."""
        done: Future[Any] = Future()
        self._jobs.put((block, done))
        return done

    def stop(self) -> None:
        """End the thread once the waits given to it are done (Watch.close)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            block, done = job
            try:
                done.set_result(block())
            except BaseException as exc:
                done.set_exception(exc)


def _cuda_event() -> Any:
    import torch
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


_WATCHES: dict[int, Watch] = {}
_ALL: weakref.WeakSet[Watch] = weakref.WeakSet()


def _ref(group: Any) -> Any:
    """A weak reference to ``group`` (None for None): a watch must not keep a destroyed process group, and its
    Gloo threads, alive until the interpreter finalizes (see PipelineEngine.close)."""
    return None if group is None else weakref.ref(group)


@atexit.register
def _close_all() -> None:
    """Before the interpreter finalizes (atexit hooks run first): no watcher thread is inside a store call then."""
    for w in list(_ALL):
        w.close()


def watch() -> Watch:
    """The :class:`Watch` of the current default process group (created on first use)."""
    group = dist.group.WORLD
    w = _WATCHES.get(id(group))
    if w is None or w.closed or w._group is None or w._group() is not group:
        store = dist.distributed_c10d._get_default_store()   # the group's own store (no public accessor)
        w = _WATCHES[id(group)] = Watch(store, dist.get_rank(), dist.get_world_size())
    return w
