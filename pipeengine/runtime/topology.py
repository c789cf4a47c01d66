"""The PP x DP rank grid: rank <-> (position, replica), and every process group built in one fixed order.

The rank math is torch-free; only :func:`build_groups` needs torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Topology", "TopologyError", "ProcessGroups", "build_groups"]

ORDERS = ("position-major", "replica-major")


class TopologyError(ValueError):
    """A PP x DP grid that does not fit the world, or a rank/position/replica out of range."""


@dataclass(frozen=True)
class Topology:
    """``pp`` pipeline positions x ``dp`` replicas. Pure rank math: no process group needed.

    ``order="position-major"`` (default): ``rank = position * dp + replica``, so a position's DP group is
    contiguous ranks (all-reduce stays inside a node when dp <= GPUs per node).
    ``order="replica-major"``: ``rank = replica * pp + position``, so a pipeline is contiguous ranks.
    """

    pp: int
    dp: int = 1
    order: str = "position-major"

    def __post_init__(self) -> None:
        for name in ("pp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TopologyError(f"{name} must be an integer >= 1 (got {v!r})")
        if self.order == "stage-major":   # the name before the glossary
            object.__setattr__(self, "order", "position-major")
        if self.order not in ORDERS:
            raise TopologyError(f"order must be one of {ORDERS} (got {self.order!r})")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @classmethod
    def from_world(cls, world_size: int, pp: int | None = None, dp: int | None = None,
                   order: str = "position-major") -> "Topology":
        """Derive the missing degree from the world size; all ranks in one pipeline by default."""
        if world_size < 1:
            raise TopologyError(f"world size must be >= 1 (got {world_size})")
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        if pp is None and dp is None:
            pp, dp = world_size, 1
        elif pp is None:
            assert dp is not None
            if dp < 1 or world_size % dp:
                raise TopologyError(f"world size {world_size} is not divisible by dp={dp}; use dp in {divisors}")
            pp = world_size // dp
        elif dp is None:
            if pp < 1 or world_size % pp:
                raise TopologyError(f"world size {world_size} is not divisible by pp={pp}; use pp in {divisors} "
                                    f"or launch a multiple of {pp} ranks")
            dp = world_size // pp
        if pp * dp != world_size:
            raise TopologyError(f"pp={pp} x dp={dp} = {pp * dp} ranks, but the world has {world_size}; "
                                f"pick pp*dp = {world_size}")
        return cls(pp, dp, order)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1} (pp={self.pp} x dp={self.dp})")

    def rank(self, position: int, replica: int) -> int:
        if not 0 <= position < self.pp:
            raise TopologyError(f"position {position} is outside 0..{self.pp - 1}")
        if not 0 <= replica < self.dp:
            raise TopologyError(f"replica {replica} is outside 0..{self.dp - 1}")
        return position * self.dp + replica if self.order == "position-major" else replica * self.pp + position

    def position_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.dp if self.order == "position-major" else rank % self.pp

    def replica_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.dp if self.order == "position-major" else rank // self.pp

    def dp_group_ranks(self, position: int) -> list[int]:
        """The replicas of ``position``, by replica."""
        return [self.rank(position, r) for r in range(self.dp)]

    def pp_group_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, by position."""
        return [self.rank(s, replica) for s in range(self.pp)]

    def next_rank(self, rank: int) -> int | None:
        s = self.position_of(rank)
        return None if s == self.pp - 1 else self.rank(s + 1, self.replica_of(rank))

    def prev_rank(self, rank: int) -> int | None:
        s = self.position_of(rank)
        return None if s == 0 else self.rank(s - 1, self.replica_of(rank))

    def is_first_position(self, rank: int) -> bool:
        return self.position_of(rank) == 0

    def is_last_position(self, rank: int) -> bool:
        return self.position_of(rank) == self.pp - 1

    def tie_group_ranks(self, positions: Sequence[int], replica: int) -> list[int]:
        """Ranks of one replica holding the given positions (sorted, unique)."""
        return sorted({self.rank(s, replica) for s in positions})

    def describe(self) -> str:
        """A small grid: one row per position, one column per replica, cells are ranks."""
        width = len(str(self.world_size - 1))
        head = f"pp={self.pp} x dp={self.dp} = {self.world_size} ranks ({self.order})"
        cols = " ".join(f"r{r:<{width}}" for r in range(self.dp))
        rows = [f"             {cols}"] + [
            f"position {s:<3} " + " ".join(f"{self.rank(s, r):>{width + 1}}" for r in range(self.dp))
            for s in range(self.pp)]
        return "\n".join([head] + rows)


@dataclass
class ProcessGroups:
    """This rank's groups. Passed explicitly wherever needed: no module-level singletons."""

    topology: Topology
    rank: int
    position: int
    replica: int
    dp_group: Any
    pp_group: Any
    tie_groups: dict[tuple[int, ...], Any] = field(default_factory=dict)


def build_groups(topology: Topology, rank: int | None = None,
                 ties: Sequence[Sequence[int]] = ()) -> ProcessGroups:
    """Create every group with ``dist.new_group`` and return this rank's.

    Why one fixed order: ``new_group`` is collective over the whole world, every rank must call it
    for every group, including those it is not in, in the same sequence, or ranks pair up different
    calls and hang. The order is: one DP group per position (0..pp-1), one pipeline group per replica
    (0..dp-1), then for each tie (a tuple of positions whose ranks share a parameter) one group per
    replica. A tie touching a single position needs no group.
    """
    import torch.distributed as dist   # here: the rank math above is torch-free (the trainer's config uses it)
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed initialised (dist.init_process_group)")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise TopologyError(f"topology pp={topology.pp} x dp={topology.dp} = {topology.world_size} ranks, "
                            f"but the world has {world}")
    rank = dist.get_rank() if rank is None else rank
    position, replica = topology.position_of(rank), topology.replica_of(rank)
    dp_group = pp_group = None
    for s in range(topology.pp):
        g = dist.new_group(topology.dp_group_ranks(s))
        if s == position:
            dp_group = g
    for r in range(topology.dp):
        g = dist.new_group(topology.pp_group_ranks(r))
        if r == replica:
            pp_group = g
    tie_groups: dict[tuple[int, ...], Any] = {}
    made: set[tuple[int, ...]] = set()   # the same on every rank, unlike tie_groups
    for tie in ties:
        positions = tuple(sorted(set(tie)))
        if len(positions) < 2 or positions in made:
            continue
        made.add(positions)
        for r in range(topology.dp):
            g = dist.new_group(topology.tie_group_ranks(positions, r))
            if r == replica and position in positions:
                tie_groups[positions] = g
    return ProcessGroups(topology, rank, position, replica, dp_group, pp_group, tie_groups)
