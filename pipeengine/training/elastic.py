"""The pipeline depth an elastic group takes when it restarts at a size ``--pp`` does not divide (torch-free).

A group started by ``launch/pipe.sh`` with ``NNODES=MIN:MAX`` restarts at whatever size survives
(PIPEENGINE_ELASTIC=1). pp must divide the world (every replica is a whole pipeline); dp need not
divide the global batch (replicas take uneven shares, batch.py). So the re-plan chooses pp among
the world's divisors: deep enough that a rank's share of the model state fits its memory, not
deeper than the model has stages, and as close to the ``--pp`` asked as that allows (a deeper one
on a tie: it holds less per rank). The memory is an estimate of the model state on the fullest
rank (parameters, gradients and optimizer state, the stages balanced by parameters); activations
come on top, so a shallower pipeline must leave a quarter of the memory free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["ModelState", "replan_pp"]

HEADROOM = 0.75   # of a rank's memory the model state of a shallower pipeline may take (activations need the rest)


@dataclass(frozen=True)
class ModelState:
    """What a rank holds of a model per parameter byte, to estimate it at any pp.

    ``layer_bytes``: parameter bytes per layer; ``optimizer_states``: optimizer state tensors per parameter
    (AdamW 2, SGD with momentum 1); ``zero``: the optimizer state sharded over dp (ZeRO-1)."""

    layer_bytes: Sequence[int]
    optimizer_states: int = 2
    zero: bool = False

    def per_rank(self, pp: int, dp: int) -> float:
        """Estimated bytes on the fullest rank at pp x dp: its share of the parameters (at least the largest
        layer), with their gradients and optimizer state."""
        share = max(sum(self.layer_bytes) / pp, max(self.layer_bytes, default=0))
        return share * (2 + self.optimizer_states / (dp if self.zero else 1))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def replan_pp(world: int, pp: int, stages_per_position: int, state: ModelState, capacity: float) -> tuple[int, str]:
    """The pp for ``world`` processes when ``pp`` was asked, and the line that says why; ValueError (one line)
    when no divisor of ``world`` fits (``capacity``: bytes a rank may use)."""
    if world % pp == 0:
        return pp, f"elastic: {world} processes: pp {pp} x dp {world // pp}"
    layers = len(state.layer_bytes)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    deep_enough = [d for d in divisors if d * stages_per_position <= layers]
    fits = [d for d in deep_enough if d > pp or state.per_rank(d, world // d) <= HEADROOM * capacity]
    if not fits:
        deepest = max(deep_enough, default=1)
        raise ValueError(
            f"elastic: {world} processes fit no pipeline: --pp {pp} does not divide {world}; its divisors "
            f"{divisors[:8]}{'...' if len(divisors) > 8 else ''} are deeper than the model's {layers} layers allow "
            f"(at most {layers // stages_per_position} positions) or too shallow for a rank's memory (pp {deepest} "
            f"would hold an estimated {_gib(state.per_rank(deepest, world // deepest))} of model state per rank, "
            f"more than {HEADROOM:.0%} of {_gib(capacity)}); restart on a multiple of {pp} processes "
            f"({world // pp * pp or pp}) or with more memory per rank")
    best = min(fits, key=lambda d: (abs(math.log(d / pp)), -d))
    need = state.per_rank(best, world // best)
    shallower = (f"no deeper one fits the model's {layers} layers" if not any(d > pp for d in fits)
                 else "deeper ones are further from it")
    why = ("deeper: less memory per rank" if best > pp else
           f"{shallower}; it holds an estimated {_gib(need)} of model state per rank, within {HEADROOM:.0%} of "
           f"{_gib(capacity)}")
    return best, (f"elastic: {world} processes: pp {best} x dp {world // best} (--pp {pp} does not divide {world}; "
                  f"pp {best} is the nearest that does and fits: {why})")
