"""Step metrics: per-action timings, measured bubble, timeline image, Chrome trace, TensorBoard writer."""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from PIL import ImageDraw, ImageFont
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["Phase", "ActionRecord", "ActionClock", "COLORS", "PARTS", "decompose", "pipeline_bubble", "gather_records",
           "timeline_image", "chrome_trace", "write_json", "MetricsWriter"]


class Phase(str, enum.Enum):
    """What a timed record covers (a ``str`` enum, so ``Phase.F == "F"``)."""

    F = "F"          # forward of one microbatch through one chunk
    B = "B"          # backward (input gradients only when the schedule has W)
    W = "W"          # weight gradients of a split backward
    COMM = "COMM"    # posting one comm step (a header step also waits for its header)
    WAIT = "WAIT"    # blocked on a transfer the next compute needs, or on the step's last sends
    SYNC = "SYNC"    # end of step: DP gradient all-reduce, tied sums, norm, optimizer step

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = (Phase.F, Phase.B, Phase.W)
#: Box colours of the timeline image (RGB), one per action kind.
COLORS: dict[Phase, tuple[int, int, int]] = {
    Phase.F: (66, 133, 244), Phase.B: (52, 168, 83), Phase.W: (245, 124, 0), Phase.COMM: (158, 158, 158),
    Phase.WAIT: (229, 115, 115), Phase.SYNC: (142, 68, 173)}
_OTHER = (60, 60, 60)          # an action kind this module does not know
_BACKGROUND = (255, 255, 255)
_INK = (0, 0, 0)


class ActionRecord(NamedTuple):
    """One timed action of one rank; times in seconds since the step started on that rank."""

    rank: int
    stage: int         # pipeline stage (the virtual stage for interleaved schedules)
    kind: Phase        # F, B, W (compute); COMM (posting a send/recv batch); WAIT (blocked on a transfer);
    #                    SYNC (end of step: DP all-reduce, norm, optimizer step)
    microbatch: int    # -1 when not applicable
    start: float
    end: float


class ActionClock:
    """Times a rank's actions: ``perf_counter`` on CPU, CUDA events on a GPU (so waits on the stream count).

    ``mark()`` returns a time stamp (a float, or a recorded event); ``add()`` files a record with two
    stamps; ``records()`` turns them into :class:`ActionRecord` in seconds since ``start()``
    (on CUDA it waits for the last event first).
    """

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self._t0: Any = None
        self._pending: list[tuple[int, Phase, int, Any, Any]] = []

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._t0 = self.mark()
        self._pending = []

    def add(self, stage: int, kind: Phase, microbatch: int, start: Any, end: Any) -> None:
        self._pending.append((stage, kind, microbatch, start, end))

    def elapsed(self, stamp: Any) -> float:
        """Seconds from ``start()`` to ``stamp``."""
        if self.cuda:
            stamp.synchronize()
            return float(self._t0.elapsed_time(stamp)) / 1000.0
        return float(stamp - self._t0)

    def records(self) -> list[ActionRecord]:
        return [ActionRecord(self.rank, stage, kind, mb, self.elapsed(s), self.elapsed(e))
                for stage, kind, mb, s, e in self._pending]


def _duration(r: ActionRecord) -> float:
    if r.end < r.start:
        raise ValueError(f"record {r} ends before it starts (end {r.end} < start {r.start})")
    return r.end - r.start


PARTS = ("compute", "bubble", "comm", "overhead", "sync")


def decompose(records_by_rank: Mapping[int, Sequence[ActionRecord]], step_time: float) -> dict[int, dict[str, float]]:
    """Split each rank's step into parts (seconds) that add up to ``step_time``.

    Give it the ranks of one pipeline (one replica). The *program* of a rank ends with its last
    record before ``SYNC``; the pipeline's program span is the latest such end.

    - ``compute``: F, B and W;
    - ``comm``: posting comm steps (``COMM``);
    - ``bubble``: blocked inside the schedule on a neighbour (``WAIT``), and waiting for the
      pipeline's last rank to end its program: what the simulator calls bubble;
    - ``overhead``: the rest of the rank's program (the engine's own work between actions);
    - ``sync``: after the program span: DP all-reduce, tied sums, norm, optimizer step, and
      waiting for the step's slowest rank.
    """
    def program_end(rs: Sequence[ActionRecord]) -> float:
        return max([r.end for r in rs if r.kind != Phase.SYNC] + [0.0])

    span = max([program_end(rs) for rs in records_by_rank.values()] + [0.0])
    out = {}
    for rank, rs in records_by_rank.items():
        kinds: dict[str, float] = {}
        for r in rs:
            kinds[r.kind] = kinds.get(r.kind, 0.0) + _duration(r)
        compute = sum(kinds.get(k, 0.0) for k in COMPUTE_KINDS)
        comm, wait = kinds.get(Phase.COMM, 0.0), kinds.get(Phase.WAIT, 0.0)
        end = program_end(rs)
        out[rank] = {"compute": compute, "bubble": wait + span - end, "comm": comm,
                     "overhead": max(0.0, end - compute - comm - wait), "sync": max(0.0, step_time - span)}
    return out


def pipeline_bubble(parts_by_rank: Mapping[int, Mapping[str, float]]) -> float:
    """The measured bubble: mean over a pipeline's ranks of bubble / program span (see :func:`decompose`)."""
    if not parts_by_rank:
        raise ValueError("pipeline_bubble needs the parts of at least one rank (got none)")
    fractions = []
    for p in parts_by_rank.values():
        span = p["compute"] + p["bubble"] + p["comm"] + p["overhead"]
        fractions.append(p["bubble"] / span if span > 0 else 0.0)
    return sum(fractions) / len(fractions)


def gather_records(records: list[ActionRecord], group: dist.ProcessGroup | None = None,
                   dst: int = 0) -> dict[int, list[ActionRecord]] | None:
    """Every rank's records on global rank ``dst``, keyed by sender (None elsewhere); collective on ``group``.

    Without an initialised process group this is the single-process case: ``{0: records}``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return {0: list(records)}
    size = dist.get_world_size(group)
    gathered: list[Any] | None = [None] * size if dist.get_rank() == dst else None
    # plain tuples pickle smaller and do not need this module on the receiving side
    dist.gather_object([tuple(r) for r in records], gathered, dst=dst, group=group)
    if gathered is None:
        return None
    senders = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    return {src: [ActionRecord(*t) for t in rs or []] for src, rs in zip(senders, gathered)}


# ------------------------------------------------------------------------------------------ timeline image

_ROW_H = 28      # pixels per rank row; boxes leave 3 px above and 4 px below
_PAD = 6


class _Frame(NamedTuple):
    """Geometry of a timeline image: time t maps to column ``x(t)``; row i's boxes span ``box_rows(i)``."""

    left: int
    right: int
    top: int
    t_end: float

    def x(self, t: float) -> int:
        return self.left + int(round(t / self.t_end * (self.right - self.left)))

    def box_rows(self, i: int) -> tuple[int, int]:
        y0 = self.top + i * _ROW_H
        return y0 + 3, y0 + _ROW_H - 4


def _font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    from PIL import ImageFont
    return ImageFont.load_default(size=11)


def _row_label(rank: int, records: Sequence[ActionRecord]) -> str:
    stages = sorted({r.stage for r in records if r.stage >= 0})
    return f"rank {rank} / stage {','.join(map(str, stages))}" if stages else f"rank {rank}"


def _frame(records_by_rank: Mapping[int, Sequence[ActionRecord]], width: int, title: str) -> _Frame:
    from PIL import Image, ImageDraw
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    font = _font()
    label_w = max([measure.textlength(_row_label(k, rs), font=font) for k, rs in records_by_rank.items()]
                  + [measure.textlength("time (ms)", font=font)])
    left = int(label_w) + 2 * _PAD
    right = width - 3 * _PAD       # room for the last tick label
    if right - left < 50:
        raise ValueError(f"timeline width {width} px is too narrow: labels take {left} px, need 50 px more")
    t_end = max([r.end for rs in records_by_rank.values() for r in rs] + [1e-9])
    return _Frame(left, right, 20 if title else _PAD, t_end)


def _ticks_ms(t_end_ms: float) -> tuple[float, list[float]]:
    """A 1-2-5 tick step in ms giving about eight ticks over [0, t_end_ms], and the ticks."""
    raw = t_end_ms / 8
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return step, [k * step for k in range(int(t_end_ms / step + 1e-9) + 1)]


def _text_fill(fill: tuple[int, int, int]) -> tuple[int, int, int]:
    return _INK if 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2] > 150 else _BACKGROUND


def _draw_rank(draw: ImageDraw.ImageDraw, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, frame: _Frame,
               row: int, rank: int, records: Sequence[ActionRecord]) -> None:
    y0, y1 = frame.box_rows(row)
    draw.text((_PAD, (y0 + y1) // 2), _row_label(rank, records), fill=_INK, font=font, anchor="lm")
    # compute last, so it stays visible if a wait overlaps it
    for r in sorted(records, key=lambda r: (r.kind in COMPUTE_KINDS, r.start)):
        if r.end <= r.start:
            continue
        x0 = frame.x(r.start)
        x1 = max(x0, frame.x(r.end) - 2)     # a 1 px seam between back-to-back boxes
        fill = COLORS.get(r.kind, _OTHER)
        draw.rectangle([x0, y0, x1, y1], fill=fill)
        text = str(r.microbatch)
        if r.kind in COMPUTE_KINDS and r.microbatch >= 0 and draw.textlength(text, font=font) + 4 <= x1 - x0:
            centre = ((x0 + x1) // 2, (y0 + y1) // 2 + 1)
            draw.text(centre, text, fill=_text_fill(fill), font=font, anchor="mm")


def timeline_image(records_by_rank: Mapping[int, Sequence[ActionRecord]], *, width: int = 1200,
                   title: str = "") -> torch.Tensor:
    """Picture of one step as an HWC uint8 tensor (``SummaryWriter.add_image(..., dataformats="HWC")``).

    One row per rank, labelled ``rank r / stage s``; boxes sit at the measured times (F blue, B green,
    W orange, COMM grey, WAIT red, SYNC purple) with the microbatch inside when it fits; a time
    axis in ms and a legend of the kinds present below. A torch tensor, as numpy is no dependency of torch.
    """
    from PIL import Image, ImageDraw
    ranks = sorted(records_by_rank)
    frame = _frame(records_by_rank, width, title)
    font = _font()
    axis_y = frame.top + _ROW_H * max(1, len(ranks)) + 2
    height = axis_y + 44
    img = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((_PAD, 4), title, fill=_INK, font=font)
    for row, rank in enumerate(ranks):
        _draw_rank(draw, font, frame, row, rank, records_by_rank[rank])
    # time axis: a line from 0 to the latest end over all ranks, ticks on a 1-2-5 grid
    draw.line([frame.left, axis_y, frame.right, axis_y], fill=_INK)
    step, ticks = _ticks_ms(frame.t_end * 1e3)
    decimals = max(0, -math.floor(math.log10(step)))
    for tick in ticks:
        x = frame.x(tick / 1e3)
        draw.line([x, axis_y, x, axis_y + 3], fill=_INK)
        draw.text((x, axis_y + 5), f"{tick:.{decimals}f}", fill=_INK, font=font, anchor="mt")
    draw.text((_PAD, axis_y + 5), "time (ms)", fill=_INK, font=font)
    # legend
    kinds = {r.kind for rs in records_by_rank.values() for r in rs}
    x, y = frame.left, axis_y + 26
    for kind in [k for k in COLORS if k in kinds] + sorted(kinds - set(COLORS)):
        w = 14 + int(draw.textlength(kind, font=font)) + 12
        if x + w > width:
            break
        draw.rectangle([x, y, x + 9, y + 9], fill=COLORS.get(kind, _OTHER))
        draw.text((x + 13, y + 5), kind, fill=_INK, font=font, anchor="lm")
        x += w
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(height, width, 3)


# -------------------------------------------------------------------------------------------- chrome trace

_LANES = {Phase.F: 0, Phase.B: 0, Phase.W: 0, Phase.COMM: 1, Phase.WAIT: 1, Phase.SYNC: 2}
_LANE_NAMES = {0: "compute", 1: "comm / wait", 2: "sync / optimizer", 3: "other"}


def chrome_trace(records_by_rank: Mapping[int, Sequence[ActionRecord]], path: str,
                 step: int | None = None) -> None:
    """Write a Chrome/Perfetto trace (ui.perfetto.dev or chrome://tracing): pid = rank, tid = lane; atomic."""
    events: list[dict[str, Any]] = []
    for rank, rs in sorted(records_by_rank.items()):
        stages = sorted({r.stage for r in rs})
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (stage {','.join(map(str, stages))})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for lane in sorted({_LANES.get(r.kind, 3) for r in rs}):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane,
                           "args": {"name": _LANE_NAMES[lane]}})
        for r in rs:
            events.append({"ph": "X", "pid": rank, "tid": _LANES.get(r.kind, 3), "cat": r.kind,
                           "name": f"{r.kind}{r.microbatch}" if r.microbatch >= 0 else r.kind,
                           "ts": r.start * 1e6, "dur": _duration(r) * 1e6,
                           "args": {"stage": r.stage, "microbatch": r.microbatch}})
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if step is not None:
        doc["otherData"] = {"step": step}
    write_json(path, doc)


def _strict(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` as strict JSON (NaN and inf become null), atomically: a reader sees the old file or the new."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + "-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(_strict(doc), fh, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -------------------------------------------------------------------------------------- TensorBoard writer


# Tags are regexes matched from the start (re.match); ``$`` keeps "train/loss" from matching "train/loss_x".
# Per-stage charts match every stage, so the layout is written once and needs no stage count.
_LAYOUT: dict[str, dict[str, list[Any]]] = {
    "Throughput": {"samples/s": ["Multiline", [r"throughput/samples_per_s$"]],
                   "tokens/s": ["Multiline", [r"throughput/tokens_per_s$"]],
                   "step time (s)": ["Multiline", [r"time/step_s$"]]},
    "Pipeline": {"bubble: measured vs theoretical": ["Multiline", [r"pipeline/bubble_measured$",
                                                                   r"pipeline/bubble_theoretical$"]],
                 **{f"{part} time per stage (s)": ["Multiline", [rf"time/stage\d+/{part}$"]]
                    for part in PARTS}},
    "Training": {"loss: train vs val": ["Multiline", [r"train/loss$", r"val/loss$"]],
                 "learning rate": ["Multiline", [r"train/lr$"]],
                 "grad norm": ["Multiline", [r"train/grad_norm$"]]},
}


class MetricsWriter:
    """TensorBoard views of training; with ``log_dir=None`` or ``enabled=False`` every method is a no-op.

    Events go to ``log_dir/run_name`` (or ``log_dir`` without a run name).
    """

    def __init__(self, log_dir: str | None, *, enabled: bool = True, run_name: str | None = None) -> None:
        self.log_dir = os.path.join(log_dir, run_name) if log_dir is not None and run_name else log_dir
        self.enabled = enabled and self.log_dir is not None
        self._writer: SummaryWriter | None = None
        if self.enabled:
            from torch.utils import tensorboard
            self._writer = tensorboard.SummaryWriter(log_dir=self.log_dir)
            self._writer.add_custom_scalars(_LAYOUT)    # at most once per SummaryWriter
            self._writer.flush()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, step: int, scalars: Mapping[str, float]) -> None:
        assert self._writer is not None
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, float(value), step)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Scalars under the tags as given (e.g. ``train/loss``)."""
        if self._writer is not None:
            self._add(step, scalars)
            self._writer.flush()

    def log_step(self, step: int, *, loss: float, lr: float, grad_norm: float | None, step_time: float,
                 samples_per_s: float, tokens_per_s: float | None,
                 parts_by_stage: Mapping[int, Mapping[str, float]], measured_bubble: float,
                 theoretical_bubble: float) -> None:
        """One training step: loss, lr, norm, throughput, bubbles and each stage's time breakdown (seconds).

        ``parts_by_stage`` maps a stage to its :func:`decompose` parts (seconds).
        """
        if self._writer is None:
            return
        scalars = {"train/loss": loss, "train/lr": lr, "time/step_s": step_time,
                   "throughput/samples_per_s": samples_per_s, "pipeline/bubble_measured": measured_bubble,
                   "pipeline/bubble_theoretical": theoretical_bubble}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if tokens_per_s is not None:
            scalars["throughput/tokens_per_s"] = tokens_per_s
        for stage, parts in sorted(parts_by_stage.items()):
            scalars.update({f"time/stage{stage}/{k}": parts.get(k, 0.0) for k in PARTS})
        self._add(step, scalars)
        self._writer.flush()     # a live TensorBoard sees every logged step

    def log_text(self, tag: str, text: str) -> None:
        """Text (markdown) under ``tag``, e.g. the run's resolved configuration."""
        if self._writer is not None:
            self._writer.add_text(tag, text, 0)
            self._writer.flush()

    def log_eval(self, step: int, val_loss: float) -> None:
        """Validation loss under ``val/loss``."""
        self.log_scalars(step, {"val/loss": val_loss})

    def log_timeline(self, step: int, records_by_rank: Mapping[int, Sequence[ActionRecord]]) -> None:
        """The step's timeline image under ``pipeline/timeline``."""
        if self._writer is not None:
            img = timeline_image(records_by_rank, title=f"step {step}: measured pipeline timeline")
            self._writer.add_image("pipeline/timeline", img, step, dataformats="HWC")
            self._writer.flush()

    def close(self) -> None:
        """Flush and close; later calls are no-ops."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
