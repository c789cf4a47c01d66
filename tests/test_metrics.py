"""Metrics: breakdown, measured bubble, timeline image, Chrome trace, TensorBoard writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeengine.metrics import (COLORS, ActionRecord, MetricsWriter, chrome_trace, compute_breakdown,
                                measured_bubble, timeline_image)

R = {0: [ActionRecord(0, 0, "F", 0, 0.0, 0.1), ActionRecord(0, 0, "B", 0, 0.3, 0.5),
         ActionRecord(0, 0, "WAIT", 0, 0.1, 0.3)],
     1: [ActionRecord(1, 1, "F", 0, 0.1, 0.2), ActionRecord(1, 1, "B", 0, 0.2, 0.4)]}


def test_breakdown_and_bubble() -> None:
    b = compute_breakdown(R[0], 0.5)
    assert b == pytest.approx({"F": 0.1, "B": 0.2, "WAIT": 0.2, "idle": 0.0})
    # rank 0 computes 0.3 of 0.5, rank 1 0.3 of 0.5 -> bubble 0.4 on both
    assert measured_bubble(R, 0.5) == pytest.approx(0.4)


def test_timeline_image_has_boxes_where_records_are() -> None:
    img = timeline_image(R, width=600)
    assert img.dtype.name == "uint8" and img.shape[1] == 600 and img.shape[2] == 3
    label_w, plot_w, top, row_h = 110, 600 - 110 - 10, 6, 28
    y = top + row_h // 2 + 6
    x_f = label_w + int(0.05 / 0.5 * plot_w)
    assert tuple(img[y, x_f]) == COLORS["F"]
    x_gap = label_w + int(0.45 / 0.5 * plot_w)    # rank 1 is idle after 0.4
    assert tuple(img[top + row_h + row_h // 2 + 6, x_gap]) == (255, 255, 255)


def test_chrome_trace(tmp_path: Path) -> None:
    chrome_trace(R, str(tmp_path / "t.json"), step=3)
    doc = json.loads((tmp_path / "t.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5
    f = next(e for e in xs if e["pid"] == 1 and e["name"] == "F0")
    assert f["ts"] == pytest.approx(1e5) and f["dur"] == pytest.approx(1e5)
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"} == {"rank 0 (stage 0)", "rank 1 (stage 1)"}


def test_writer_round_trip(tmp_path: Path) -> None:
    w = MetricsWriter(str(tmp_path))
    for step in range(3):
        w.log_step(step, loss=2.0 - step, lr=0.1, grad_norm=1.5, step_time=0.5, samples_per_s=100.0,
                   tokens_per_s=6400.0, breakdown_by_stage={0: compute_breakdown(R[0], 0.5)},
                   measured_bubble=0.4, theoretical_bubble=0.2)
    w.log_eval(2, 1.25)
    w.log_timeline(2, R)
    w.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [2.0, 1.0, 0.0]
    assert acc.Scalars("val/loss")[0].value == 1.25
    assert acc.Scalars("time/stage0/comm_wait")[0].value == pytest.approx(0.2)
    assert acc.Scalars("pipeline/bubble_theoretical")[0].value == pytest.approx(0.2)
    assert "pipeline/timeline" in acc.Tags()["images"]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    disabled = MetricsWriter(str(tmp_path / "off"), enabled=False)
    disabled.log_eval(0, 1.0)
    disabled.close()
    assert not (tmp_path / "off").exists()
