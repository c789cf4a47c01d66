"""TensorBoard views of training: scalars under fixed tags, the custom-scalars layout, timeline images, text."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..runtime.clock import ActionRecord
from .breakdown import PARTS
from .timeline import save_timeline_png, timeline_image

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["MetricsWriter"]

# Tags are regexes matched from the start (re.match); ``$`` keeps "train/loss" from matching "train/loss_x".
# Per-position charts match every position, so the layout is written once and needs no position count.
_LAYOUT: dict[str, dict[str, list[Any]]] = {
    "Throughput": {   # from the wall time of the steps after warm-up: data, pipeline, evaluation, saves, logging
        "samples/s (wall time)": ["Multiline", [r"throughput/samples_per_s$"]],
        "tokens/s (wall time)": ["Multiline", [r"throughput/tokens_per_s$"]],
        "model TFLOP/s per rank": ["Multiline", [r"throughput/tflops_per_rank$"]],
        "MFU (model FLOP/s / peak)": ["Multiline", [r"throughput/mfu$"]],
        "time per step (s): wall, data, pipeline": ["Multiline",
                                                    [r"time/wall_s$", r"time/data_s$", r"time/step_s$"]]},
    "Memory": {"peak per position (MiB)": ["Multiline", [r"memory/position\d+/\w+_mib$"]]},
    "Pipeline": {"bubble: measured vs theoretical": ["Multiline", [r"pipeline/bubble_measured$",
                                                                   r"pipeline/bubble_theoretical$"]],
                 **{f"{part} time per position (s)": ["Multiline", [rf"time/position\d+/{part}$"]]
                    for part in PARTS}},
    "Training": {"loss: train vs val": ["Multiline", [r"train/loss$", r"val/loss$"]],
                 "learning rate": ["Multiline", [r"train/lr$"]],
                 "grad norm": ["Multiline", [r"train/grad_norm$"]]},
}


class MetricsWriter:
    """TensorBoard views of training; with ``log_dir=None`` or ``enabled=False`` every method is a no-op.

    Events go to ``log_dir/run_name`` (or ``log_dir`` without a run name). Methods take a step's index (0 for
    the first step); TensorBoard's step axis is the steps done, as the console's ``step N/total``: step
    index t is written at t + 1.
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
            self._writer.add_scalar(tag, float(value), step + 1)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Scalars under the tags as given (e.g. ``train/loss``)."""
        if self._writer is not None:
            self._add(step, scalars)
            self._writer.flush()

    def log_step(self, step: int, *, loss: float, lr: float, grad_norm: float | None, step_time: float,
                 samples_per_s: float | None, tokens_per_s: float | None,
                 parts_by_position: Mapping[int, Mapping[str, float]], measured_bubble: float,
                 theoretical_bubble: float) -> None:
        """One training step: loss, lr, norm, throughput, bubbles and each position's time breakdown (seconds).

        ``parts_by_position`` maps a position to its :func:`~pipeengine.training.breakdown.decompose` parts;
        throughput that is None is not written (the trainer logs it when the step's wall time is known).
        """
        if self._writer is None:
            return
        scalars = {"train/loss": loss, "train/lr": lr, "time/step_s": step_time,
                   "pipeline/bubble_measured": measured_bubble, "pipeline/bubble_theoretical": theoretical_bubble}
        if samples_per_s is not None:
            scalars["throughput/samples_per_s"] = samples_per_s
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if tokens_per_s is not None:
            scalars["throughput/tokens_per_s"] = tokens_per_s
        for position, parts in sorted(parts_by_position.items()):
            scalars.update({f"time/position{position}/{k}": parts.get(k, 0.0) for k in PARTS})
        self._add(step, scalars)
        self._writer.flush()     # a live TensorBoard sees every logged step

    def log_text(self, tag: str, text: str) -> None:
        """Text (markdown) under ``tag``, e.g. the run's resolved configuration."""
        if self._writer is not None:
            self._writer.add_text(tag, text, 0)
            self._writer.flush()

    def log_world_change(self, change: Mapping[str, Any]) -> None:
        """A group restarted at another number of processes (resume.py): ``world/size`` from its first step on,
        and what it became, as text under ``world``."""
        from .report import world_change_text
        self.log_scalars(change["step"], {"world/size": change["to"]})
        self.log_text("world", world_change_text(dict(change)))

    def log_eval(self, step: int, val_loss: float) -> None:
        """Validation loss under ``val/loss``."""
        self.log_scalars(step, {"val/loss": val_loss})

    def log_timeline(self, step: int, records_by_rank: Mapping[int, Sequence[ActionRecord]]) -> None:
        """The step's timeline image under ``pipeline/timeline``, and as ``timeline.png`` in the run folder
        (the newest logged step's)."""
        if self._writer is not None and self.log_dir is not None:
            title = f"step {step + 1}: measured pipeline timeline"
            img = timeline_image(records_by_rank, title=title)
            self._writer.add_image("pipeline/timeline", img, step + 1, dataformats="HWC")
            self._writer.flush()
            save_timeline_png(records_by_rank, os.path.join(self.log_dir, "timeline.png"), title)

    def close(self) -> None:
        """Flush and close; later calls are no-ops."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
