"""The links between pipeline neighbours: what a transfer across each costs, measured at start or stated.

[Note: links in the plan]
The planner, ``auto`` and the predicted step simulate transfers as well as compute. Before the layer
profile every pair of neighbouring positions (p, p + 1, and pp - 1 with 0 for the looping placement's
wrap) ping-pongs on the pipeline's own process group and device: a 4-byte tensor for the latency (half the
round trip) and a 4 MiB one for the bandwidth (its one-way time less the latency), each the median of a
few round trips. Pairs of one phase are disjoint (even hops, odd hops, then the wrap), so no rank is in two
exchanges at once and the sends cannot deadlock. Every replica measures its own pipeline; the plan takes,
per hop, the slowest replica's figures. A transfer of n bytes across hop h then costs ``latency[h] + n /
bandwidth[h]``, with n the boundary layer's output per microbatch: a split can put a boundary where the
activation is small or the link fast. ``--link-gbps`` states every link's bandwidth instead (latency 0).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # Links is torch-free (the planner and the schedule tool use it); measuring is not
    import torch

    from .topology import Topology

__all__ = ["Links", "measure_links", "stated_links", "fixed_links", "links_for"]

BIG = 4 * 2**20   # bytes of the bandwidth probe
ROUNDS = 5


@dataclass(frozen=True)
class Links:
    """Per hop h (positions h and (h + 1) % pp; one hop at pp 2): latency in seconds and bandwidth in bytes/s."""

    latency: tuple[float, ...]
    bandwidth: tuple[float, ...]
    how: str = "measured"   # or "stated" (--link-gbps), "given" (a fixed cost per transfer)

    @property
    def pp(self) -> int:
        """Positions: one per hop, but two for the single hop of pp 2."""
        return len(self.latency) if len(self.latency) > 1 else 2

    def hop(self, p: int, q: int) -> int:
        """The hop between neighbouring positions p and q."""
        pp = self.pp
        if q == (p + 1) % pp:
            return p % len(self.latency)
        if p == (q + 1) % pp:
            return q % len(self.latency)
        raise ValueError(f"positions {p} and {q} are not pipeline neighbours (pp={pp})")

    def seconds(self, p: int, q: int, nbytes: float) -> float:
        """What one transfer of ``nbytes`` between positions p and q takes (0 on one position)."""
        if p == q:
            return 0.0
        h = self.hop(p, q)
        return self.latency[h] + nbytes / self.bandwidth[h]

    def describe(self) -> str:
        hops = ", ".join(f"{h}<->{(h + 1) % self.pp} {1e6 * lat:.0f} us {bw * 8 / 1e9:.2f} Gbit/s"
                         for h, (lat, bw) in enumerate(zip(self.latency, self.bandwidth)))
        return f"links ({self.how}; latency, bandwidth): {hops}"


def _hops(pp: int) -> int:
    return 1 if pp <= 2 else pp


def stated_links(pp: int, gbps: float) -> Links:
    """Every link at ``gbps`` Gbit/s, no latency (``--link-gbps``)."""
    if not gbps > 0:
        raise ValueError(f"link bandwidth must be > 0 Gbit/s (got {gbps!r})")
    n = _hops(pp)
    return Links((0.0,) * n, (gbps * 1e9 / 8,) * n, "stated")


def fixed_links(pp: int, seconds: float) -> Links:
    """Every transfer takes ``seconds`` whatever its size (the schedule tool's ``--comm``)."""
    n = _hops(pp)
    return Links((seconds,) * n, (float("inf"),) * n, "given")


def links_for(topology: Topology, device: torch.device, gbps: float | None) -> Links | Callable[[], Links]:
    """The engine's links: as stated (``gbps``), or measured when the plan needs them (make_plan calls it)."""
    return stated_links(topology.pp, gbps) if gbps is not None else functools.partial(measure_links, topology, device)


def measure_links(topology: Topology, device: torch.device) -> Links:
    """Every hop's latency and bandwidth, on every rank (collective over the default group; see the note)."""
    import torch
    import torch.distributed as dist

    from .agree import gathered

    pp, rank = topology.pp, dist.get_rank()
    position, replica = topology.position_of(rank), topology.replica_of(rank)
    n = _hops(pp)
    phases = [[h for h in range(min(n, pp - 1)) if h % 2 == k] for k in (0, 1)] + ([[pp - 1]] if n > 1 else [])
    mine: dict[int, tuple[float, float]] = {}
    small = torch.zeros(1, device=device)
    big = torch.zeros(BIG // 4, device=device)
    for phase in phases:
        for h in phase:
            a, b = h, (h + 1) % pp
            if position in (a, b):
                peer = topology.rank(b if position == a else a, replica)
                latency = _one_way(small, peer, position == a, device)
                one_way = _one_way(big, peer, position == a, device)
                if position == a:
                    mine[h] = (latency, BIG / max(one_way - latency, 1e-9))
    everyone = gathered(mine, None)
    return Links(tuple(max(got[h][0] for got in everyone if h in got) for h in range(n)),
                 tuple(min(got[h][1] for got in everyone if h in got) for h in range(n)))


def _one_way(t: torch.Tensor, peer: int, first: bool, device: torch.device) -> float:
    """Half the median round trip of ``t`` to ``peer`` and back (one warm-up exchange first)."""
    import torch.distributed as dist

    from .device import synchronize
    trips = []
    for i in range(ROUNDS + 1):
        t0 = time.perf_counter()
        if first:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        synchronize(device)
        if i:
            trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2
