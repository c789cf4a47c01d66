"""Output under launch/pipe.sh: rank 0's progress straight to the terminal, every rank's log files linked
from the run folder. No torch here: ``--help`` stays quick."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

__all__ = ["use_console", "link_rank_logs"]


class _Console:
    """stdout for the rank launch/pipe.sh shows on a terminal. Everything goes to the terminal; the rank's log
    file gets the rest as lines, and of the in-place progress updates (writes starting with a carriage
    return) one every ``every`` seconds and the last before other output."""

    def __init__(self, terminal: TextIO, log: TextIO, every: float = 10.0) -> None:
        self.terminal, self.log, self.every = terminal, log, every
        self.update, self.in_update, self.logged_at = "", False, time.monotonic()

    def write(self, text: str) -> int:
        self.terminal.write(text)
        if not text:
            return 0
        if text.startswith("\r"):
            self.update, self.in_update = text.strip("\r").replace("\033[K", ""), True
            if time.monotonic() - self.logged_at >= self.every:
                self._log_update()
            return len(text)
        if self.update:
            self._log_update()
        if self.in_update:   # the line's end after the updates: the logged update lines have their own
            self.in_update, text = False, text[1:] if text.startswith("\n") else text
        self.log.write(text)
        return len(text)

    def _log_update(self) -> None:
        self.log.write(self.update + "\n")
        self.update, self.logged_at = "", time.monotonic()

    def flush(self) -> None:
        self.terminal.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)


def link_rank_logs(run_dir: str) -> None:
    """Under launch/pipe.sh: link every rank's log files (torchrun --log-dir) from the run folder as ``ranks/``."""
    logs = os.environ.get("PIPEENGINE_RANK_LOGS")
    link = os.path.join(run_dir, "ranks")
    if logs and not os.path.lexists(link):
        try:
            os.makedirs(run_dir, exist_ok=True)
            os.symlink(logs, link)
        except OSError:
            pass   # a folder that takes no links: the files are still where pipe.sh said


def use_console() -> None:
    """Under launch/pipe.sh on a terminal, in the local rank it shows: write stdout straight to that terminal
    (no launcher prefix, progress updated in place); the rank's log file still gets all but the updates."""
    console = os.environ.get("PIPEENGINE_CONSOLE")
    if not console or os.environ.get("LOCAL_RANK") != os.environ.get("PIPEENGINE_CONSOLE_RANK", "0"):
        return
    try:
        terminal = open(console, "w", buffering=1)
    except OSError:
        return
    if not terminal.isatty():
        terminal.close()
        return
    sys.stdout = _Console(terminal, sys.stdout)
