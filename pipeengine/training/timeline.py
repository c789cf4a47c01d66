"""A step's measured timeline: as a picture (TensorBoard, PNG) and as a Chrome/Perfetto trace."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch

from ..runtime.clock import COMPUTE_PHASES, ActionRecord, Phase
from .breakdown import duration
from .report import write_json

if TYPE_CHECKING:
    from PIL import ImageDraw, ImageFont

__all__ = ["COLORS", "side_by_side", "timeline_image", "timeline_picture", "save_timeline_png", "chrome_trace"]

#: Box colours of the timeline image (RGB), one per action kind.
COLORS: dict[Phase, tuple[int, int, int]] = {
    Phase.F: (66, 133, 244), Phase.B: (52, 168, 83), Phase.W: (245, 124, 0), Phase.COMM: (158, 158, 158),
    Phase.WAIT: (229, 115, 115), Phase.SYNC: (142, 68, 173)}
_OTHER = (60, 60, 60)          # an action kind this module does not know
_BACKGROUND = (255, 255, 255)
_INK = (0, 0, 0)

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
    for r in sorted(records, key=lambda r: (r.kind in COMPUTE_PHASES, r.start)):
        if r.end <= r.start:
            continue
        x0 = frame.x(r.start)
        x1 = max(x0, frame.x(r.end) - 2)     # a 1 px seam between back-to-back boxes
        fill = COLORS.get(r.kind, _OTHER)
        draw.rectangle([x0, y0, x1, y1], fill=fill)
        text = str(r.microbatch)
        if r.kind in COMPUTE_PHASES and r.microbatch >= 0 and draw.textlength(text, font=font) + 4 <= x1 - x0:
            centre = ((x0 + x1) // 2, (y0 + y1) // 2 + 1)
            draw.text(centre, text, fill=_text_fill(fill), font=font, anchor="mm")


def side_by_side(records_by_rank: Mapping[int, Sequence[ActionRecord]], started_at: Mapping[int, float]
                 ) -> dict[int, list[ActionRecord]]:
    """Each rank's records on one time axis: a rank's count from its own step's start (``started_at``, the host's
    wall clock), so ranks whose steps start apart (a position with a larger optimizer pass starts its next step
    later, and its peers wait for it) would otherwise be drawn as if they had started together. Across nodes the
    rows agree as far as their clocks do; on CUDA, as far as each rank's device was caught up when its step began
    (its records count from a start event, ``started_at`` is when the host queued it)."""
    first = min(started_at.values(), default=0.0)
    shift = {rank: started_at.get(rank, first) - first for rank in records_by_rank}
    return {rank: [r._replace(start=r.start + shift[rank], end=r.end + shift[rank]) for r in rs]
            for rank, rs in records_by_rank.items()}


def timeline_picture(records_by_rank: Mapping[int, Sequence[ActionRecord]], *, width: int = 1200,
                     title: str = "") -> Any:
    """The PIL image behind :func:`timeline_image`."""
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
    return img


def timeline_image(records_by_rank: Mapping[int, Sequence[ActionRecord]], *, width: int = 1200,
                   title: str = "") -> torch.Tensor:
    """Picture of one step as an HWC uint8 tensor (``SummaryWriter.add_image(..., dataformats="HWC")``).

    One row per rank, labelled ``rank r / stage s``; boxes sit at the measured times (F blue, B green,
    W orange, COMM grey, WAIT red, SYNC purple) with the microbatch inside when it fits; a time
    axis in ms and a legend of the kinds present below. A torch tensor, as numpy is no dependency of torch.
    """
    img = timeline_picture(records_by_rank, width=width, title=title)
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


def save_timeline_png(records_by_rank: Mapping[int, Sequence[ActionRecord]], path: str, title: str = "") -> None:
    """:func:`timeline_image` as a PNG file, written atomically (a viewer sees the old picture or the new)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    timeline_picture(records_by_rank, title=title).save(tmp, format="PNG")
    os.replace(tmp, path)


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
                           "ts": r.start * 1e6, "dur": duration(r) * 1e6,
                           "args": {"stage": r.stage, "microbatch": r.microbatch}})
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if step is not None:
        doc["otherData"] = {"step": step}
    write_json(path, doc)
