"""Stopping on request: Ctrl-C, SIGTERM or SIGHUP ends every rank after the same step."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

__all__ = ["StopRequest"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """Catches Ctrl-C, SIGTERM and SIGHUP (a closed terminal) and hands the signal to ``on_signal`` (the
    engine's ``stop_request``: the next step's sum over the pipeline tells every rank, so every rank stops after
    the same step and names the same signal). A second Ctrl-C aborts at once."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self.on_signal = on_signal
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():   # Python's rule for signal handlers
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        """Give the signals back to whoever had them (run() may be called from a program of the user's)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt   # a second Ctrl-C: now
        self.signum = self.signum or signum
        self.on_signal(self.signum)
