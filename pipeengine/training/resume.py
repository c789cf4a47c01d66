"""The resume policy: which checkpoint a run continues from, what it may reuse, and what changed since."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..runtime.agree import decided_by_rank0, gathered
from ..runtime.logs import log
from ..runtime.topology import Topology
from ..schedule import Costs
from .checkpoint import MANIFEST, TMP, CheckpointError, latest, load, manifest, resolve
from .batch import Batch, resume_batch
from .config import Config, flat_config

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine

__all__ = ["ResumePoint", "pick_checkpoint", "resume"]

# settings that change what a resumed run computes (data, learning rate, model), compared on resume
TRAJECTORY = ("model", "preset", "data", "seed", "steps", "lr", "min_lr", "warmup", "optimizer", "weight_decay",
              "grad_clip", "precision")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from, and what the new run may reuse from it."""

    path: str
    bounds: list[int] | None = None   # its stage bounds, when they fit this run (same pp, chunks and layers)
    costs: Costs | None = None        # the costs its schedule was lowered with (same schedule)
    batch: Batch | None = None        # the global batch to train on (the checkpoint's, unless --global-batch)


def pick_checkpoint(cfg: Config, topo: Topology, num_layers: int) -> ResumePoint | None:
    """The checkpoint to resume from, or None to start at step 0. Rank 0 decides, every rank learns it.

    A group restarted by torchrun resumes by itself from the newest checkpoint this run wrote in
    ``--save-dir`` (torchrun's run id: a fresh one per single-node launch, ``RDZV_ID`` across nodes;
    with "none" the newest checkpoint is taken), else from what ``--resume`` named: otherwise it would
    start over and overwrite its own checkpoints. Restarted means: after a failure (torchrun counts
    them per node: a node whose own workers were fine restarts with the others at count 0, so the
    group's is the largest of any rank), or after the group changed size (a node joined or left an
    elastic group: no count moves), which shows as a checkpoint of this run already in ``--save-dir``.
    """
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    ours = dist.get_rank() == 0 and _saved_by_this_run(cfg.saving.dir)
    attempts, saved = zip(*gathered((mine, ours), None))
    attempt = max(attempts) or (-1 if any(saved) else 0)   # -1: restarted at another size
    if cfg.saving.resume is None and attempt == 0:
        return None

    def decide() -> ResumePoint | None:
        try:
            return _decide(cfg, topo, num_layers, attempt)
        except (CheckpointError, OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"--resume: {exc}") from None

    point = decided_by_rank0(decide)
    if attempt != 0 and dist.get_rank() != 0 and os.environ.get("LOCAL_RANK") == "0":
        # every node's screen says it too (pipe.sh shows its node's local rank 0): launch/quiet.awk there
        # starts over on it, or the last attempt's failures would be held as this run's exit status
        log.warning(f"{_restart_text(attempt)}: resuming from {point.path}" if point else
                    f"{_restart_text(attempt)}: no checkpoint of this run yet: starting at step 0")
    return point


def _restart_text(attempt: int) -> str:
    return f"restart {attempt}" if attempt > 0 else "restart: the group changed size"


def _saved_by_this_run(directory: str) -> bool:
    """Whether the newest checkpoint in ``directory`` was written by this run (a run id that names it)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    try:
        found = latest(directory)[0]
        return run_id not in (None, "none") and found is not None and manifest(found).get("run_id") == run_id
    except (CheckpointError, OSError):
        return False


def _decide(cfg: Config, topo: Topology, num_layers: int, attempt: int) -> ResumePoint | None:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    resume = cfg.saving.resume
    path: str | None = None
    if attempt != 0 or resume == "latest":
        found, partial = latest(cfg.saving.dir)
        for p in partial:
            why = "a save that did not finish" if os.path.basename(p).startswith(TMP) else \
                f"it has no {MANIFEST}: a save or copy that did not finish"
            log.info(f"ignoring incomplete checkpoint {p} ({why})")
        if found is not None and (resume == "latest" or run_id in (None, "none")   # (no id: trust it)
                                  or manifest(found).get("run_id") == run_id):
            path = found
    if path is None and resume not in (None, "latest"):
        path = resume
    if attempt != 0:   # on stderr: launch/quiet.awk starts over on it (what it held was the last attempt's)
        what = _restart_text(attempt)
        log.warning(f"{what}: resuming from {path}" if path else
                    f"{what}: no checkpoint of this run yet: starting at step 0")
    elif path is None:
        log.info(f"no checkpoint in {cfg.saving.dir!r}: starting at step 0")
    if path is None:
        return None
    path = resolve(path)
    info = manifest(path)
    _note_changes(cfg, info)
    batch = _keep_batch(cfg, topo, info)
    same = (info.get("pp") == topo.pp and info.get("chunks") == cfg.schedule.chunks
            and info.get("num_layers") == num_layers and isinstance(info.get("bounds"), list))
    if not same:
        return ResumePoint(path, batch=batch)
    costs = _saved_costs(info, path) if info.get("schedule") == cfg.schedule.name else None
    return ResumePoint(path, list(info["bounds"]), costs, batch)


def _saved_costs(info: dict[str, Any], path: str) -> Costs | None:
    """The manifest's ``schedule_costs`` ([f, b, w], durations >= 0), or None."""
    costs = info.get("schedule_costs")
    if costs is None:
        return None

    def duration(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x < math.inf

    if not isinstance(costs, list) or len(costs) != 3 or not all(map(duration, costs)):
        raise CheckpointError(f"checkpoint {path!r} is damaged: its {MANIFEST} has schedule_costs {costs!r}, not "
                              f"[f, b, w] (durations >= 0); resume from another checkpoint, or pass --partition with "
                              f"explicit bounds")
    return Costs(*costs)


def _saved_batch(info: dict[str, Any]) -> Batch | None:
    """The global batch the checkpoint was trained on (its manifest's dp and config), if it says."""
    try:
        saved = flat_config(info["config"])
        m, micro = int(saved["microbatches"]), int(saved["micro_batch_size"])
        size = saved.get("global_batch")   # (checkpoints before uneven replicas: dp x m x micro)
        return Batch(int(size) if size is not None else int(info["dp"]) * m * micro, m, micro)
    except (KeyError, TypeError, ValueError):
        return None


def _keep_batch(cfg: Config, topo: Topology, info: dict[str, Any]) -> Batch | None:
    """The batch the resumed run trains on: the checkpoint's global batch, split for this layout (one line
    says so when the split changed), unless --global-batch asks for another."""
    saved = _saved_batch(info)
    if saved is None:
        return None
    batch, note = resume_batch(topo.dp, saved, *cfg.given_batch(), pp=topo.pp)
    if note:
        log.info(note)
    return batch


def _note_changes(cfg: Config, info: dict[str, Any]) -> None:
    """Say which settings that change the run differ from the checkpoint's (a run may mean to change them)."""
    if not isinstance(info.get("config"), dict):
        return
    saved, now = flat_config(info["config"]), cfg.flat()
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in TRAJECTORY if k in saved and saved[k] != now[k]]
    if changed:
        log.info(f"note: resuming with settings that differ from the checkpoint's ({'; '.join(changed)}): "
                 f"the run continues, but not as the saved one would have")


def resume(cfg: Config, engine: PipelineEngine, point: ResumePoint | None) -> tuple[int, int, dict[str, Any] | None]:
    """Load the chosen checkpoint on every rank; the step to start at, the examples consumed by then (the data
    position), and the world change if the checkpoint was written by another number of processes (``{"step",
    "from", "to", "pp", "dp", "microbatches"}``)."""
    if point is None:
        return 0, 0, None
    t0 = time.perf_counter()
    info = load(engine, point.path)
    if engine.rank == 0:
        log.info(f"resumed from {info['path']} at step {info['step']} in {time.perf_counter() - t0:.2f} s (written "
                 f"with pp={info.get('pp')} dp={info.get('dp')}{' zero 1' if info.get('zero') else ''} "
                 f"{info.get('schedule')}; this run: pp={engine.topology.pp} dp={engine.topology.dp}, stage bounds "
                 f"{engine.bounds})")
    if info["step"] >= cfg.optimizer.steps:
        raise ValueError(f"the checkpoint is at step {info['step']}, not before --steps {cfg.optimizer.steps}; "
                         f"ask for more steps to continue training")
    saved_world = info.get("world_size")
    world = engine.topology.world_size
    change = None if saved_world in (None, world) else {
        "step": int(info["step"]), "from": saved_world, "to": world, "pp": engine.topology.pp,
        "dp": engine.topology.dp, "microbatches": engine.microbatches}
    return int(info["step"]), _examples(info, cfg.batch.size), change


def _examples(info: dict[str, Any], batch: int) -> int:
    """The examples a checkpoint's run consumed (its manifest's ``examples``; older ones, or one the engine API
    saved: step x its global batch, else this run's ``batch``)."""
    if isinstance(info.get("examples"), int):
        return int(info["examples"])
    saved = _saved_batch(info)
    return int(info["step"]) * (saved.size if saved is not None else batch)
