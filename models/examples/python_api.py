"""Your own model through the Python API: pp 2 x dp 2 on 4 CPU processes, then evaluate, save, resume, export.

    python models/examples/python_api.py            # starts its 4 processes itself (Gloo on CPU)
    torchrun --nproc-per-node 4 models/examples/python_api.py   # or under torchrun (NCCL when GPUs are there)

Every rank runs this file. It builds the engine from layer factories (no rank builds the whole
model), feeds it microbatches, and uses the engine's public surface: ``train_batch``,
``eval_batch``, ``set_lr``, ``pipeengine.save_checkpoint`` / ``load_checkpoint`` /
``export_checkpoint``. At the end rank 0 checks that the exported weights, run as one plain
``nn.Sequential``, give the pipeline's validation loss.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipeengine

PP, DP, MICROBATCHES, MICRO = 2, 2, 4, 8     # global batch: DP x MICROBATCHES x MICRO = 64 examples


def layers() -> list[Any]:
    """The model as a list of layer factories: the engine splits it into PP stages."""
    return [lambda: nn.Linear(16, 64), lambda: nn.GELU(), lambda: nn.Linear(64, 64), lambda: nn.GELU(),
            lambda: nn.Linear(64, 64), lambda: nn.GELU(), lambda: nn.Linear(64, 4)]


def microbatches(step: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s microbatches for ``replica``: a fixed function of the step, cut out of one global batch."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(DP * MICROBATCHES * MICRO, 16, generator=g)
    y = x[:, :4].argmax(dim=1)                                 # the class: which of the first 4 features is largest
    mine = slice(replica * MICROBATCHES * MICRO, (replica + 1) * MICROBATCHES * MICRO)
    return list(zip(x[mine].split(MICRO), y[mine].split(MICRO)))


def make_engine() -> pipeengine.PipelineEngine:
    return pipeengine.PipelineEngine(
        layers(), nn.functional.cross_entropy, lambda params: torch.optim.AdamW(params, lr=1e-2),
        topology=pipeengine.Topology(pp=PP, dp=DP), schedule="1f1b", microbatches=MICROBATCHES, grad_clip=1.0)


def data(engine: pipeengine.PipelineEngine, step: int) -> Iterator[Any] | None:
    """Only the first and last positions read data (inputs, targets); the others pass None."""
    return iter(microbatches(step, engine.replica)) if engine.needs_data else None


def main(folder: str) -> None:
    engine = make_engine()
    losses = []
    for step in range(20):
        engine.set_lr(1e-2 * min(1.0, (step + 1) / 5))        # your own schedule: linear warm-up
        losses.append(engine.train_batch(data(engine, step)).loss)
    saved = pipeengine.save_checkpoint(engine, folder, step=20)
    val = engine.eval_batch(data(engine, 10_000)).loss
    next_loss = engine.train_batch(data(engine, 20)).loss

    resumed = make_engine()                                    # a fresh engine, as after a restart
    info = pipeengine.load_checkpoint(resumed, saved)
    assert info["step"] == 20 and resumed.eval_batch(data(resumed, 10_000)).loss == val
    assert resumed.train_batch(data(resumed, 20)).loss == next_loss     # it continues bit for bit

    if dist.get_rank() == 0:
        out = os.path.join(folder, "model.pt")
        pipeengine.export_checkpoint(saved, out)               # the unsplit model's plain state_dict
        net = nn.Sequential(*(make() for make in layers()))
        net.load_state_dict(torch.load(out, weights_only=True))
        with torch.no_grad():
            every = microbatches(10_000, 0) + microbatches(10_000, 1)     # both replicas' microbatches
            x, y = torch.cat([mx for mx, _ in every]), torch.cat([my for _, my in every])
            plain = nn.functional.cross_entropy(net(x), y).item()
        assert abs(plain - val) < 1e-5, (plain, val)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation {val:.4f} (exported model: {plain:.4f}); "
              f"saved {saved}, resumed bit for bit")
    dist.barrier()


def _spawned(rank: int, world: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        main(folder)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else None
    if "RANK" in os.environ:                                   # under torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        main(target or "checkpoints/python-api")
        dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(PP * DP, _free_port(), target or tmp), nprocs=PP * DP)
