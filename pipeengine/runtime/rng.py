"""Random streams keyed to the model: layer ``i`` of microbatch ``k`` at step ``t`` draws from its own stream.

[Note: randomness belongs to the model]
Before each layer runs, the engine seeds the device's generator from (seed, global layer index,
global microbatch index within the step, step, train or eval): nothing of the layout (rank, pp,
dp, schedule, partition) enters, so dropout draws the same masks for the same examples whatever
the split, and replicas (other microbatches) draw other masks. The global microbatch index counts
over every replica (replica r's first is the sum of the earlier replicas' microbatch counts), so a
pp x dp run draws what one process running every microbatch of the step draws. Recompute and a
split W replay their F's masks: a recomputed region reseeds its layers with the key its F had
(``torch.utils.checkpoint`` keeps the key as an argument), so no RNG state is stashed.

The seeding costs one ``Generator.manual_seed`` (about a microsecond) per layer and microbatch.
The generator's state from before the step is put back after it (:func:`kept`): the caller's own
draws (data augmentation, sampling) do not depend on the engine's.

Megatron instead seeds each pipeline stage apart (its masks change with the split);
torch.distributed.pipelining leaves the RNG as it is (every rank's stream is the same).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["step_key", "microbatch_key", "layer_seed", "generator_of", "kept"]

_MASK = 2**64 - 1


def _mix(a: int, b: int) -> int:
    """splitmix64 of ``a`` combined with ``b``: a well-spread 64-bit value (the same on every process)."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def step_key(seed: int, step: int, train: bool) -> int:
    """The key of a training (or evaluation) step ``step`` of a run seeded ``seed``."""
    return _mix(_mix(seed, step), 1 if train else 2)


def microbatch_key(step: int, microbatch: int) -> int:
    """The key of global microbatch ``microbatch`` within a step keyed ``step`` (:func:`step_key`)."""
    return _mix(step, microbatch)


def layer_seed(key: int, layer: int) -> int:
    """The seed of global layer ``layer``'s stream for a microbatch keyed ``key`` (:func:`microbatch_key`)."""
    return _mix(key, layer) >> 1   # 63 bits: any generator takes it


def generator_of(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (what dropout and ``torch.rand`` draw from there)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@contextlib.contextmanager
def kept(generator: torch.Generator) -> Iterator[None]:
    """Put ``generator``'s state back as it was when the block began."""
    state = generator.get_state()
    try:
        yield
    finally:
        generator.set_state(state)
