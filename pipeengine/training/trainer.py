"""The Trainer: one training run of a :class:`~pipeengine.training.config.Config` from set-up to summary.

``python -m pipeengine.train`` (cli.py) builds the config and calls :func:`run`; a program of the
user's may do the same. Every rank runs the same Trainer; rank 0 prints and writes the logs.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.agree import decided_by_rank0, gathered, on_every_rank, same_settings
from ..runtime.engine import StepResult
from ..runtime.faults import EXPLAINED, PeerFailed, WaitTimeout, watch
from ..runtime.hangs import flight_recorder_into
from ..runtime.layers import sizing_layers
from ..runtime.logs import log, set_level
from ..runtime.numerics import NonFiniteError
from ..runtime.topology import Topology
from ..schedule.builders import schedule_bubble
from .checkpoint import CheckpointError
from .checks import writable_folder
from .config import Config, to_toml
from .console import link_rank_logs
from .feed import Feed
from .distributed import init_distributed
from .elastic import ModelState, replan_pp
from .install import install_problem
from .models import Model, load_model
from .report import oversubscribed, progress_line, summary_text, write_json
from .prediction import build_engine, dry_run, resident_bytes, run_twin
from .reporter import Reporter
from .resources import (flops_per_example, flops_per_length, memory_text, peak_tflops, process_age, rank_memory,
                        set_baseline, slow_bf16_hint)
from .resume import pick_checkpoint, resume
from .saves import Saves
from .savedir import check_shared
from .stopping import StopRequest
from .tensorboard import MetricsWriter

__all__ = ["Trainer", "run"]


@dataclass
class RunState:
    """Where the run stands: every step's loss, the last validation loss, the status."""

    start: int
    losses: list[float] = field(default_factory=list)
    val_loss: float = math.nan
    status: str = "running"

    @property
    def done(self) -> int:
        """Steps finished so far (resumed ones included)."""
        return self.start + len(self.losses)


class Trainer:
    """One training run (see the module docstring). ``run()`` does it all; the parts are public for programs
    that drive the loop themselves: ``setup()``, ``train_step(step)``, ``evaluate(step)``, ``saves.save(step)``,
    ``summary()``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        set_level(cfg.logging.level)
        self.device, self.owned = init_distributed(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.baseline = resident_bytes()
        set_baseline(self.baseline)   # before the model: measured memory is comparable with the twin's

    # ------------------------------------------------------------------ set-up

    def _run_dir(self) -> str:
        """The run's folder: rank 0's name on every rank (one clock); NCCL's flight-recorder dumps go there too."""
        cfg = self.cfg
        label = cfg.model.name.rpartition(":")[2]   # a function's name for package.module:function
        run_dir = decided_by_rank0(lambda: os.path.join(cfg.logging.dir, cfg.logging.run_name or (
            f"{label}-{cfg.schedule.name}-pp{self.topo.pp}dp{self.topo.dp}-{time.strftime('%Y%m%d-%H%M%S')}")))
        flight_recorder_into(run_dir)
        return run_dir

    def setup(self) -> None:
        """Everything before the first step; a bad input raises ValueError on every rank alike."""
        cfg = self.cfg

        def load() -> Model:
            problem = install_problem()
            if problem:
                raise ValueError(problem)
            torch.manual_seed(cfg.model.seed)   # a model whose data is drawn at random draws it alike on every rank
            m = cfg.model
            model = load_model(m.name, m.preset, cfg.data.path, m.dropout, m.context, m.packing)
            if model.data is None:
                raise ValueError(f"--model {cfg.model.name!r} gives no data (Model.data is None): the trainer needs "
                                 f"a Dataset or examples by index; see README: your own model")
            return model

        def check() -> Topology:
            topo = cfg.resolve(self.world, functools.partial(self._replan, self.model, capacity))
            cfg.model.preset = self.model.preset or cfg.model.preset
            model, stages = self.model, topo.pp * cfg.schedule.chunks
            if len(model.layers) < stages:
                raise ValueError(f"{cfg.model.name} ({cfg.model.preset}) has {len(model.layers)} layers but "
                                 f"pp={topo.pp} x chunks={cfg.schedule.chunks} needs {stages} stages; use fewer "
                                 f"stages or a deeper preset")
            if self.rank == 0:   # only rank 0 writes logs
                writable_folder(cfg.logging.dir, "--log-dir")
            return topo

        # one rank's bad input (a local path) is every rank's error; an elastic re-plan is every rank's (the least
        # memory a rank has); then every setting and the data compared. Until the end, a rank stopped or dead is
        # reported after --timeout by the watch's start-up look (faults.py), wherever the others wait for it.
        (w := watch()).doing = "set-up: loading the model"
        self.model = on_every_rank(load)
        capacity = min(gathered(rank_memory(self.device), None))
        self.topo = on_every_rank(check)
        self.run_dir = self._run_dir()
        if self.rank == 0:   # from the start: a failure in set-up has its ranks' logs there too
            link_rank_logs(self.run_dir)
        self.feed = Feed(self.model.data, self.model.val_data, cfg.model.seed, cfg.batch, self.topo.dp,
                         self.topo.replica_of(self.rank), cfg.optimizer.steps, self._workers(),
                         self.device.type == "cuda", self.model.packing)
        same_settings({**cfg.given(), "data (--data)": self.feed.digest()})   # what each rank was given, first
        same_settings(cfg.computation())
        if cfg.saving.interval or cfg.saving.on_exit or cfg.saving.resume:
            check_shared(cfg.saving.dir, claim=bool(cfg.saving.interval or cfg.saving.on_exit))   # one folder
        point = pick_checkpoint(cfg, self.topo, len(self.model.layers))
        if point is not None and point.batch is not None:   # the checkpoint's global batch, kept
            cfg.set_batch(point.batch)
        self.batch = self.feed.batch = cfg.batch
        w.doing = "set-up: building the engine"
        self.engine = build_engine(cfg, self.model, self.topo, self.feed, self.device, point, self.baseline)
        self.feed.pieces = self.engine.pieces   # a budget may run microbatches as pieces (runtime/microbatches.py)
        w.doing = "set-up: resuming" if point is not None else "set-up"
        start, examples, self.world_change = resume(cfg, self.engine, point)   # (at another size: world_change)
        w.started()
        self.state = RunState(start=start)
        self.feed.start = (start, examples)   # the data position (examples consumed) at the first step
        self.warm = max(1, min(5, cfg.optimizer.steps // 20))   # steps left out of the timing figures
        self.timeline_steps = {min(self.state.start + self.warm, cfg.optimizer.steps - 1), cfg.optimizer.steps - 1}

    def _workers(self) -> int:
        workers = self.cfg.data.workers
        return workers if workers is not None else (2 if self.device.type == "cuda" else 0)

    def _replan(self, model: Model, capacity: float, world: int, pp: int, chunks: int) -> tuple[int, str]:
        """An elastic group's pp at a world --pp does not divide (elastic.py), from the model's size and the least
        memory a rank has (``capacity``: the same on every rank, so every rank takes the same pp)."""
        state = ModelState([sum(p.numel() * p.element_size() for p in m.parameters())
                            for m in sizing_layers(model.layers)],
                           optimizer_states=2 if self.cfg.optimizer.name == "adamw" else 1,
                           zero=self.cfg.parallel.zero == 1)
        return replan_pp(world, pp, chunks, state, capacity)

    def _open_logs(self) -> None:
        cfg, topo = self.cfg, self.topo
        self.writer = MetricsWriter(self.run_dir, enabled=self.rank == 0)
        self.writer.log_text("config", "".join(f"    {line}\n" for line in to_toml(cfg).splitlines()))
        if self.world_change is not None:   # a group restarted at another size
            self.writer.log_world_change(self.world_change)
        flops, per_length = None, None   # on the meta device; rows of their own: a sequence's FLOPs by its length
        if self.rank == 0 and self.model.packing is None:
            flops = flops_per_example(self.model.layers, self.feed.first_input())
        elif self.rank == 0:
            per_length = flops_per_length(self.model.layers, self.model.packing.context)
        twin = run_twin(self.engine, recompute=cfg.recompute.policy, sample_inputs=self.feed.sample()[0],
                        baseline=self.baseline, build=cfg.optimizer.build, sizes=self.feed.sizes())
        self.reporter = Reporter(self.engine, topo, self.device, self.run_dir, global_batch=self.batch.size,
                                 tokens_per_example=self.model.tokens_per_example, flops_per_example=flops,
                                 peak_tflops=cfg.logging.peak_tflops or peak_tflops(self.device, cfg.precision.mode),
                                 warm=self.warm, writer=self.writer, twin=twin, flops_per_length=per_length)
        if self.rank == 0 and not cfg.logging.quiet:
            log.info(topo.describe())
            plan = self.engine.plan   # the links, the split with its predicted step, what auto chose
            for shown in (plan.links and plan.links.describe(), plan.auto and plan.auto.describe(),
                          plan.choice and plan.choice.describe(plan.schedule.name), plan.budget and
                          plan.budget.describe(), twin and twin.describe()):
                if shown:
                    log.info(shown)
            log.info(f"model {cfg.model.name}{'/' + cfg.model.preset if cfg.model.preset else ''}: "
                     f"{self.engine.num_layers} layers, stage bounds "
                     f"{self.engine.bounds}; schedule {self.engine.schedule.name}, {self.batch.describe(topo.dp)}"
                     f"{f', each run as {self.engine.pieces} pieces' if self.engine.pieces > 1 else ''}; "
                     f"logs in {self.run_dir}")
            hint = slow_bf16_hint(self.device, cfg.precision.mode)
            if hint:
                log.info(hint)

    # ------------------------------------------------------------------ steps

    def evaluate(self, step: int) -> float:
        """The validation loss on step ``step``'s validation batch (NaN without validation data)."""
        if not self.feed.has_val:
            return math.nan
        return float(self.engine.eval_batch(self.feed.val(step) if self.engine.needs_data else None).loss)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step with its logging (every rank; rank 0 writes). ``last_data_s`` and ``last_step_s``
        say how long it waited for its batch and how long the pipeline step took."""
        cfg, engine = self.cfg, self.engine
        lr = cfg.lr_at(step)
        engine.set_lr(lr)
        data, self.last_data_s = self.feed.train(step) if engine.needs_data else (None, 0.0)
        t = time.perf_counter()
        res = engine.train_batch(data)
        self.last_step_s = time.perf_counter() - t
        self.state.losses.append(res.loss)
        if res.nonfinite and self.rank == 0:
            log.warning(f"step {step}: non-finite loss or gradients, update skipped ({engine.skipped_steps} so far)")
            self.writer.log_scalars(step, {"train/skipped_steps": engine.skipped_steps})
        shown = cfg.logging
        every = shown.timeline_interval
        timeline = step in self.timeline_steps or bool(every and (step + 1) % every == 0)
        wanted = (step % shown.log_interval == 0 or step == cfg.optimizer.steps - 1 or shown.trace_step == step
                  or timeline)
        if wanted and engine.replica == 0:   # replica 0's pipeline stands for every replica (the same program)
            self.reporter.timings(step, res, lr, shown.trace_step == step, timeline)
        elif self.rank == 0:
            self.writer.log_scalars(step, {"train/loss": res.loss, "train/lr": lr, "time/step_s": res.step_time,
                                           **({"train/grad_norm": res.grad_norm} if res.grad_norm is not None
                                              else {})})
        return res

    def _manifest(self, step: int) -> dict[str, Any]:
        """What a checkpoint of this run records beside the engine's state."""
        cfg = self.cfg
        return {"model": cfg.model.name, "preset": cfg.model.preset, "config": cfg.to_dict(),
                "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "examples": self.feed.position(step)}

    # ------------------------------------------------------------------ summary

    def summary(self) -> dict[str, Any]:
        """The run's figures (the summary block, summary.json, and what run() returns)."""
        cfg, state, nan = self.cfg, self.state, float("nan")
        return {"config": cfg.to_dict(), "pp": self.topo.pp, "dp": self.topo.dp, "status": state.status,
                "first_step": state.start, "steps_done": state.done, "first_loss": (state.losses or [nan])[0],
                "final_loss": (state.losses or [nan])[-1], "val_loss": state.val_loss if self.feed.has_val else None,
                "losses": state.losses, "skipped_steps": self.engine.skipped_steps,
                **self.reporter.figures(state.start),
                "closed_form_bubble": schedule_bubble(self.engine.schedule), "schedule_run": self.engine.schedule.name,
                "pieces_per_microbatch": self.engine.pieces, "oversubscribed": oversubscribed(self.device),
                "world_change": self.world_change}

    def _write_summary(self) -> None:
        if self.rank == 0:
            write_json(os.path.join(self.run_dir, "summary.json"), self.summary())

    # ------------------------------------------------------------------ the whole run

    def run(self) -> dict[str, Any]:
        """Set up, train, evaluate, save; the summary. Raises SystemExit with the command line's status on a
        failure (2 bad input, 3 an explained failure, 128+N stopped by signal N)."""
        try:
            self.setup()
        except ValueError as exc:
            if self.rank == 0:
                log.error(f"error: {exc}")
            raise self._exit(2) from None
        except RuntimeError:   # a set-up collective broken by a rank that ended over a start-up report (faults.py)
            explained = watch()._failure_text(wait=2.0) if self.world > 1 else None
            if explained is None:
                raise
            if self.rank == 0:
                watch().print_once(explained)   # once per job: printed already when it is the report
            raise self._exit(watch().exit_status) from None
        self._open_logs()
        cfg = self.cfg
        if cfg.schedule.dry_run:   # the plan and the twin's prediction (printed above), no step taken
            return dry_run(self)
        self.is_tty = sys.stdout.isatty() and not cfg.logging.quiet
        self.stop = StopRequest(lambda signum: setattr(self.engine, "stop_request", signum))
        self.saves = Saves(cfg, self.engine, self.rank, self._manifest)
        code = 0
        try:
            code = self._loop()
        except NonFiniteError as exc:   # every rank raises it alike
            code = self._stopped_nonfinite(exc)
        except (PeerFailed, WaitTimeout) as exc:   # shown once per job: by rank 0, unless the reporter did
            self.state.status = f"failed: {str(exc).splitlines()[0]}"
            if self.rank == 0:
                text = str(exc) if isinstance(exc, PeerFailed) else f"{type(exc).__name__}: {exc}"
                watch().print_once(self._nl() + text)   # PeerFailed says "error: rank N ... failed ..."
            code = watch().exit_status if isinstance(exc, PeerFailed) else EXPLAINED
        except ValueError as exc:   # a bad input met in the step (e.g. a stage that cannot take its input)
            self.state.status = f"failed: {exc}"
            if self.rank == 0:
                log.error(f"{self._nl()}error: {exc}")
            code = 2
        except BaseException as exc:
            self.state.status = f"failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.feed.close()
            self.stop.restore()
            self.writer.close()
            self._write_summary()
        result = self.summary()
        if self.rank == 0 and (not code or self.state.status.startswith("stopped by")):   # Ctrl-C too
            if self.is_tty and not code:
                print()
            print(summary_text(result))
        if code:
            raise self._exit(code)
        if self.owned:
            dist.destroy_process_group()
        return result

    def _loop(self) -> int:
        """The steps, then the final evaluation (or the stop a signal asked for); the exit status."""
        cfg, state = self.cfg, self.state
        steps = cfg.optimizer.steps
        self.reporter.startup_s = process_age()
        t_end = time.perf_counter()   # the end of the previous step: a step's wall time is all the user waits
        stopped: int | None = None
        for step in range(state.start, steps):
            stopped = self.train_step(step).stop   # a signal on any rank: every rank learns it with this step
            if cfg.logging.eval_interval and (step + 1) % cfg.logging.eval_interval == 0 and step + 1 < steps:
                state.val_loss = self.evaluate(step)
                self.writer.log_eval(step, state.val_loss)
            if cfg.saving.interval and ((step + 1) % cfg.saving.interval == 0 or step + 1 == steps):
                self.saves.save(step + 1, self.is_tty)
            else:   # a background save is published as soon as every rank wrote it
                self.saves.publish(self.is_tty, wait=False)
            t_start, t_end = t_end, time.perf_counter()
            self.reporter.step_done(step, t_end - t_start, self.last_data_s, self.last_step_s, self.feed.tokens)
            last = step + 1 == steps and stopped is None   # its line comes after the final evaluation, with its loss
            if (self.is_tty or (step + 1) % cfg.logging.log_interval == 0) and not last:
                self._progress(step + 1)
            if step % cfg.logging.log_interval == 0:
                self._write_summary()
            if stopped is not None:
                break
        code = 0
        if stopped is not None:
            name = signal.Signals(stopped).name
            state.status = f"stopped by {name} after step {state.done}"
            if self.rank == 0:
                log.warning(f"{self._nl()}{name}: every rank stopped after step {state.done}")
            if cfg.saving.on_exit and not (cfg.saving.interval and state.done % cfg.saving.interval == 0):
                self.saves.on_exit(state.done, stopped)
            code = 128 + stopped
        else:
            state.val_loss = self.evaluate(steps)
            self.writer.log_eval(steps - 1, state.val_loss)   # at the last training step
            self._progress(steps)
            state.status = "done"
        self.saves.publish()
        return code

    def _progress(self, done: int) -> None:
        """The progress line after ``done`` steps (rank 0; updated in place on a terminal)."""
        if self.rank == 0 and not self.cfg.logging.quiet:
            line = progress_line(done, self.cfg.optimizer.steps, self.state.losses[-1], self.state.val_loss,
                                 self.reporter.rates(), memory_text(self.reporter.peak_memory()))
            print(("\r" + line + "\033[K") if self.is_tty else line, end="" if self.is_tty else "\n", flush=True)

    def _stopped_nonfinite(self, exc: NonFiniteError) -> int:
        self.state.status = f"stopped: {exc}"
        if self.rank == 0:
            log.error(f"{self._nl()}error: {exc}")
        try:   # a background save still in flight is made visible (every rank is here)
            self.saves.publish()
        except CheckpointError as failed:   # raised on every rank alike
            if self.rank == 0:
                log.error(f"error: {failed}")
        return EXPLAINED

    def _nl(self) -> str:
        """A newline first when the progress line is being updated in place."""
        return "\n" if self.is_tty else ""

    def _exit(self, code: int) -> SystemExit:
        if self.owned and code in (0, 2):
            dist.destroy_process_group()
        return SystemExit(code)


def run(cfg: Config) -> dict[str, Any]:
    """Run one training job; its summary (see :meth:`Trainer.summary`)."""
    try:
        trainer = Trainer(cfg)
    except ValueError as exc:   # no process group to agree on it: every rank says it (e.g. --device cuda, no GPU)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.error(f"error: {exc}")
        raise SystemExit(2) from None
    return trainer.run()
