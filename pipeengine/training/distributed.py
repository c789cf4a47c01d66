"""Starting torch.distributed for the trainer: torchrun's environment, or one process; the device to use."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..runtime.faults import Watch
from ..runtime.hangs import enable_flight_recorder
from ..runtime.hostalloc import keep_freed_memory
from ..runtime.options import STARTUP_TIMEOUT
from .config import Config

__all__ = ["init_distributed"]


def init_distributed(cfg: Config) -> tuple[torch.device, bool]:
    """Initialise torch.distributed (torchrun env, or a one-process group) unless the caller did; pick the device.

    Returns (device, whether this call created the process group).
    """
    par = cfg.parallel
    want_cuda = par.device == "cuda" or (par.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu (or launch/pipe.sh N cpus)")
    backend = par.backend if par.backend != "auto" else ("nccl" if want_cuda else "gloo")
    if backend == "nccl" and not want_cuda:
        raise ValueError("--backend nccl needs --device cuda; use gloo on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if not want_cuda:
        keep_freed_memory()   # hostalloc.py: large tensors reused, not page-faulted in every microbatch
    if dist.is_initialized():
        return device, False
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    early: Watch | None = None
    if launched:
        # One node: torchrun keeps one store across restarts of the group (its agent's), and keys of a
        # crashed attempt (the Gloo addresses of its groups) would be read by the next one, so each attempt
        # gets its own prefix. Across nodes the restart count is per node (a node whose workers did not
        # fail keeps 0), so launch/pipe.sh sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 there: every
        # rendezvous round gets a fresh store of its own on a fresh MASTER_PORT, and needs no prefix.
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous
        startup = timedelta(seconds=cfg.faults.timeout or STARTUP_TIMEOUT)
        store, rank, world = next(rendezvous("env://", timeout=startup))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = PrefixStore(f"pipeengine/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        # the fault channel from before the group exists: a rank stopped or dead before or during the group's
        # creation or set-up is reported after --timeout (faults.py, start-up), not after the group's own timeout.
        # A connection of its own (clone): Gloo's connect holds the group's store connection in a wait (up to
        # --collective-timeout) while a peer is missing, and every other call on that connection waits behind it.
        early = Watch(store.clone(), rank, world, starting="start-up: creating the process group")
        early.timeout = startup.total_seconds()
    else:
        store, rank, world = dist.HashStore(), 0, 1   # type: ignore[attr-defined]
    if backend == "nccl":
        enable_flight_recorder()   # named in the wait-for report if a hang comes
    # the group's own timeout is long (a checkpoint write is a slow collective, not a hang): hangs are the
    # watch's business (--timeout), on NCCL as on Gloo
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.faults.collective_timeout),
                            device_id=device if want_cuda else None)
    if early is not None:
        early.adopt()
        early.doing = "set-up"
        early.watch_parent()   # a launcher killed with -9 must not leave its workers training
    return device, True
