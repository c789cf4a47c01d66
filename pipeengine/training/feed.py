"""What a rank reads each step: its replica's microbatches of the global batch, from examples by index, a torch
``Dataset`` or an ``IterableDataset``.

A model's data (``Model.data``, and ``Model.val_data`` for validation) may be:

- a map-style ``torch.utils.data.Dataset`` (``__len__`` and ``__getitem__`` giving ``(input, target)``):
  each step's global batch is a slice of a per-epoch permutation (data.py), read ahead by a
  ``DataLoader``;
- an ``IterableDataset``: a stream every reading rank iterates alike (it must give the same examples
  in the same order on every rank); step t takes the stream's next global batch, each replica its
  slice; a stream that ends starts again (a new epoch), and a resumed run skips the examples
  consumed. It is read in the training process (DataLoader workers would each see the whole stream);
- the engine's own protocol: ``num_examples(split)`` and ``example(split, index)`` for ``"train"``
  and ``"val"`` (the built-in models).

Without validation data the run skips validation (its loss is reported as n/a).

With a :class:`~pipeengine.training.packing.Packing` (``Model.packing``) the examples are token
sequences of their own lengths and the data says them (``lengths(split)``): a replica's sequences of
the step become its microbatches by the packing, every target carrying the step's weight
(microbatches / real tokens of the global batch, from the lengths: no message between the replicas).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, default_collate

from ..runtime.microbatches import Pieces
from .batch import Batch
from .data import (data_digest, example_crc, replica_batches, replica_examples, replica_share, split_microbatches,
                   step_indices, step_loader)

__all__ = ["DatasetSource", "Feed", "check_data"]


def _pair(item: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        size = f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
        raise ValueError(f"{where} is a {type(item).__name__}{size}, not an (input, target) pair; make the dataset "
                         f"return (input, target)")
    return item[0], item[1]


class DatasetSource:
    """Map-style datasets as the engine's protocol: ``train`` for training, ``val`` (or None) for validation."""

    def __init__(self, train: Any, val: Any = None) -> None:
        self.splits = {"train": train, "val": val}
        self._lengths: dict[str, torch.Tensor] = {}

    def num_examples(self, split: str) -> int:
        ds = self.splits[split]
        return 0 if ds is None else len(ds)

    def example(self, split: str, index: int) -> tuple[Any, Any]:
        return _pair(self.splits[split][index], f"Model.{'data' if split == 'train' else 'val_data'}[{index}]")

    def lengths(self, split: str) -> torch.Tensor:
        """Each example's tokens, from the dataset's own ``lengths()`` (a packing needs them), read once."""
        if split not in self._lengths:
            self._lengths[split] = torch.as_tensor(self.splits[split].lengths())
        return self._lengths[split]


def _streamed(data: Any) -> bool:
    return isinstance(data, IterableDataset) or (hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
                                                 and not hasattr(data, "num_examples"))


def check_data(data: Any, name: str = "Model.data") -> None:
    """Raise a ValueError (one line) unless ``data`` is a Dataset, an IterableDataset or the engine's protocol."""
    if data is None or _streamed(data) or all(callable(getattr(data, m, None)) for m in ("num_examples", "example")):
        return
    if callable(getattr(data, "__getitem__", None)) and callable(getattr(data, "__len__", None)):
        return
    raise ValueError(f"{name} must be a torch.utils.data.Dataset (__len__ and __getitem__ giving (input, target)), "
                     f"an IterableDataset, or have num_examples(split) and example(split, index) (got "
                     f"{type(data).__name__})")


class _Stream:
    """An iterable's examples from a position on, starting it again when it ends (a new epoch)."""

    def __init__(self, data: Any, position: int, name: str) -> None:
        self.data, self.name = data, name
        self.it: Iterator[Any] = iter(data)
        for _ in range(position):
            self.next()

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.data)
            try:
                return next(self.it)
            except StopIteration:
                raise ValueError(f"{self.name} gives no examples") from None

    def take(self, count: int) -> list[Any]:
        return [self.next() for _ in range(count)]


class Feed:
    """One rank's data for every step (see the module docstring): ``train(step)`` the replica's microbatches and
    the seconds waited for them, ``val(step)`` its validation microbatches (None without validation data),
    ``position(step)`` the examples consumed before ``step``."""

    def __init__(self, data: Any, val: Any, seed: int, batch: Batch, dp: int, replica: int, steps: int,
                 workers: int, cuda: bool, packing: Any = None) -> None:
        self.stream = _streamed(data)
        if packing is not None and (self.stream or not callable(getattr(data, "lengths", None))):
            raise ValueError("Model.packing needs examples by index with lengths(split), or a Dataset with "
                             "lengths() (each example's tokens); a stream cannot be packed ahead")
        if not self.stream and not hasattr(data, "num_examples"):
            data = DatasetSource(data, val)
        if packing is not None and packing.one_row and cuda:   # one row of many sequences: for the CPU (packing.py)
            packing = replace(packing, one_row=False)
        self.packing = packing
        self.data, self.val_data, self.seed, self.batch = data, val, seed, batch
        self.dp, self.replica, self.steps, self.workers, self.cuda = dp, replica, steps, workers, cuda
        self.start = (0, 0)   # (step, examples consumed before it): set by resume
        self.pieces = 1   # each microbatch's pieces, when the plan runs them (the trainer sets it after planning)
        self._loader: Any = None
        self._next_step = -1

    @property
    def has_val(self) -> bool:
        if self.stream:
            return self.val_data is not None
        return bool(self.data.num_examples("val") > 0)

    def position(self, step: int) -> int:
        """The data position at ``step``: the examples consumed before it (a resumed run goes on from its
        checkpoint's, whatever the global batch was then)."""
        first, examples = self.start
        return examples + (step - first) * self.batch.size

    def _mine(self, examples: list[Any]) -> list[tuple[Any, Any]]:
        mine = replica_share(torch.arange(len(examples)), self.batch, self.dp, self.replica).tolist()
        collated = default_collate([_pair(examples[i], "an example of Model.data") for i in mine])
        return split_microbatches(collated, self.batch.counts(self.dp)[self.replica])

    def _shares(self, split: str, start: int) -> list[list[int]]:
        """Each replica's example lengths in the global batch at data position ``start``."""
        idx, lengths = step_indices(self.data, split, start, self.seed, self.batch.size), self.data.lengths(split)
        return [lengths[replica_share(idx, self.batch, self.dp, r)].tolist() for r in range(self.dp)]

    def _built(self, examples: list[Any], split: str, start: int, pieces: int = 1) -> list[Any]:
        """The replica's microbatches of its ``examples`` by the packing (the global batch at ``start``); with
        ``pieces``, each as that many built by the packing, each of its own shape, the weight the microbatches'
        ([Note: microbatch pieces] in runtime/microbatches.py: their rows differ, so they are not cut)."""
        counts = self.batch.counts(self.dp)
        real = sum(sum(share) for share in self._shares(split, start))
        built: list[Any] = self.packing.build(examples, counts[self.replica] * pieces, sum(counts) / max(real, 1))
        return built if pieces == 1 else [Pieces(built[i:i + pieces]) for i in range(0, len(built), pieces)]

    def tokens(self, step: int) -> tuple[int, int, int]:
        """The real tokens of step ``step``'s global batch, the positions computed for them (padding included) and
        the sum of its sequences' squared lengths (their attention), over every replica (with a packing; else
        zeros)."""
        if self.packing is None:
            return 0, 0, 0
        shares, counts = self._shares("train", self.position(step)), self.batch.counts(self.dp)
        return (sum(sum(s) for s in shares),
                sum(self.packing.positions(s, counts[r] * self.pieces) for r, s in enumerate(shares)),
                sum(n * n for s in shares for n in s))

    def sizes(self) -> list[float] | None:
        """With a packing: the microbatches of replica 0 (the largest count) of the data's first global batch, which
        :meth:`sample` gives the first of, each one's positions relative to that first's (a cost per token: the
        split, auto's choice and the predicted step follow the lengths); else None."""
        if self.packing is None:
            return None
        shapes = self.packing.shapes(self._shares("train", 0)[0], self.batch.counts(self.dp)[0])
        return [rows * width / (shapes[0][0] * shapes[0][1]) for rows, width in shapes]

    def sample(self) -> tuple[Any, Any]:
        """The run's first microbatch (what the profile partition times)."""
        if self.packing is not None:
            first: tuple[Any, Any] = self._built(replica_examples(self.data, "train", 0, self.seed, self.batch,
                                                                  self.dp, 0), "train", 0)[0]   # (whole)
            return first
        if self.stream:
            return split_microbatches(default_collate([_pair(e, "an example of Model.data") for e in
                                                       _Stream(self.data, 0, "Model.data").take(self.batch.micro)]),
                                      1)[0]
        return replica_batches(self.data, "train", 0, self.seed, self.batch, self.dp, 0)[0]

    def first_input(self) -> Any:
        """One example's input (the model's FLOPs are counted on it)."""
        if self.stream:
            return _pair(_Stream(self.data, 0, "Model.data").next(), "an example of Model.data")[0]
        return self.data.example("train", 0)[0]

    def digest(self) -> str:
        """What the ranks compare to know they read the same data."""
        if self.stream:
            return f"a stream, first example crc32 {example_crc(_Stream(self.data, 0, 'Model.data').next()):08x}"
        return data_digest(self.data)

    def train(self, step: int) -> tuple[Iterator[Any], float]:
        """Step ``step``'s microbatches for this replica and the seconds spent waiting for them (read ahead by a
        DataLoader with ``workers``; a stream in this process)."""
        t = time.perf_counter()
        if self._loader is None or step != self._next_step:   # the first step, or steps taken out of order
            self.close()
            if self.stream:
                stream = _Stream(self.data, self.position(step), "Model.data")
                self._loader = (stream.take(self.batch.size) for _ in itertools.count())
            else:
                self._loader = iter(step_loader(self.data, self.seed, self.batch, self.dp, self.replica, step,
                                                self.steps, self.position(step), self.workers, pin_memory=self.cuda,
                                                collate=default_collate if self.packing is None else list))
        got = next(self._loader)
        self._next_step = step + 1
        if self.packing is not None:
            mbs = self._built(got, "train", self.position(step), self.pieces)
        else:
            mbs = self._mine(got) if self.stream else split_microbatches(got, self.batch.counts(self.dp)[self.replica])
        return iter(mbs), time.perf_counter() - t

    def val(self, step: int) -> Iterator[Any] | None:
        """Step ``step``'s validation microbatches for this replica (a stream: its first global batch)."""
        if not self.has_val:
            return None
        if self.stream and _streamed(self.val_data):
            return iter(self._mine(_Stream(self.val_data, 0, "Model.val_data").take(self.batch.size)))
        source = self.data if not self.stream else DatasetSource(None, self.val_data)
        if self.packing is not None:
            examples = replica_examples(source, "val", step * self.batch.size, self.seed, self.batch, self.dp,
                                        self.replica)
            return iter(self._built(examples, "val", step * self.batch.size, self.pieces))
        return iter(replica_batches(source, "val", step * self.batch.size, self.seed, self.batch, self.dp,
                                    self.replica))

    def close(self) -> None:
        """Stop the loader's worker processes (if any)."""
        self._loader, self._next_step = None, -1
