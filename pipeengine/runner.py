"""The training loop behind ``python -m pipeengine.train``: set-up, steps, logging, summary, stopping.

train.py holds the configuration and the command line (torch-free, so ``--help`` is fast); this
module runs a :class:`~pipeengine.train.TrainConfig`.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .checkpoint import AsyncSaver, CheckpointError, latest, load, manifest, resolve, save
from .engine import NonFiniteError, PipelineEngine, StepResult
from .faults import EXPLAINED, STARTUP_TIMEOUT, PeerFailed, WaitTimeout, watch
from .hostalloc import keep_freed_memory
from .metrics import PARTS, Phase, MetricsWriter, chrome_trace, decompose, gather_records, pipeline_bubble, write_json
from .schedule import Costs, simulate, theoretical_bubble
from .topology import Topology
from .train import TrainConfig, to_toml

__all__ = ["run"]


def _init(cfg: TrainConfig) -> tuple[torch.device, bool]:
    """Initialise torch.distributed (torchrun env, or a one-process group) unless the caller did; pick the device.

    Returns (device, whether this call created the process group).
    """
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu (or launch/pipe.sh N cpus)")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if want_cuda else "gloo")
    if backend == "nccl" and not want_cuda:
        raise ValueError("--backend nccl needs --device cuda; use gloo on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        torch.cuda.set_device(local_rank)
    from datetime import timedelta
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if not want_cuda:
        keep_freed_memory()   # hostalloc.py: large tensors reused, not page-faulted in every microbatch
    if dist.is_initialized():
        return device, False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun keeps one store across restarts of the group: keys of a crashed attempt (the Gloo
        # addresses of its groups) would be read by the next one, so each attempt gets its own prefix
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous
        limit = timedelta(seconds=cfg.timeout or STARTUP_TIMEOUT)
        store, rank, world = next(rendezvous("env://", timeout=limit))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=PrefixStore(f"pipeengine/attempt{attempt}/", store),
                                rank=rank, world_size=world, timeout=limit)
        watch().watch_parent()   # a launcher killed with -9 must not leave its workers training
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    return device, True


def _progress(step: int, total: int, loss: float, val: float, samples_s: float, steps_s: float,
              width: int = 24) -> str:
    """``[####....] step 40/100  loss 2.9876  val 2.8765  3.1 steps/s  190 samples/s  ETA 0:19``."""
    done = int(width * step / total)
    eta = int((total - step) / steps_s) if steps_s > 0 else 0
    val_s = f"  val {val:.4f}" if math.isfinite(val) else ""
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}{val_s}  {steps_s:.1f} steps/s"
            f"  {samples_s:,.0f} samples/s  ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")


class _StopRequest:
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


def _setup(cfg: TrainConfig, device: torch.device, world: int) -> tuple[Any, ...]:
    """Everything before the first step; a bad input raises ValueError on every rank alike."""
    rank = dist.get_rank()
    problem = None
    try:
        topo = cfg.check(world)
        mod = importlib.import_module(f"pipeengine.models.{cfg.model}")
        presets = mod.presets()
        if cfg.preset not in presets:
            raise ValueError(f"--preset {cfg.preset!r} is not a {cfg.model} preset; choose {', '.join(presets)}")
        mcfg = presets[cfg.preset]()
        torch.manual_seed(cfg.seed)
        factories = mod.layer_factories(mcfg)   # each rank builds only its own stages' layers
        stages = topo.pp * cfg.chunks
        if len(factories) < stages:
            raise ValueError(f"{cfg.model} ({cfg.preset}) has {len(factories)} layers but pp={topo.pp} x chunks="
                             f"{cfg.chunks} needs {stages} stages; use fewer stages or a deeper preset")
        source = mod.make_source(mcfg, cfg.data)
        if rank == 0:   # only rank 0 writes logs
            _check_writable(cfg.log_dir, "--log-dir")
    except ValueError as exc:
        problem = str(exc)
    everyone: list[Any] = [None] * world   # one rank's bad input (a local path) is every rank's error
    dist.all_gather_object(everyone, problem)
    problem = next((p for p in everyone if p), None)
    if problem:
        raise ValueError(problem)
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.SGD

    def make_opt(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        kw: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        if cfg.optimizer == "sgd":
            kw["momentum"] = 0.9
        return opt_cls(ps, **kw)

    resume_from, partition, costs = _pick_checkpoint(cfg, topo, len(factories)), cfg.partition_arg(), None
    if resume_from is not None and cfg.partition == "profile" and resume_from[1] is not None:
        # the checkpoint's measured bounds and schedule costs: the resumed run computes as the first did
        partition, saved_costs = resume_from[1]
        costs = Costs(*saved_costs) if saved_costs else None
    sample = None
    if partition == "profile":   # time the layers on the run's first microbatch
        batches = importlib.import_module("pipeengine.models.data").batches
        sample = next(iter(batches(source, "train", 0, cfg.seed, 0, topo.dp, cfg.microbatches,
                                   cfg.micro_batch_size)))
    engine = PipelineEngine(factories, mod.loss_fn, make_opt, topology=topo, schedule=cfg.schedule,
                            microbatches=cfg.microbatches, chunks=cfg.chunks, seed=cfg.seed,
                            tied=mod.tied_parameters(len(factories)), device=device, timeout=cfg.timeout,
                            grad_clip=cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0 else None,
                            checkpoint=cfg.checkpoint, precision=cfg.precision, on_nonfinite=cfg.on_nonfinite,
                            partition=partition, sample=sample, wire=cfg.wire, costs=costs,
                            memory_cap=cfg.memory_cap * 2**30 if cfg.memory_cap else None)
    return topo, mcfg, source, engine, resume_from[0] if resume_from else None


def _check_writable(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} cannot be created: {exc.strerror}; choose a writable folder") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} is not writable; choose a writable folder")


def _exit(code: int, owned: bool) -> SystemExit:
    if owned and code in (0, 2):
        dist.destroy_process_group()
    return SystemExit(code)


def run(cfg: TrainConfig) -> dict[str, Any]:
    device, owned = _init(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        topo, mcfg, source, engine, resume_from = _setup(cfg, device, world)
        start = _resume(cfg, engine, resume_from)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise _exit(2, owned) from None
    batches = importlib.import_module("pipeengine.models.data").batches
    global_batch = topo.dp * cfg.microbatches * cfg.micro_batch_size
    tokens_per_example = int(getattr(mcfg, "block_size", 0)) or None
    run_name = cfg.run_name or f"{cfg.model}-{cfg.schedule}-pp{topo.pp}dp{topo.dp}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(cfg.log_dir, run_name)
    writer = MetricsWriter(run_dir, enabled=rank == 0)
    writer.log_text("config", "".join(f"    {line}\n" for line in to_toml(cfg).splitlines()))   # a code block
    if rank == 0 and not cfg.quiet:
        print(topo.describe())
        if engine.partition_choice is not None:
            print(engine.partition_choice.describe(engine.schedule.name))
        print(f"model {cfg.model}/{cfg.preset}: {engine.num_layers} layers, stage bounds {engine.bounds}; schedule "
              f"{cfg.schedule}, {cfg.microbatches} microbatches x {cfg.micro_batch_size} per replica, global batch "
              f"{global_batch}; logs in {run_dir}")
    is_tty = sys.stdout.isatty() and not cfg.quiet
    stop = _StopRequest(watch().store)
    saver = (AsyncSaver(cfg.timeout or STARTUP_TIMEOUT) if cfg.async_save and (cfg.save_interval or cfg.save_on_exit)
             else None)

    def data_iter(split: str, step: int) -> Any:
        if not engine.needs_data:
            return None
        return iter(batches(source, split, step, cfg.seed, engine.replica, topo.dp, cfg.microbatches,
                            cfg.micro_batch_size))

    def evaluate(step: int) -> float:
        return float(engine.eval_batch(data_iter("val", step)).loss)

    warm = max(1, min(5, cfg.steps // 20))   # steps left out of the timing figures (start-up, first allocations)
    state: dict[str, Any] = {"val_loss": float("nan"),
                             "losses": [], "times": [], "bubbles": [], "status": "running",
                             "timeline_steps": {min(start + warm, cfg.steps - 1), cfg.steps - 1}}

    def done() -> int:   # steps finished so far
        return start + len(state["losses"])

    def summary() -> dict[str, Any]:
        losses, nan = state["losses"], float("nan")
        steady = sorted(state["times"][warm:] or state["times"] or [float("nan")])
        median = steady[len(steady) // 2]
        bubbles = [b for b in state["bubbles"] if b[0] >= start + warm] or state["bubbles"]
        return {"config": asdict(cfg), "pp": topo.pp, "dp": topo.dp, "status": state["status"],
                "first_step": start, "steps_done": done(), "first_loss": (losses or [nan])[0],
                "final_loss": (losses or [nan])[-1], "val_loss": state["val_loss"], "median_step_s": median,
                "losses": state["losses"], "skipped_steps": engine.skipped_steps,
                "samples_per_s": global_batch / median,
                "tokens_per_s": global_batch * tokens_per_example / median if tokens_per_example else None,
                "warmup_steps": warm, "timed_steps": [b[0] for b in bubbles],
                "measured_bubble": _mean([b[1] for b in bubbles]),
                "theoretical_bubble": _mean([b[2] for b in bubbles]),
                "closed_form_bubble": theoretical_bubble(cfg.schedule, topo.pp, cfg.microbatches, cfg.chunks),
                "step_parts": {k: _mean([b[3][k] for b in bubbles]) for k in PARTS},
                "oversubscribed": _oversubscribed(device)}

    def save_summary() -> None:
        if rank == 0:
            write_json(os.path.join(run_dir, "summary.json"), summary())

    code = 0
    t_start = time.perf_counter()
    try:
        for step in range(start, cfg.steps):
            if stop.after(step):
                break
            _train_step(cfg, engine, topo, writer, state, step, data_iter("train", step), global_batch,
                        tokens_per_example, run_dir)
            if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0 and step + 1 < cfg.steps:
                state["val_loss"] = evaluate(step)
                writer.log_eval(step, state["val_loss"])
            if cfg.save_interval and ((step + 1) % cfg.save_interval == 0 or step + 1 == cfg.steps):
                _save(cfg, engine, step + 1, is_tty, saver)
            if rank == 0 and not cfg.quiet and (is_tty or (step + 1) % cfg.log_interval == 0 or step + 1 == cfg.steps):
                elapsed = time.perf_counter() - t_start
                line = _progress(step + 1, cfg.steps, state["losses"][-1], state["val_loss"],
                                 global_batch / state["times"][-1], (step + 1 - start) / elapsed)
                print(("\r" + line + "\033[K") if is_tty else line, end="" if is_tty else "\n", flush=True)
            if step % cfg.log_interval == 0:
                save_summary()
        if stop.signum is not None:
            name = signal.Signals(stop.signum).name
            state["status"] = f"stopped by {name} after step {done()}"
            if rank == 0:
                print(f"{chr(10) if is_tty else ''}{name}: every rank stopped after step {done()}",
                      file=sys.stderr)
            if cfg.save_on_exit and not (cfg.save_interval and done() % cfg.save_interval == 0):
                _save(cfg, engine, done(), False, saver)
            code = 128 + stop.signum
        else:
            state["val_loss"] = evaluate(cfg.steps)
            writer.log_eval(cfg.steps - 1, state["val_loss"])   # at the last training step
            state["status"] = "done"
        if saver is not None and (published := saver.finish()) and rank == 0:
            print(f"saved {published} (in the background)")
    except NonFiniteError as exc:   # every rank raises it alike
        state["status"] = f"stopped: {exc}"
        if rank == 0:
            print(f"{chr(10) if is_tty else ''}error: {exc}", file=sys.stderr)
        try:   # a background save still in flight is made visible (every rank is here)
            if saver is not None and (published := saver.finish()) and rank == 0:
                print(f"saved {published} (in the background)")
        except CheckpointError as failed:   # raised on every rank alike
            if rank == 0:
                print(f"error: {failed}", file=sys.stderr)
        code = EXPLAINED
    except (PeerFailed, WaitTimeout) as exc:   # shown once per job: by rank 0, unless the reporter did
        state["status"] = f"failed: {str(exc).splitlines()[0]}"
        if rank == 0:
            watch().print_once(f"{chr(10) if is_tty else ''}{type(exc).__name__}: {exc}")
        code = watch().exit_status if isinstance(exc, PeerFailed) else EXPLAINED
    except ValueError as exc:   # a bad input met in the step (e.g. a stage that cannot take its input)
        state["status"] = f"failed: {exc}"
        if rank == 0:
            print(f"{chr(10) if is_tty else ''}error: {exc}", file=sys.stderr)
        code = 2
    except BaseException as exc:
        state["status"] = f"failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        stop.restore()
        writer.close()
        save_summary()
    if code:
        raise _exit(code, owned)
    result = summary()
    if rank == 0:
        if is_tty:
            print()
        print(_summary_text(result))
    if owned:
        dist.destroy_process_group()
    return result


def _save(cfg: TrainConfig, engine: PipelineEngine, step: int, newline: bool, saver: AsyncSaver | None) -> None:
    t_save = time.perf_counter()
    extra = {"model": cfg.model, "preset": cfg.preset, "config": asdict(cfg),
             "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
    if saver is None:
        saved = save(engine, cfg.save_dir, step, keep=cfg.keep or None, extra=extra)
    else:
        published = saver.finish()   # the previous background save, made visible
        if published and dist.get_rank() == 0:
            print(f"{chr(10) if newline else ''}saved {published} (in the background)")
        saved = saver.save(engine, cfg.save_dir, step, keep=cfg.keep or None, extra=extra)
    if dist.get_rank() == 0:
        how = "the step waited" if saver else "saved"
        print(f"{chr(10) if newline else ''}{saved}: {how} {time.perf_counter() - t_save:.2f} s")


def _train_step(cfg: TrainConfig, engine: PipelineEngine, topo: Topology, writer: MetricsWriter,
                state: dict[str, Any], step: int, data: Any, global_batch: int, tokens_per_example: int | None,
                run_dir: str) -> None:
    """One optimizer step with its logging (every rank; rank 0 writes)."""
    rank = dist.get_rank()
    lr = cfg.lr_at(step)
    for g in engine.optimizer.param_groups:
        g["lr"] = lr
    res: StepResult = engine.train_batch(data)
    state["losses"].append(res.loss)
    state["times"].append(res.step_time)
    if res.nonfinite and rank == 0:
        print(f"step {step}: non-finite loss or gradients, update skipped ({engine.skipped_steps} so far)",
              file=sys.stderr)
        writer.log_scalars(step, {"train/skipped_steps": engine.skipped_steps})
    samples_s = global_batch / res.step_time
    timeline = step in state["timeline_steps"] or bool(cfg.timeline_interval
                                                       and (step + 1) % cfg.timeline_interval == 0)
    wanted = step % cfg.log_interval == 0 or step == cfg.steps - 1 or cfg.trace_step == step or timeline
    records = gather_records(res.records) if wanted else None   # the same decision on every rank
    if not wanted and rank == 0:
        writer.log_scalars(step, {"train/loss": res.loss, "train/lr": lr, "time/step_s": res.step_time,
                                  "throughput/samples_per_s": samples_s,
                                  **({"train/grad_norm": res.grad_norm} if res.grad_norm is not None else {})})
    if records is not None:   # rank 0: every rank's timings of this step
        step_time = max(r.end for rs in records.values() for r in rs)
        # replica 0's ranks stand for their stage (replicas run the same program)
        parts = decompose({rk: rs for rk, rs in records.items() if topo.replica_of(rk) == 0}, step_time)
        measured = pipeline_bubble(parts)
        theory = _theoretical(engine, records)
        share = {k: sum(p[k] for p in parts.values()) / len(parts) / step_time for k in PARTS}
        state["bubbles"].append((step, measured, theory, share))
        writer.log_step(step, loss=res.loss, lr=lr, grad_norm=res.grad_norm, step_time=step_time,
                        samples_per_s=global_batch / step_time,
                        tokens_per_s=global_batch * tokens_per_example / step_time if tokens_per_example else None,
                        parts_by_stage={topo.position_of(rk): p for rk, p in parts.items()},
                        measured_bubble=measured, theoretical_bubble=theory)
        if timeline:
            writer.log_timeline(step, records)
        if cfg.trace_step == step:
            chrome_trace(records, os.path.join(run_dir, f"trace_step{step}.json"), step)


# settings that change what a resumed run computes (data, learning rate, model), compared on resume
_TRAJECTORY = ("model", "preset", "data", "seed", "steps", "lr", "min_lr", "warmup", "optimizer", "weight_decay",
               "grad_clip", "precision")


def _pick_checkpoint(cfg: TrainConfig, topo: Topology, num_layers: int) -> Any:
    """The checkpoint to resume from, and (its stage bounds, its schedule costs) when they fit this run
    (same pp, chunks and layers), else None; None to start at step 0. Rank 0 decides, every rank learns it.

    A group restarted by torchrun (``--max-restarts``) resumes by itself from the newest checkpoint
    this run wrote in ``--save-dir`` (torchrun's run id: a fresh one per single-node launch; multi-node
    runs share "none", and then the newest checkpoint is taken), else from what ``--resume`` named:
    otherwise it would start over and overwrite its own checkpoints.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if cfg.resume is None and attempt == 0:
        return None
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            path: str | None = None
            if attempt > 0 or cfg.resume == "latest":
                found, partial = latest(cfg.save_dir)
                for p in partial:
                    print(f"ignoring incomplete checkpoint {p} (a save that did not finish)")
                if found is not None and (cfg.resume == "latest" or run_id in (None, "none")   # (no id: trust it)
                                          or manifest(found).get("run_id") == run_id):
                    path = found
            if path is None and cfg.resume not in (None, "latest"):
                path = cfg.resume
            if attempt > 0:
                print(f"restart {attempt}: resuming from {path}" if path else
                      f"restart {attempt}: no checkpoint of this run yet: starting at step 0")
            elif path is None:
                print(f"no checkpoint in {cfg.save_dir!r}: starting at step 0")
            if path is not None:
                path = resolve(path)
                info = manifest(path)
                same = (info.get("pp") == topo.pp and info.get("chunks") == cfg.chunks
                        and info.get("num_layers") == num_layers and isinstance(info.get("bounds"), list))
                costs = info.get("schedule_costs") if info.get("schedule") == cfg.schedule else None
                answer[0] = (path, (info["bounds"], costs) if same else None)
                _note_changes(cfg, topo, info)
        except (CheckpointError, OSError, ValueError, TypeError, KeyError) as exc:
            answer[0] = f"--resume: {exc}"
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ValueError(answer[0])
    return answer[0]


def _note_changes(cfg: TrainConfig, topo: Topology, info: dict[str, Any]) -> None:
    """Say which settings that change the run differ from the checkpoint's (a run may mean to change them)."""
    saved = info.get("config")
    if not isinstance(saved, dict):
        return
    changed = [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in _TRAJECTORY
               if k in saved and saved[k] != getattr(cfg, k)]
    try:   # the data follow the global batch, however it is split over replicas and microbatches
        before = int(info["dp"]) * int(saved["microbatches"]) * int(saved["micro_batch_size"])
        now = topo.dp * cfg.microbatches * cfg.micro_batch_size
        if before != now:
            changed.append(f"global batch {before} -> {now}")
    except (KeyError, TypeError, ValueError):
        pass
    if changed:
        print(f"note: resuming with settings that differ from the checkpoint's ({'; '.join(changed)}): "
              f"the run continues, but not as the saved one would have")


def _resume(cfg: TrainConfig, engine: PipelineEngine, path: str | None) -> int:
    """Load the chosen checkpoint on every rank; the step to start at."""
    if path is None:
        return 0
    t0 = time.perf_counter()
    info = load(engine, path)
    if dist.get_rank() == 0:
        print(f"resumed from {info['path']} at step {info['step']} in {time.perf_counter() - t0:.2f} s (written "
              f"with pp={info.get('pp')} dp={info.get('dp')} {info.get('schedule')}; stage bounds "
              f"{engine.bounds})")
    if info["step"] >= cfg.steps:
        raise ValueError(f"the checkpoint is at step {info['step']}, not before --steps {cfg.steps}; "
                         f"ask for more steps to continue training")
    return int(info["step"])


def _theoretical(engine: PipelineEngine, records: dict[int, list[Any]]) -> float:
    """The simulator's bubble for this schedule fed each pipeline position's measured mean F/B/W times.

    Replica 0's ranks stand for every replica (they run the same program).
    """
    split = engine.schedule.split_backward
    per_position = []
    for position in range(engine.topology.pp):
        rs = records.get(engine.topology.rank(position, 0), [])
        mean = {}
        for kind in (Phase.F, Phase.B, Phase.W):
            ds = [r.end - r.start for r in rs if r.kind == kind]
            mean[kind] = sum(ds) / len(ds) if ds else 0.0
        per_position.append(Costs(f=mean[Phase.F], b=mean[Phase.B], w=mean[Phase.W] if split else 0.0))
    if all(c.f + c.b <= 0 for c in per_position):
        return 0.0
    return simulate(engine.schedule, per_position).mean_bubble


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _oversubscribed(device: torch.device) -> str | None:
    """"8 processes x 1 thread on 2 cores" when this node's ranks want more cores than it has (CPU runs)."""
    if device.type != "cpu":
        return None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    return f"{procs} processes x {threads} threads on {cores} cores" if procs * threads > cores else None


def _summary_text(s: dict[str, Any]) -> str:
    c = s["config"]
    tok = f"  tokens/s {s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else ""
    bub, parts = "n/a", "n/a"
    if s["measured_bubble"] is not None:
        bub = (f"measured {s['measured_bubble']:.3f}  simulated {s['theoretical_bubble']:.3f}  closed form "
               f"{s['closed_form_bubble']:.3f}  ({len(s['timed_steps'])} timed steps, the first "
               f"{s['warmup_steps']} left out as warm-up)")
        parts = "  ".join(f"{k} {100 * v:.0f}%" for k, v in s["step_parts"].items())
        if s["oversubscribed"]:
            parts += f"\n           ({s['oversubscribed']}: the ranks take turns, waits include CPU contention)"
    return "\n".join([
        "=" * 72,
        f"model {c['model']}/{c['preset']}  schedule {c['schedule']}  pp {s['pp']} x dp {s['dp']}  "
        f"microbatches {c['microbatches']} x {c['micro_batch_size']}  steps {c['steps']}",
        f"loss       first {s['first_loss']:.4f}  final {s['final_loss']:.4f}  validation {s['val_loss']:.4f}",
        f"throughput {s['samples_per_s']:,.1f} samples/s{tok}  (median step {s['median_step_s'] * 1000:.1f} ms)",
        f"bubble     {bub}",
        f"step time  {parts}",
        "=" * 72,
    ])
