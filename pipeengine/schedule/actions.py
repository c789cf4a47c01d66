"""Schedule data: actions, one program per pipeline position, stage placement, and their text form."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Container, NamedTuple, Sequence

__all__ = [
    "Kind", "Action", "Step", "Schedule", "ScheduleError", "PLACEMENTS",
    "parse_schedule", "format_schedule", "format_grid", "steps_of",
]


class ScheduleError(ValueError):
    """A schedule that is malformed, incomplete, mis-paired or deadlocks; the message says where."""


class Kind(str, enum.Enum):
    """What an action does. Compute kinds run a stage; comm kinds move data to a neighbour."""

    F = "F"            # forward of one microbatch through one chunk
    B = "B"            # backward: input-grad only when its W is in the schedule, else the full backward
    W = "W"            # weight-grad part of a split backward (zero-bubble)
    SEND_F = "sendF"   # send this chunk's output activation to the next stage
    RECV_F = "recvF"   # receive this chunk's input activation from the previous stage
    SEND_B = "sendB"   # send the gradient of this chunk's input to the previous stage
    RECV_B = "recvB"   # receive the gradient of this chunk's output from the next stage
    SEND_H = "sendH"   # send the shape header of this chunk's output stream (once per step, before its first sendF)
    RECV_H = "recvH"   # receive the shape header of this chunk's input stream (once per step, before its first recvF)

    is_compute: bool   # F, B or W (set below as plain attributes: the simulator asks millions of times)
    is_send: bool

    def __str__(self) -> str:
        return str.__str__(self)


for _kind in Kind:
    _kind.is_compute = _kind in (Kind.F, Kind.B, Kind.W)
    _kind.is_send = _kind in (Kind.SEND_F, Kind.SEND_B, Kind.SEND_H)


_COMPUTE_RE = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")
_COMM_RE = re.compile(r"^(send|recv)([FBH])(\d+)(?:\.(\d+))?([<>])(\d+)$")


class Action(NamedTuple):
    """One action at one pipeline position: ``F3`` (chunk 0), ``B3.1`` (chunk 1), ``sendF3>1`` (to position 1).

    Schedule data speaks of positions (0..pp-1 along one pipeline), never of process ranks: every
    replica runs the same programs. ``chunk`` is the index of a stage on its position (see
    :class:`Schedule` for which stage that is). For comm actions it is the local chunk whose data
    moves (the producer's chunk on a send, the consumer's chunk on a recv) and ``peer`` is the
    position of the other side.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int = -1

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        if self.kind.is_compute:
            return f"{self.kind.value}{self.microbatch}{chunk}"
        arrow = ">" if self.kind.is_send else "<"
        return f"{self.kind.value}{self.microbatch}{chunk}{arrow}{self.peer}"

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of ``str()``: ``Action.parse("recvB2.1<3")``."""
        t = text.strip()
        m = _COMPUTE_RE.match(t)
        if m:
            return Action(Kind(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        m = _COMM_RE.match(t)
        if m:
            op, fb, mb, chunk, arrow, peer = m.groups()
            if (op == "send") != (arrow == ">"):
                raise ScheduleError(f"action {t!r}: a send points '>' to its peer, a recv '<' from it")
            return Action(Kind(op + fb), int(mb), int(chunk or 0), int(peer))
        raise ScheduleError(
            f"cannot parse action {t!r}: expected F3, B3, W3 (optionally with a chunk, F3.1), or a "
            f"comm action like sendF3>1, recvF3<0, sendB3>0, recvB3<1, sendH0>1, recvH0<0")


Step = tuple[Action, ...]
"""One step of a position's program: a single compute action, or a batch of comm actions posted
together (one coalesced ``batch_isend_irecv`` on NCCL, one call per op on Gloo: see runtime/wire.py)."""


PLACEMENTS = ("loop", "v")


@dataclass
class Schedule:
    """One program per position for ``pp`` positions, ``microbatches`` microbatches, ``chunks`` stages per position.

    ``placement`` says which stage each position runs as each chunk:

    - ``"loop"`` (Megatron's): chunk ``c`` of position ``p`` is stage ``c * pp + p``, so stage ``s``
      feeds stage ``s + 1`` on the next position and the last position feeds the first one's next chunk.
    - ``"v"`` (two chunks): position ``p`` runs stages ``p`` and ``2 pp - 1 - p``. The model goes down
      the positions and back up, so the first and the last stage (inputs, targets and the loss) sit on
      position 0 and the turn of the V (stage pp - 1 to stage pp) is a hand-off inside the last position.

    ``programs[p]`` is position p's list of steps; before lowering every step is one compute action.
    """

    name: str
    pp: int
    microbatches: int
    chunks: int = 1
    programs: list[list[Step]] = field(default_factory=list)
    lowered: bool = False
    forward_only: bool = False
    placement_kind: str = "loop"

    def __post_init__(self) -> None:
        if self.placement_kind not in PLACEMENTS:
            raise ScheduleError(f"placement {self.placement_kind!r} is not one of {', '.join(PLACEMENTS)}")
        if self.placement_kind == "v" and self.chunks != 2:
            raise ScheduleError(f"placement v runs two stages per position (got chunks={self.chunks})")

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def split_backward(self) -> bool:
        """True when some backward is split into B (input grad) and W (weight grad)."""
        return any(a.kind is Kind.W for prog in self.programs for step in prog for a in step)

    def split_backwards(self, whole: Container[int] = ()) -> frozenset[tuple[int, int, int]]:
        """(position, microbatch, chunk) of every backward split into B and W: those whose W is in the schedule.
        Any other B is a full backward (input and weight gradients at once); a schedule may mix both (DualPipeV).
        ``whole``: stages whose backward the runtime runs whole in B all the same, their W doing nothing (recompute
        "selective", runtime/recompute.py)."""
        return frozenset((p, a.microbatch, a.chunk) for p, prog in enumerate(self.programs) for step in prog
                         for a in step if a.kind is Kind.W and self.stage(p, a.chunk) not in whole)

    def releases(self, position: int, a: Action, split: frozenset[tuple[int, int, int]]) -> bool:
        """Whether compute action ``a`` ends its microbatch's backward (frees its activation, makes its gradients
        final): its W when that backward is split, else its B (``split``: :meth:`split_backwards`, or fewer: a
        backward the runtime runs whole in B, whose W then does nothing)."""
        return a.kind is (Kind.W if (position, a.microbatch, a.chunk) in split else Kind.B)

    def stage(self, position: int, chunk: int) -> int:
        if self.placement_kind == "v" and chunk == 1:
            return 2 * self.pp - 1 - position
        return chunk * self.pp + position

    def placement(self, stage: int) -> tuple[int, int]:
        """(position, chunk) holding a stage."""
        if self.placement_kind == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage, 1
        return stage % self.pp, stage // self.pp

    def compute_actions(self, position: int) -> list[Action]:
        return [a for step in self.programs[position] for a in step if a.kind.is_compute]


def format_grid(schedule: Schedule, marks: Sequence[tuple[int, int]] = (), max_steps: int = 40) -> str:
    """The step x position grid, one row per position; each step in ``marks`` (position, index) shows as ``>>x<<``."""
    rows = []
    for r, prog in enumerate(schedule.programs):
        cells = []
        for i, step in enumerate(prog):
            cell = "+".join(str(a) for a in step)
            cells.append(f">>{cell}<<" if (r, i) in marks else cell)
        if len(cells) > max_steps:
            mine = [i for p, i in marks if p == r]
            centre = mine[0] if mine else 0
            lo = max(0, min(centre - max_steps // 2, len(cells) - max_steps))
            cells = (["..."] if lo else []) + cells[lo:lo + max_steps] + (
                ["..."] if lo + max_steps < len(cells) else [])
        rows.append(f"  position {r} | " + " ".join(cells))
    return "\n".join(rows)


def format_schedule(schedule: Schedule) -> str:
    """The text form read by :func:`parse_schedule`: one line per position, steps separated by spaces."""
    shape = "" if schedule.placement_kind == "loop" else f" placement={schedule.placement_kind}"
    head = (f"# schedule={schedule.name} pp={schedule.pp} microbatches={schedule.microbatches} "
            f"chunks={schedule.chunks}{shape}\n")
    body = "\n".join(" ".join("+".join(str(a) for a in step) for step in prog)
                     for prog in schedule.programs)
    return head + body + "\n"


def parse_schedule(text: str, name: str = "custom") -> Schedule:
    """Read a schedule written one line per position (position 0 first).

    Steps are separated by spaces or commas (so a CSV row works); ``.`` and empty cells are
    idle markers and are skipped; comm actions posted together are joined with ``+``. Lines
    starting with ``#`` are comments; ``# ... pp=4 microbatches=8 chunks=2`` may set the sizes,
    otherwise they are inferred (pp = number of lines, microbatches and chunks from the largest
    indices seen), and ``placement=v`` the V placement (see :class:`Schedule`). A schedule with any comm
    action is taken as already lowered.
    """
    programs: list[list[Step]] = []
    sizes: dict[str, int] = {}
    placement = "loop"
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            for key, value in re.findall(r"(pp|microbatches|chunks)=(\d+)", line):
                sizes[key] = int(value)
            shape = re.search(r"placement=(\S+)", line)
            if shape:
                placement = shape.group(1)
            continue
        line = re.sub(r"^(?:rank|position)\s*\d+\s*[:|]", "", line)   # a grid row as printed
        prog: list[Step] = []
        for token in re.split(r"[,\s]+", line):
            if token in ("", "."):
                continue
            try:
                prog.append(tuple(Action.parse(part) for part in token.split("+")))
            except ScheduleError as exc:
                raise ScheduleError(f"line {lineno}: {exc}") from None
        programs.append(prog)
    if not programs:
        raise ScheduleError("the schedule text has no program lines (one line per position)")
    actions = [a for prog in programs for step in prog for a in step]
    lowered = any(not a.kind.is_compute for a in actions)
    for prog in programs:
        for step in prog:
            if len(step) > 1 and any(a.kind.is_compute for a in step):
                raise ScheduleError(f"step {'+'.join(map(str, step))}: only comm actions can be joined with '+'")
    pp = sizes.get("pp", len(programs))
    if pp != len(programs):
        raise ScheduleError(f"header says pp={pp} but the text has {len(programs)} program lines (one per position)")
    mbs = sizes.get("microbatches", 1 + max((a.microbatch for a in actions), default=-1))
    chunks = sizes.get("chunks", 1 + max((a.chunk for a in actions), default=0))
    forward_kinds = (Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.SEND_H, Kind.RECV_H)
    forward_only = bool(actions) and all(a.kind in forward_kinds for a in actions)
    return Schedule(name, pp, mbs, chunks, programs, lowered=lowered, forward_only=forward_only,
                    placement_kind=placement)


def steps_of(actions: Sequence[Action]) -> list[Step]:
    """Wrap a compute-only action list as single-action steps."""
    return [(a,) for a in actions]
