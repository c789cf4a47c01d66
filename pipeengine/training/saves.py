"""A run's checkpoints: every ``--save-interval`` steps (in the background with ``--async-save``), on a stop within
the exit budget, each made visible once every rank wrote it."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.logs import log
from .checkpoint import AsyncSaver, save
from .config import Config

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine

__all__ = ["Saves"]


class Saves:
    """The saves of one run (collective: every rank calls them at the same points; rank 0 says what happened).

    ``extra(step)``: the manifest fields the run adds (its model, config, data position)."""

    def __init__(self, cfg: Config, engine: PipelineEngine, rank: int, extra: Callable[[int], dict[str, Any]]) -> None:
        self.cfg, self.engine, self.rank, self.extra = cfg, engine, rank, extra
        self.last_s: float | None = None   # how long the last save made the step wait
        saving = cfg.saving
        self.saver = (AsyncSaver(cfg.faults.collective_timeout)
                      if saving.background and (saving.interval or saving.on_exit) else None)

    def save(self, step: int, newline: bool = False) -> None:
        """A checkpoint of the state after ``step`` steps (in the background with --async-save)."""
        cfg = self.cfg
        t_save = time.perf_counter()
        keep = cfg.saving.keep or None
        if self.saver is None:
            saved = save(self.engine, cfg.saving.dir, step, keep=keep, extra=self.extra(step))
        else:
            self.publish(newline)   # the previous background save, made visible
            saved = self.saver.save(self.engine, cfg.saving.dir, step, keep=keep, extra=self.extra(step))
        self.last_s = time.perf_counter() - t_save
        if self.rank == 0:
            how = "the step waited" if self.saver else "saved"
            log.info(f"{chr(10) if newline else ''}{saved}: {how} {self.last_s:.2f} s")

    def on_exit(self, step: int, signum: int) -> None:
        """The save on a stop request; on SIGTERM bounded by --exit-save-budget (torchrun's SIGKILL follows)."""
        budget = self.cfg.saving.exit_budget
        if signum == signal.SIGTERM and self.last_s is not None and self.last_s > budget:
            if self.rank == 0:
                log.warning(f"exit save skipped: the last save took {self.last_s:.1f} s, more than the {budget:g} s "
                            f"allowed after SIGTERM (--exit-save-budget); the newest checkpoint stands")
            return
        self.save(step)
        if self.rank == 0 and signum == signal.SIGTERM:
            log.warning(f"exit save: {self.last_s:.1f} s of the {budget:g} s allowed after SIGTERM")

    def publish(self, newline: bool = False, wait: bool = True) -> None:
        """Make a finished background save visible (``wait``: wait for the one in flight first)."""
        if self.saver is None:
            return
        published = self.saver.finish() if wait else self.saver.poll()
        if published and self.rank == 0:
            log.info(f"{chr(10) if newline else ''}saved {published} (in the background)")
