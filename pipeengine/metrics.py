"""Step metrics: per-action timings, measured bubble, TensorBoard throughput views, timeline image, trace."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch.distributed as dist

__all__ = ["ActionRecord", "compute_breakdown", "measured_bubble", "gather_records", "timeline_image",
           "chrome_trace", "MetricsWriter", "COLORS"]

COMPUTE = ("F", "B", "W")
COLORS: dict[str, tuple[int, int, int]] = {
    "F": (66, 133, 244), "B": (52, 168, 83), "W": (251, 188, 5), "COMM": (189, 189, 189),
    "WAIT": (234, 67, 53), "SYNC": (156, 39, 176)}
BACKGROUND = (255, 255, 255)


class ActionRecord(NamedTuple):
    """One timed action of one rank; times in seconds since the step started on that rank."""

    rank: int
    stage: int
    kind: str          # F, B, W, COMM (posting a batch), WAIT (blocked on a transfer), SYNC (grad sync,
    #                    norm, optimizer step and loss at the end of a step)
    microbatch: int    # -1 when not applicable
    start: float
    end: float


def compute_breakdown(records: Sequence[ActionRecord], step_time: float) -> dict[str, float]:
    """Seconds per kind on one rank, plus ``idle`` = step time not covered by any record."""
    out: dict[str, float] = {}
    for r in records:
        out[r.kind] = out.get(r.kind, 0.0) + (r.end - r.start)
    out["idle"] = max(0.0, step_time - sum(out.values()))
    return out


def measured_bubble(records_by_rank: Mapping[int, Sequence[ActionRecord]], step_time: float) -> float:
    """Mean over ranks of the fraction of the step not spent computing (F/B/W); waits count as bubble."""
    if not records_by_rank or step_time <= 0:
        return 0.0
    fractions = [1.0 - sum(r.end - r.start for r in rs if r.kind in COMPUTE) / step_time
                 for rs in records_by_rank.values()]
    return max(0.0, sum(fractions) / len(fractions))


def gather_records(records: list[ActionRecord], group: Any = None,
                   dst: int = 0) -> dict[int, list[ActionRecord]] | None:
    """Every rank's records on ``dst`` (None elsewhere); works without torch.distributed too."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {rank: list(records)} if rank == dst else None
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object([tuple(r) for r in records], gathered, dst=dst, group=group)
    if gathered is None:
        return None
    out: dict[int, list[ActionRecord]] = {}
    for rs in gathered:
        for r in rs or []:
            rec = ActionRecord(*r)
            out.setdefault(rec.rank, []).append(rec)
    return out


def timeline_image(records_by_rank: Mapping[int, Sequence[ActionRecord]], *, width: int = 1200,
                   title: str = "") -> np.ndarray:
    """HWC uint8 picture: one row per rank, boxes at measured times (F blue, B green, W yellow, waits red)."""
    from PIL import Image, ImageDraw
    ranks = sorted(records_by_rank)
    row_h, label_w, top, bottom = 28, 110, 22 if title else 6, 24
    height = top + row_h * max(1, len(ranks)) + bottom
    end = max([r.end for rs in records_by_rank.values() for r in rs] + [1e-9])
    plot_w = max(10, width - label_w - 10)
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((6, 4), title, fill=(0, 0, 0))

    def x(t: float) -> int:
        return label_w + int(round(t / end * plot_w))

    for row, rank in enumerate(ranks):
        y0 = top + row * row_h
        stages = sorted({r.stage for r in records_by_rank[rank]})
        draw.text((4, y0 + 8), f"rank {rank} / stage {','.join(map(str, stages))}", fill=(0, 0, 0))
        for r in sorted(records_by_rank[rank], key=lambda r: r.kind in COMPUTE):
            if r.end <= r.start or r.kind not in COLORS:
                continue
            x0, x1 = x(r.start), max(x(r.end) - 1, x(r.start))
            draw.rectangle([x0, y0 + 3, x1, y0 + row_h - 3], fill=COLORS[r.kind])
            text = f"{r.kind}{r.microbatch}" if r.microbatch >= 0 else ""
            if r.kind in COMPUTE and text and x1 - x0 > 7 * len(text):
                draw.text((x0 + 2, y0 + 8), text, fill=(255, 255, 255))
    axis_y = top + row_h * len(ranks) + 4
    draw.line([label_w, axis_y, label_w + plot_w, axis_y], fill=(0, 0, 0))
    for i in range(6):
        t = end * i / 5
        draw.line([x(t), axis_y, x(t), axis_y + 4], fill=(0, 0, 0))
        draw.text((x(t) - 10, axis_y + 6), f"{t * 1000:.0f}ms", fill=(0, 0, 0))
    return np.asarray(img, dtype=np.uint8)


def chrome_trace(records_by_rank: Mapping[int, Sequence[ActionRecord]], path: str, step: int | None = None) -> None:
    """Write a Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing); atomic replace."""
    events: list[dict[str, Any]] = []
    for rank, rs in sorted(records_by_rank.items()):
        stages = sorted({r.stage for r in rs})
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank} (stage {','.join(map(str, stages))})"}})
        for r in rs:
            lane = "compute" if r.kind in COMPUTE else "comm" if r.kind in ("COMM", "WAIT") else "other"
            events.append({"ph": "X", "pid": rank, "tid": lane, "ts": r.start * 1e6, "dur": (r.end - r.start) * 1e6,
                           "name": f"{r.kind}{r.microbatch}" if r.microbatch >= 0 else r.kind,
                           "args": {"stage": r.stage, "microbatch": r.microbatch}})
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"step": step}}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


class MetricsWriter:
    """TensorBoard writer for the trainer; a disabled writer (non-logging ranks) does nothing."""

    def __init__(self, log_dir: str | None, *, enabled: bool = True) -> None:
        self.enabled = enabled and log_dir is not None
        self.writer: Any = None
        self._stages: set[int] = set()
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log_dir)
            self._layout(stages=())

    def _layout(self, stages: Sequence[int]) -> None:
        stage_charts = {f"stage {s}: F/B/W/comm_wait/idle (s)": ["Multiline", [f"time/stage{s}/.*"]] for s in stages}
        self.writer.add_custom_scalars({
            "Throughput": {"samples/s": ["Multiline", ["throughput/samples_per_s"]],
                           "tokens/s": ["Multiline", ["throughput/tokens_per_s"]],
                           "step time (s)": ["Multiline", ["time/step_s"]]},
            "Pipeline": {"bubble: measured vs theoretical": ["Multiline", ["pipeline/bubble_measured",
                                                                           "pipeline/bubble_theoretical"]],
                         **stage_charts},
            "Training": {"loss (train, val)": ["Multiline", ["train/loss", "val/loss"]],
                         "learning rate": ["Multiline", ["train/lr"]],
                         "grad norm": ["Multiline", ["train/grad_norm"]]},
        })

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.enabled:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def log_step(self, step: int, *, loss: float, lr: float, grad_norm: float | None, step_time: float,
                 samples_per_s: float, tokens_per_s: float | None,
                 breakdown_by_stage: Mapping[int, Mapping[str, float]], measured_bubble: float,
                 theoretical_bubble: float) -> None:
        if not self.enabled:
            return
        scalars = {"train/loss": loss, "train/lr": lr, "time/step_s": step_time,
                   "throughput/samples_per_s": samples_per_s, "pipeline/bubble_measured": measured_bubble,
                   "pipeline/bubble_theoretical": theoretical_bubble}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if tokens_per_s is not None:
            scalars["throughput/tokens_per_s"] = tokens_per_s
        for stage, parts in breakdown_by_stage.items():
            for kind in ("F", "B", "W", "idle"):
                scalars[f"time/stage{stage}/{kind}"] = float(parts.get(kind, 0.0))
            scalars[f"time/stage{stage}/comm_wait"] = float(parts.get("COMM", 0.0) + parts.get("WAIT", 0.0))
        if set(breakdown_by_stage) - self._stages:
            self._stages |= set(breakdown_by_stage)
            self._layout(sorted(self._stages))
        self.log_scalars(step, scalars)
        self.writer.flush()

    def log_eval(self, step: int, val_loss: float) -> None:
        if self.enabled:
            self.writer.add_scalar("val/loss", val_loss, step)
            self.writer.flush()

    def log_timeline(self, step: int, records_by_rank: Mapping[int, Sequence[ActionRecord]]) -> None:
        if self.enabled:
            img = timeline_image(records_by_rank, title=f"step {step}: pipeline timeline (measured)")
            self.writer.add_image("pipeline/timeline", img, step, dataformats="HWC")
            self.writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
