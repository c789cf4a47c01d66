"""One rank of a real-process fault test (no torchrun): ``python -m tests.fault_worker RANK WORLD PORT SCENARIO``.

Scenarios (pp = WORLD, an MLP of sleep-free layers, a step every few milliseconds):
  raise   rank 1 raises in its forward at step 2, then stays alive (catches it and sleeps)
  stop    every rank trains until killed (the test stops one with SIGSTOP)
Prints ``step N`` after each step and exits 0 at the end (never reached in these scenarios), or
with the engine's status: 3 for PeerFailed / WaitTimeout.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


class Boom(nn.Module):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.armed = scenario == "raise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.armed and self.calls == 2 * 4 + 1:   # step 2's first microbatch (4 per step)
            raise RuntimeError("injected failure in Boom.forward")
        return torch.relu(self.lin(x))


def main() -> int:
    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from pipeengine.runtime.engine import PipelineEngine
    from pipeengine.runtime.faults import PeerFailed, WaitTimeout
    from pipeengine.runtime.topology import Topology
    layers = [Boom(scenario) if i == 1 else nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for i in range(world)]
    engine = PipelineEngine(layers, nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.01),
                            topology=Topology(world, 1), microbatches=4, partition="uniform",
                            timeout=float(os.environ.get("PE_TIMEOUT", "60")))
    data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(4)]
    try:
        for step in range(10**6):
            engine.train_batch(iter(data))
            print(f"step {step}", flush=True)
    except (PeerFailed, WaitTimeout) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    except RuntimeError as exc:   # the injected failure: stay alive, as a user's own launcher might
        print(f"caught: {exc}", file=sys.stderr, flush=True)
        time.sleep(60)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
