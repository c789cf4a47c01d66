"""A language-model step's variable-length sequences as a replica's microbatches: padded, packed or ragged.

Each sequence is an (input, target) pair of 1-D int64 token tensors of one length n, 1 <= n <= the context.
Pure functions over the lengths decide the layout (microbatch -> rows -> the sequences in each row);
:meth:`Packing.build` makes the tensors. A padded position's target is :data:`IGNORE` (cross_entropy's
``ignore_index``), its input token ``pad_id``. Three modes:

- ``pad``: one sequence a row, padded to the context; the sequences in their given order, cut into
  ``count`` contiguous microbatches as equal as possible (larger ones first). Simple, and wasteful when
  most sequences are much shorter than the context.
- ``pack``: several sequences a row of ``context`` positions, placed by first-fit decreasing; the input is
  (tokens, positions, segments), positions restarting at 0 at each sequence and segments numbering the
  sequences of a row (-1 at pads), for a model that keeps attention within a segment. Rows are split
  until there are ``count`` of them at least, then cut into contiguous microbatches.
- ``ragged``: each microbatch of its own shape, of about equal cost (a sequence costs len x (len +
  ``linear_cost``): its attention and the rest). Two layouts, for where the model runs:

  - ``one_row`` (for CPU, where a model attends each sequence alone cheaply): each microbatch one row, its
    sequences end to end with nothing between or after them, the input as for ``pack``: no padding at all.
    The sequences go to the microbatches costliest first, each to the one that costs least so far
    (longest-processing-time first): the costliest microbatch exceeds the least by one sequence's cost at
    most. The widest come first.
  - one sequence a row (the default; for an accelerator, where a row of many sequences would take a kernel
    call per sequence or a mask over the whole row, and for short contexts): each microbatch as wide as its
    longest sequence, the input a [rows, width] token tensor. The sequences, longest first, cut into
    ``count`` contiguous groups so that the costliest microbatch, rows x L x (L + ``linear_cost``) for a group
    of longest length L, costs as little as possible; the longest come first.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["MODES", "IGNORE", "Packing"]

MODES = ("pad", "pack", "ragged")
IGNORE = -100   # the target of a padded position (cross_entropy's ignore_index)

Layout = list[list[list[int]]]   # microbatch -> rows -> indices of the sequences in that row, in order


@dataclass(frozen=True)
class Packing:
    """How a step's sequences become a replica's microbatches (see the module docstring for the modes)."""

    mode: str                 # one of MODES
    context: int              # positions per row (>= 1)
    pad_id: int = 0           # input token at padded positions
    linear_cost: float = 0.0  # ragged: a position's cost besides attention, in units of one attended position
    one_row: bool = False     # ragged: a microbatch's sequences end to end in one row (CPU), or one a row

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"packing mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.context < 1:
            raise ValueError(f"the context is {self.context} positions; it must be at least 1")
        if not (math.isfinite(self.linear_cost) and self.linear_cost >= 0):
            raise ValueError(f"linear_cost is {self.linear_cost}; it must be finite and at least 0")
        if self.one_row and self.mode != "ragged":
            raise ValueError(f"one_row is a layout of ragged microbatches, not of {self.mode!r} ones")

    def layout(self, lengths: Sequence[int], count: int) -> Layout:
        """Which sequences (indices into ``lengths``) sit in each row of each of the ``count`` microbatches."""
        self._check(lengths, count)
        if self.mode == "pad":
            return _chunks([[i] for i in range(len(lengths))], count)
        if self.mode == "pack":
            return _chunks(_split_largest(_first_fit_decreasing(lengths, self.context), count), count)
        if self.one_row:
            return [[group] for group in _balanced(lengths, count, self.linear_cost)]
        return [[[i] for i in group] for group in _ragged_groups(lengths, count, self.linear_cost)]

    def shapes(self, lengths: Sequence[int], count: int) -> list[tuple[int, int]]:
        """(rows, width) of each microbatch."""
        return [(len(rows), self._width(lengths, rows)) for rows in self.layout(lengths, count)]

    def positions(self, lengths: Sequence[int], count: int) -> int:
        """The positions the microbatches compute, padding included: the sum of rows x width."""
        return sum(rows * width for rows, width in self.shapes(lengths, count))

    def build(self, examples: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int, weight: float
              ) -> list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]]:
        """The ``count`` microbatches of ``examples``: (input, (labels, weight)), the input a [rows, width]
        token tensor, or for ``pack`` and one-row ``ragged`` the tuple (tokens, positions, segments); labels are
        the targets, IGNORE at pads; weight is ``weight`` as a 0-d float32 tensor, the same one in every
        microbatch."""
        for i, (x, y) in enumerate(examples):
            if x.dim() != 1 or x.shape != y.shape:
                raise ValueError(f"example {i}: input {tuple(x.shape)} and target {tuple(y.shape)}; "
                                 "each must be one sequence of the same length")
        lengths = [len(x) for x, _ in examples]
        w = torch.tensor(weight, dtype=torch.float32)
        out: list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = []
        for rows in self.layout(lengths, count):
            tokens, labels, positions, segments = self._fill(examples, rows, self._width(lengths, rows))
            out.append(((tokens, positions, segments) if self.segmented else tokens, (labels, w)))
        return out

    def _check(self, lengths: Sequence[int], count: int) -> None:
        if count < 1 or len(lengths) < count:
            raise ValueError(f"a replica needs at least one sequence per microbatch (and one microbatch at least): "
                             f"{len(lengths)} sequences for {count} microbatches")
        for i, n in enumerate(lengths):
            if n > self.context:
                raise ValueError(f"sequence {i} is {n} tokens long, longer than the context of {self.context}")
            if n < 1:
                raise ValueError(f"sequence {i} is {n} tokens long; a sequence holds one token at least")

    @property
    def segmented(self) -> bool:
        """Rows of several sequences: the input carries positions and segments."""
        return self.mode == "pack" or self.one_row

    def _width(self, lengths: Sequence[int], rows: list[list[int]]) -> int:
        """A microbatch's width: the context; for ``ragged`` its one row's sequences together, or one a row its
        first (longest) sequence's length."""
        if self.mode != "ragged":
            return self.context
        return sum(lengths[i] for i in rows[0]) if self.one_row else lengths[rows[0][0]]

    def _fill(self, examples: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: list[list[int]], width: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One microbatch's tokens, labels, positions and segments, [len(rows), width] each (positions and segments
        filled only for rows of several sequences: one sequence a row needs neither)."""
        shape = (len(rows), width)
        tokens = torch.full(shape, self.pad_id, dtype=torch.int64)
        labels = torch.full(shape, IGNORE, dtype=torch.int64)
        positions = torch.zeros(shape, dtype=torch.int64)
        segments = torch.full(shape, -1, dtype=torch.int64)
        packed = self.segmented
        for r, row in enumerate(rows):
            start = 0
            for slot, i in enumerate(row):
                x, y = examples[i]
                end = start + len(x)
                tokens[r, start:end] = x
                labels[r, start:end] = y
                if packed:
                    positions[r, start:end] = torch.arange(len(x))
                    segments[r, start:end] = slot
                start = end
        return tokens, labels, positions, segments


def _chunks(items: list[list[int]], count: int) -> Layout:
    """``items`` cut into ``count`` contiguous pieces whose sizes differ by one at most, the larger first."""
    size, extra = divmod(len(items), count)
    out, start = [], 0
    for k in range(count):
        end = start + size + (k < extra)
        out.append(items[start:end])
        start = end
    return out


def _split_largest(groups: list[list[int]], count: int) -> list[list[int]]:
    """While there are fewer than ``count`` groups, the one holding the most (the first of equals) becomes two:
    its first half (the larger when odd) and its second, in its place. Needs ``count`` items at least."""
    groups = list(groups)
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        half = (len(groups[k]) + 1) // 2
        groups[k:k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def _by_length(lengths: Sequence[int]) -> list[int]:
    """Indices of ``lengths``, longest first, equal lengths by index."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _first_fit_decreasing(lengths: Sequence[int], context: int) -> list[list[int]]:
    """The sequences packed into rows of ``context`` positions: longest first, each whole into the first row with
    room. A max-tree over the rows' room finds that row in O(log n) (unopened rows have all the room, so the
    first of them is the next one opened)."""
    size = 1 << max(0, len(lengths) - 1).bit_length()   # leaves: n rows at most
    room = [context] * (2 * size)
    rows: list[list[int]] = []
    for i in _by_length(lengths):
        n, node = lengths[i], 1
        while node < size:
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        room[node] -= n
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
    return rows


def _balanced(lengths: Sequence[int], count: int, linear_cost: float) -> list[list[int]]:
    """The sequences in ``count`` groups of about equal cost, len x (len + linear_cost) each: costliest first
    (equal costs by index), each to the group that costs least so far (the first of equals); a group's sequences
    in the order they came; the groups widest first (the first is what the profile times: memory is planned by
    the largest). Every group gets one at least when there are ``count`` sequences or more."""
    costs = [n * (n + linear_cost) for n in lengths]
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [(0.0, g) for g in range(count)]   # a heap of (cost so far, group)
    for i in _by_length(lengths):   # costliest first: the cost grows with the length
        load, g = heapq.heappop(loads)
        groups[g].append(i)
        heapq.heappush(loads, (load + costs[i], g))
    return sorted(groups, key=lambda group: -sum(lengths[i] for i in group))


def _ragged_groups(lengths: Sequence[int], count: int, linear_cost: float) -> list[list[int]]:
    """The sequences, longest first, cut into ``count`` contiguous groups minimising the largest group cost,
    rows x L x (L + linear_cost) (L the group's first length): found by bisection on that bound, to within 1e-9
    relative (each feasible bound lowered to the cost it achieved, so the answer is a real partition's), each
    bound tried by the greedy cut, optimal since a part of a group never costs more than the group."""
    order = _by_length(lengths)
    unit = [lengths[i] * (lengths[i] + linear_cost) for i in order]   # one row's cost in a group led by i
    best = [(0, len(order))]
    lo, hi = 0.0, len(order) * unit[0]   # no cut fits in 0; one group costs hi
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        cut = _greedy(unit, mid, count)
        if cut is None:
            lo = mid
        else:
            best, hi = cut, max((end - start) * unit[start] for start, end in cut)
    groups = [order[start:end] for start, end in best]
    return _split_largest(groups, count)


def _greedy(unit: list[float], bound: float, count: int) -> list[tuple[int, int]] | None:
    """The greedy cut of ``len(unit)`` sorted sequences under ``bound``: each group as long as its cost, rows x
    its first ``unit``, stays within the bound, as (start, end) pairs; None if that takes more than ``count``."""
    cut: list[tuple[int, int]] = []
    start, n = 0, len(unit)
    while start < n:
        if len(cut) == count:
            return None
        w = unit[start]
        rows = min(int(bound // w), n - start)
        while rows < n - start and (rows + 1) * w <= bound:   # float division may round either way
            rows += 1
        while rows > 0 and rows * w > bound:
            rows -= 1
        if rows == 0:
            return None
        cut.append((start, start + rows))
        start += rows
    return cut
