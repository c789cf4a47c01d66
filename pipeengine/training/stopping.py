"""Stopping on request: Ctrl-C or SIGTERM ends every rank after the same step."""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["StopRequest"]


class StopRequest:
    """Ctrl-C / SIGTERM: every rank stops after the same step (agreed through the store); a second Ctrl-C aborts.

    The first rank to see a signal after finishing ``done`` steps writes ``done + 1``: no rank can
    have finished more steps than that yet (the end-of-step collectives couple the ranks within one
    step), so every rank stops after exactly that step.
    """

    KEY = "pipeengine/stop-after"

    def __init__(self, store: Any) -> None:
        self.store = store
        self.signum: int | None = None
        self._at: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():   # Python's rule for signal handlers
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        """Give the signals back to whoever had them (run() may be called from a program of the user's)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt   # a second Ctrl-C: now
        self.signum = self.signum or signum

    def after(self, done: int) -> bool:
        """Whether to stop now, ``done`` steps having been finished by this rank."""
        if self.signum is not None and self._at is None:
            self.store.compare_set(self.KEY, "", str(done + 1))
        if self._at is None and self.store.check([self.KEY]):
            self._at = int(self.store.get(self.KEY))
            self.signum = self.signum or signal.SIGTERM
        return self._at is not None and done >= self._at
