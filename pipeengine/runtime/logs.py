"""The engine's log: ``logging.getLogger("pipeengine")``, each record carrying its rank; info to stdout, the rest to
stderr, as the message alone (what a rank's screen or log file shows).

Use it as any library's logger: ``logging.getLogger("pipeengine").setLevel(logging.WARNING)`` (or the
trainer's ``--log-level``) quiets it; a handler of your own may show ``%(rank)s``. The trainer's
progress line and summary are its screen, not log records: ``--quiet`` leaves only errors and the summary.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["log", "LEVELS", "set_level"]

LEVELS = ("debug", "info", "warning", "error")


class _Rank(logging.Filter):
    """Puts this process's rank on every record (``%(rank)s``): the process group's, else torchrun's RANK."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK", "0")
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank = str(dist.get_rank())
        except ImportError:   # pragma: no cover - torch-free tools
            pass
        record.rank = rank
        return True


class _Screen(logging.Handler):
    """Info and below to the current ``sys.stdout``, warnings and errors to ``sys.stderr`` (looked up when a record
    comes: a console under launch/pipe.sh or a test may have replaced them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:   # noqa: BLE001 - as logging.StreamHandler: a failing log never ends the run
            self.handleError(record)


log = logging.getLogger("pipeengine")
if not log.handlers:
    _screen = _Screen()
    _screen.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_screen)
    log.addFilter(_Rank())
    log.setLevel(logging.INFO)
    log.propagate = False   # one line per record, whatever the root logger does


def set_level(level: str) -> None:
    """``debug``, ``info`` (the default), ``warning`` or ``error``."""
    log.setLevel(getattr(logging, level.upper()))
