"""What the wire (wire.py) moves: a transfer, the receives a comm step posts early, the error of one that never came."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..schedule import Action, Kind, Step
from .faults import WaitTimeout
from .header import Tensors

__all__ = ["P2PTimeout", "Transfer", "Ahead", "receives_ahead", "posts_early"]


class P2PTimeout(WaitTimeout):
    """A transfer did not complete in time; the message names the op, the peer, the wait and who waits on whom."""


@dataclass
class Transfer:
    """One comm action on the wire: its tensors, its place in the link's order, its works."""

    action: Action
    rank: int                                   # the other side's global rank (Action.peer is its position)
    tensors: Tensors                            # send: what goes out; recv: the buffers
    seq: int = 0                                # position in this step's posting (= link) order
    works: list[Any] = field(default_factory=list)
    done: bool = False
    moved: bool = False                         # a first payload on tags of its own ([Note: the first payload ...])


Ahead = tuple[tuple[int, Action], ...]   # a comm step's receives, each with its place in the step


def receives_ahead(program: Sequence[Step]) -> list[Ahead]:
    """Per comm step of ``program``, the payload receives of the next one with their places in it (none after the
    last): what the step posts early in tags mode ([Note: receives one step early])."""
    comm = [st for st in program if not st[0].kind.is_compute]
    return [tuple((i, a) for i, a in enumerate(nxt) if a.kind in (Kind.RECV_F, Kind.RECV_B)) for nxt in comm[1:]] + [()]


def posts_early(mode: str, coalesce: bool) -> bool:
    """Whether a wire of ``mode`` posts a comm step's receives with the step before ([Note: receives one step
    early]): in tags mode, not on NCCL."""
    return mode == "tags" and not coalesce
