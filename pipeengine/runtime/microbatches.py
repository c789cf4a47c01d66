"""A step's microbatches: read from the user's iterator, checked, moved to the device, and cut into pieces when the
plan runs each as several ([Note: microbatch pieces])."""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterator, Sequence

import torch

from .tensors import flat, to_device, tree_map

__all__ = ["read_microbatches", "rows", "Pieces", "pieces_of", "merged", "loss_pieces", "PIECES", "per_piece"]

PIECES = (2, 4)   # the pieces a memory budget may cut a microbatch into
_CONTAINER_ITERATORS: tuple[type, ...] = (type(iter([])), type(iter(())))   # a step's microbatches as a list or tuple

# [Note: microbatch pieces]
# A memory budget may run each microbatch the user gives as k equal pieces along dim 0 (plan.py, _budget_plan):
# the schedule runs k times as many microbatches of a k-th the activations, and the step is the same. A loss is
# either a mean over its microbatch (cross-entropy's default: the pieces' losses are averaged, the step divides
# by the pieces) or a sum (GPT's packed rows: a sum over real tokens times a weight, added up, the step divides
# by the microbatches given). Which one, the profile finds on the sample's output (loss_pieces): the loss of
# the whole against its pieces' sum; a loss that is neither (a mean over tokens that differ per piece) is never
# cut. Limit: one sample decides; a mean over real tokens whose sample has no padding reads as a mean over rows.
# Equal pieces need every tensor of a microbatch with dims to have the same rows, a multiple of k (0-d tensors go
# to every piece). A microbatch may also come as its k pieces (Pieces): the trainer's packing, whose rows differ
# from one microbatch to the next, builds k times the microbatches, each of its own shape, with the weight of
# the microbatches given. A layer that reads the whole microbatch at once (batch norm's statistics) would change,
# so such models are never cut (plan.py). Dropout's masks are drawn per piece (rng.py keys them by microbatch),
# so a run with dropout draws other masks than one with whole microbatches.


def read_microbatches(data_iter: Iterator[Any] | None, count: int, device: torch.device, step: int,
                      rank: int, pieces: int = 1) -> tuple[list[Any], list[Any]]:
    """``count`` ``(inputs, target)`` pairs from ``data_iter`` as (inputs, targets) on ``device``, each cut into
    ``pieces`` ([Note: microbatch pieces]).

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
        if not isinstance(item, (tuple, list)) or (len(item) != 2 and not isinstance(item, Pieces)):
            raise TypeError(f"the data iterator must yield (inputs, target) pairs, got {type(item).__name__}")
        for x, t in pieces_of(item, pieces, f"microbatch {k} of step {step}"):
            inputs.append(to_device(x, device, non_blocking))
            targets.append(to_device(t, device, non_blocking))
    left = operator.length_hint(data_iter) if isinstance(data_iter, _CONTAINER_ITERATORS) else 0
    if left:
        raise ValueError(f"the data iterator of step {step} holds {count + left} microbatches, but a step takes "
                         f"{count} (microbatches={count}); give each step exactly its microbatches")
    return inputs, targets


def rows(item: Any) -> int | None:
    """The rows (dim 0) every tensor with dims in ``item`` has; None if they differ or there is none."""
    found = {t.shape[0] for t in flat(item) if t.dim()}
    return found.pop() if len(found) == 1 else None


class Pieces(tuple):   # type: ignore[type-arg]
    """A microbatch given as its pieces already, each an ``(inputs, target)`` pair of its own shape: what the
    trainer's packing builds when the plan runs pieces (its rows differ from microbatch to microbatch)."""


def pieces_of(item: Any, k: int, what: str = "the microbatch") -> list[tuple[Any, Any]]:
    """``(inputs, target)`` cut into ``k`` equal pieces along dim 0 (0-d tensors and non-tensors go to each), or
    the ``k`` pieces of a :class:`Pieces`."""
    if isinstance(item, Pieces):
        if len(item) != k:
            raise ValueError(f"{what} comes as {len(item)} pieces, but the plan runs each microbatch as {k}")
        return [(x, t) for x, t in item]
    if k == 1:
        return [(item[0], item[1])]
    n = rows(item)
    if n is None or n % k:
        has = f"{n} rows" if n is not None else "no rows all its tensors share"
        raise ValueError(f"{what} has {has}, but the memory budget's plan runs each microbatch as {k} equal pieces "
                         f"along its rows: give microbatches whose rows are a multiple of {k}, or plan without "
                         f"pieces (--whole-microbatches; the engine's cut_microbatches=False)")
    return [tree_map((item[0], item[1]), lambda t: t.chunk(k)[i] if t.dim() else t) for i in range(k)]


def merged(outputs: list[Any], k: int) -> list[Any]:
    """Per microbatch the outputs of its ``k`` pieces joined along dim 0 (as the pieces were cut)."""
    if k == 1:
        return outputs
    return [_joined(outputs[i:i + k]) for i in range(0, len(outputs), k)]


def _joined(parts: list[Any]) -> Any:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts) if parts[0].dim() else parts[0]
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_joined([p[j] for p in parts]) for j in range(len(parts[0])))
    return parts[0]


def loss_pieces(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: Any) -> dict[int, str]:
    """How ``loss_fn`` adds up over pieces of a microbatch ([Note: microbatch pieces]): for each k of
    :data:`PIECES` the rows divide into, "mean" (the pieces' losses average to the whole's) or "sum" (they add up
    to it); a k it is neither for is left out. Reads the losses to the host (planning, not a step)."""
    found: dict[int, str] = {}
    n = rows((output, target))
    try:
        whole = float(loss_fn(output, target))
    except Exception:
        return found
    for k in PIECES:
        if not n or n % k or not math.isfinite(whole) or whole == 0.0:
            continue
        try:   # a loss that fails on a piece is never cut
            total = sum(float(loss_fn(o, t)) for o, t in pieces_of((output, target), k))
        except Exception:
            continue
        for name, expected in (("mean", k * whole), ("sum", whole)):
            if abs(total - expected) <= 1e-3 * abs(expected):
                found[k] = name
    return found


def per_piece(facts: dict[str, Any], sizes: Sequence[float] | None, k: int) -> tuple[dict[str, Any], Any]:
    """The twin's facts and microbatch sizes of a run whose microbatches run as ``k`` pieces: a piece's input."""
    if k == 1:
        return facts, sizes
    return ({**facts, "input_bytes": facts.get("input_bytes", 0.0) / k},
            None if sizes is None else [z for z in sizes for _ in range(k)])
