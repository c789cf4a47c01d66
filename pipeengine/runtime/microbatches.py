"""A step's microbatches: read from the user's iterator, checked, and moved to the device."""

from __future__ import annotations

import operator
from typing import Any, Iterator

import torch

from .tensors import to_device

__all__ = ["read_microbatches"]

_CONTAINER_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))   # a step's microbatches as a list or tuple


def read_microbatches(data_iter: Iterator[Any] | None, count: int, device: torch.device, step: int,
                      rank: int) -> tuple[list[Any], list[Any]]:
    """``count`` ``(inputs, target)`` pairs from ``data_iter`` as (inputs, targets) on ``device``.

    On CUDA the copies are ``non_blocking``: from pinned host memory (a ``DataLoader`` with
    ``pin_memory=True``) they overlap the step's compute. An iterator over a list or tuple that holds more
    than ``count`` is refused (a step's own microbatches: the extra ones would be dropped without a word);
    any other iterator (a ``DataLoader``'s, kept across steps) gives ``count`` and keeps the rest.
    """
    if data_iter is None:
        raise ValueError(f"rank {rank} holds the first or last stage and needs a data iterator")
    non_blocking = device.type == "cuda"
    inputs, targets = [], []
    for k in range(count):
        try:
            item = next(data_iter)
        except StopIteration:
            raise ValueError(f"the data iterator ran out after {k} of {count} microbatches of step {step}") from None
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"the data iterator must yield (inputs, target) pairs, got {type(item).__name__}")
        inputs.append(to_device(item[0], device, non_blocking))
        targets.append(to_device(item[1], device, non_blocking))
    left = operator.length_hint(data_iter) if isinstance(data_iter, _CONTAINER_ITERATORS) else 0
    if left:
        raise ValueError(f"the data iterator of step {step} holds {count + left} microbatches, but a step takes "
                         f"{count} (microbatches={count}); give each step exactly its microbatches")
    return inputs, targets
