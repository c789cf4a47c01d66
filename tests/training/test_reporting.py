"""Reporting: the step breakdown and measured bubble, the timeline image and trace, TensorBoard, the summary file."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeengine.runtime.clock import ActionRecord
from pipeengine.training.breakdown import decompose, pipeline_bubble
from pipeengine.training.console import _Console
from pipeengine.training.report import write_json
from pipeengine.training.resources import flops_per_example, flops_per_length, peak_tflops, slow_bf16_hint
from pipeengine.training.tensorboard import MetricsWriter
from pipeengine.training.timeline import COLORS, _frame, chrome_trace, side_by_side, timeline_image


A = ActionRecord


# Two ranks of pp=2, one microbatch, times in seconds; the step takes 0.8 s on both.
#   rank 0  F0 [0, .1)  COMM [.1, .12)  WAIT [.12, .3)  B0 [.3, .5)  SYNC [.5, .6)  idle .2
#   rank 1  WAIT [0, .1)  F0 [.1, .25)  B0 [.25, .35)  W0 [.35, .45)  COMM [.45, .46)   idle .34
R: dict[int, list[ActionRecord]] = {
    0: [A(0, 0, "F", 0, 0.0, 0.1), A(0, 0, "COMM", 0, 0.1, 0.12), A(0, 0, "WAIT", 0, 0.12, 0.3),
        A(0, 0, "B", 0, 0.3, 0.5), A(0, 0, "SYNC", -1, 0.5, 0.6)],
    1: [A(1, 1, "WAIT", 0, 0.0, 0.1), A(1, 1, "F", 0, 0.1, 0.25), A(1, 1, "B", 0, 0.25, 0.35),
        A(1, 1, "W", 0, 0.35, 0.45), A(1, 1, "COMM", 0, 0.45, 0.46)]}


STEP = 0.8


def test_decomposition_adds_up_to_the_step_and_bubble_is_the_pipeline_part() -> None:
    parts = decompose(R, STEP)
    # the program span ends at 0.5 (rank 0's B); rank 1 ends at 0.46 and waits 0.04 for it
    assert parts[0] == pytest.approx({"compute": 0.3, "bubble": 0.18, "comm": 0.02, "overhead": 0.0, "sync": 0.3})
    assert parts[1] == pytest.approx({"compute": 0.35, "bubble": 0.14, "comm": 0.01, "overhead": 0.0, "sync": 0.3})
    for p in parts.values():
        assert sum(p.values()) == pytest.approx(STEP, rel=0.02)
    assert pipeline_bubble(parts) == pytest.approx((0.18 / 0.5 + 0.14 / 0.5) / 2)
    # one rank (pp = 1): no waits, so no bubble; the gaps between actions are the engine's overhead
    alone = decompose({0: [A(0, 0, "F", 0, 0.0, 0.1), A(0, 0, "B", 0, 0.12, 0.3), A(0, 0, "SYNC", -1, 0.3, 0.4)]},
                      0.4)
    assert alone[0] == pytest.approx({"compute": 0.28, "bubble": 0.0, "comm": 0.0, "overhead": 0.02, "sync": 0.1})
    assert pipeline_bubble(alone) == 0.0
    with pytest.raises(ValueError, match="ends before it starts"):
        decompose({0: [A(0, 0, "F", 0, 0.2, 0.1)]}, 1.0)
    with pytest.raises(ValueError, match="at least one rank"):
        pipeline_bubble({})


def _pixel(img: torch.Tensor, x: int, y: int) -> tuple[int, ...]:
    return tuple(img[y, x].tolist())


@pytest.mark.parametrize("width", [600, 1200])
def test_timeline_image_boxes_at_measured_times(width: int) -> None:
    img = timeline_image(R, width=width, title="step 0")
    assert img.dtype == torch.uint8 and img.ndim == 3 and img.shape[1] == width and img.shape[2] == 3
    f = _frame(R, width, "step 0")
    assert f.x(0.0) < width // 4 and f.x(0.6) > width * 0.85     # the plot spans most of the width
    top0, bottom0 = f.box_rows(0)
    top1, bottom1 = f.box_rows(1)
    # rank 0's F0 [0, 0.1): centre column, just inside the top edge (the microbatch label sits mid-box)
    assert _pixel(img, f.x(0.05), top0 + 1) == COLORS["F"]
    # most of the F0 box is F colour; the label "0" is drawn inside it in another colour
    box = img[top0:bottom0 + 1, f.x(0.0):f.x(0.1) - 1].reshape(-1, 3)
    is_f = (box == torch.tensor(COLORS["F"], dtype=torch.uint8)).all(dim=1)
    assert is_f.float().mean() > 0.8 and not is_f.all()
    # every kind at the centre of one of its boxes
    for rank, t, kind in [(0, 0.2, "WAIT"), (0, 0.4, "B"), (0, 0.525, "SYNC"), (0, 0.575, "SYNC"),
                          (1, 0.05, "WAIT"), (1, 0.175, "F"), (1, 0.4, "W")]:
        top, _ = f.box_rows(rank)
        assert _pixel(img, f.x(t), top + 1) == COLORS[kind], (rank, t, kind)
    # gaps: rank 1 does nothing after 0.46; nothing is drawn between rows
    assert _pixel(img, f.x(0.53), (top1 + bottom1) // 2) == (255, 255, 255)
    assert _pixel(img, f.x(0.4), (bottom0 + top1) // 2) == (255, 255, 255)


def test_timeline_image_seam_between_back_to_back_boxes_and_narrow_width() -> None:
    recs = {0: [A(0, 0, "F", 0, 0.0, 0.5), A(0, 0, "F", 1, 0.5, 1.0)]}
    img = timeline_image(recs, width=400)
    f = _frame(recs, 400, "")
    top, _ = f.box_rows(0)
    assert _pixel(img, f.x(0.5) - 1, top + 1) == (255, 255, 255)
    assert _pixel(img, f.x(0.5), top + 1) == COLORS["F"]
    with pytest.raises(ValueError, match="too narrow"):
        timeline_image(recs, width=100)


def test_ranks_are_drawn_on_one_time_axis() -> None:
    """Each rank's records count from its own step's start; the picture and the trace put them side by side by the
    steps' starts on the host's wall clock: position 1 starts its step 16 ms before position 0 (whose optimizer pass
    is longer) and waits 22 ms for position 0's first output, which took 6 ms: drawn, its wait starts 16 ms before
    position 0's F and ends after it."""
    rank0 = [A(0, 0, "F", 0, 0.0001, 0.0063)]
    rank1 = [A(1, 1, "WAIT", 0, 0.0003, 0.0225), A(1, 1, "F", 0, 0.0227, 0.0271)]
    drawn = side_by_side({0: rank0, 1: rank1}, {0: 1000.016, 1: 1000.0})
    assert drawn[0][0].start == pytest.approx(0.0161) and drawn[0][0].end == pytest.approx(0.0223)
    assert drawn[1] == rank1   # the earliest start is the axis' zero
    assert side_by_side({0: rank0}, {}) == {0: rank0}   # nothing known of the starts: as recorded


def test_chrome_trace(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "trace.json"
    chrome_trace(R, str(path), step=3)
    doc = json.loads(path.read_text())
    assert doc["otherData"] == {"step": 3}
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(R[0]) + len(R[1])
    f = next(e for e in xs if e["pid"] == 1 and e["name"] == "F0")
    assert f["ts"] == pytest.approx(1e5) and f["dur"] == pytest.approx(1.5e5) and f["args"]["stage"] == 1
    assert {e["name"] for e in xs if e["pid"] == 0} == {"F0", "COMM0", "WAIT0", "B0", "SYNC"}
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {"rank 0 (stage 0)", "rank 1 (stage 1)"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {xs_e["tid"] for xs_e in xs if xs_e["pid"] == 0} == {t for p, t in lanes if p == 0}
    assert lanes[(0, 0)] == "compute"
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]    # the temporary file was replaced


def _read_events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_writer_round_trip(tmp_path: Path) -> None:
    parts = decompose(R, STEP)
    with MetricsWriter(str(tmp_path), run_name="run") as w:
        assert w.log_dir == str(tmp_path / "run")
        for step in range(3):
            w.log_step(step, loss=2.0 - step, lr=0.1 * (step + 1), grad_norm=1.5 if step else None,
                       step_time=STEP, samples_per_s=100.0, tokens_per_s=6400.0,
                       parts_by_position=parts, measured_bubble=0.59375, theoretical_bubble=0.5)
        w.log_scalars(3, {"train/loss": -1.0, "custom/x": 7.0})
        w.log_scalars(3, {"time/wall_s": 1.1, "time/data_s": 0.1, "throughput/tflops_per_rank": 0.5,
                          "throughput/mfu": 0.4, "memory/position0/rss_mib": 400.0})
        w.log_eval(2, 1.25)
        w.log_timeline(2, R)
    acc = _read_events(tmp_path / "run")
    tags = acc.Tags()
    # TensorBoard's step is the steps done (the console's "step N"): index t at t + 1
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.0), (3, 0.0), (4, -1.0)]
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([0.1, 0.2, 0.3])
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [2, 3]        # None is not written
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(3, 1.25)]
    assert acc.Scalars("custom/x")[0].value == 7.0
    expect = {"time/step_s": STEP, "throughput/samples_per_s": 100.0, "throughput/tokens_per_s": 6400.0,
              "pipeline/bubble_measured": 0.59375, "pipeline/bubble_theoretical": 0.5,
              "time/position0/compute": 0.3, "time/position0/bubble": 0.18, "time/position0/comm": 0.02,
              "time/position0/overhead": 0.0, "time/position0/sync": 0.3, "time/position1/bubble": 0.14}
    for tag, value in expect.items():
        assert acc.Scalars(tag)[-1].value == pytest.approx(value), tag
    assert tags["images"] == ["pipeline/timeline"]
    image = acc.Images("pipeline/timeline")[0]
    assert (image.step, image.width) == (3, 1200)
    from PIL import Image   # the same picture as a PNG in the run folder
    with Image.open(tmp_path / "run" / "timeline.png") as png:
        assert png.format == "PNG" and (png.width, png.height) == (1200, image.height)
        assert png.tobytes() == timeline_image(R, title="step 3: measured pipeline timeline").numpy().tobytes()
    # the layout is a custom_scalars-plugin tensor holding a serialised Layout proto
    from tensorboard.plugins.custom_scalar import layout_pb2
    tag = "custom_scalars__config__"
    assert tag in tags["tensors"]
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "custom_scalars"
    layout = layout_pb2.Layout.FromString(acc.Tensors(tag)[0].tensor_proto.string_val[0])
    charts = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    assert set(charts) == {"Throughput", "Memory", "Pipeline", "Training"}
    bubble = charts["Pipeline"]["bubble: measured vs theoretical"]
    assert bubble == ["pipeline/bubble_measured$", "pipeline/bubble_theoretical$"]
    assert charts["Training"]["loss: train vs val"] == ["train/loss$", "val/loss$"]
    logged = set(tags["scalars"])
    for category in charts.values():       # every chart's regexes pick up a logged tag
        for title, regexes in category.items():
            assert any(re.match(rx, t) for rx in regexes for t in logged), title


def test_disabled_writer_is_a_no_op(tmp_path: Path) -> None:
    for w in (MetricsWriter(str(tmp_path / "off"), enabled=False), MetricsWriter(None, run_name="x")):
        w.log_step(0, loss=1.0, lr=0.1, grad_norm=None, step_time=1.0, samples_per_s=1.0, tokens_per_s=None,
                   parts_by_position={0: {"compute": 1.0}}, measured_bubble=0.0, theoretical_bubble=0.0)
        w.log_scalars(0, {"a": 1.0})
        w.log_eval(0, 1.0)
        w.log_timeline(0, R)
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_summary_json_is_strict_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "run" / "summary.json"
    write_json(str(path), {"loss": float("nan"), "xs": [1.0, float("inf")], "ok": 2})
    assert json.loads(path.read_text()) == {"loss": None, "xs": [1.0, None], "ok": 2}
    assert os.listdir(path.parent) == ["summary.json"]   # no temporary left behind
    mask = os.umask(0o027)
    try:
        write_json(str(path), {})
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o640   # as the user's umask says, like every other file of the run


@pytest.mark.parametrize("every", [0, 100])
def test_console_logs_progress_updates_as_lines(every: float) -> None:
    """Under pipe.sh on a terminal: the terminal gets the in-place updates as written; the rank's log file
    gets lines: every update when ``every`` is 0, else only the last before other output."""
    terminal, log = io.StringIO(), io.StringIO()
    console = _Console(terminal, log, every=every)
    print("head", file=console)
    for step in range(3):
        print(f"\r[..] step {step}\033[K", end="", file=console, flush=True)
    print(file=console)
    print("===\nsummary", file=console)
    assert terminal.getvalue() == "head\n" + "".join(f"\r[..] step {s}\033[K" for s in range(3)) + "\n===\nsummary\n"
    steps = range(3) if every == 0 else [2]
    assert log.getvalue() == "head\n" + "".join(f"[..] step {s}\n" for s in steps) + "===\nsummary\n"
    assert console.isatty()


@pytest.mark.parametrize("flags, precision, device, hint", [
    ("fpu sse avx2 avx512f", "bf16", "cpu", True),            # x86 without bf16: emulated
    ("fpu avx512f avx512_bf16", "bf16", "cpu", False),
    ("fpu amx_bf16 amx_tile", "bf16", "cpu", False),
    ("fp asimd bf16", "bf16", "cpu", False),                  # Arm: "Features" line
    ("fpu sse avx2", "fp32", "cpu", False),
    ("fpu sse avx2", "bf16", "meta", False)])                 # not a CPU run
def test_slow_bf16_hint_names_the_missing_instructions(tmp_path: Path, flags: str, precision: str, device: str,
                                                       hint: bool) -> None:
    key = "Features" if "asimd" in flags else "flags"
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\n{key}\t\t: {flags}\n\nprocessor\t: 1\n{key}\t\t: {flags}\n")
    line = slow_bf16_hint(torch.device(device), precision, str(tmp_path / "cpuinfo"))
    assert (line is not None) == hint
    if hint:
        assert "avx512_bf16" in line and "--precision fp32" in line and "\n" not in line
    assert slow_bf16_hint(torch.device("cpu"), "bf16", str(tmp_path / "missing")) is None


def test_model_flops_on_the_meta_device_and_the_peak_table() -> None:
    layers = [lambda: torch.nn.Linear(8, 16), lambda: torch.nn.ReLU(), lambda: torch.nn.Linear(16, 4)]
    # forward 2*(8*16 + 16*4) multiply-adds per example, training 3x that
    assert flops_per_example(layers, torch.zeros(8)) == pytest.approx(3 * 2 * (8 * 16 + 16 * 4))
    assert peak_tflops(torch.device("cpu"), "bf16") is None   # no default on CPU: MFU is n/a unless given


def test_a_sequences_flops_follow_its_length_as_a_line_plus_a_square() -> None:
    """Rows of their own lengths: the GPT's FLOPs for one sequence of n tokens are a n + b n² (its layers, its
    attention), fitted at the context and half of it; the fit gives the counted figure at other lengths."""
    from pipeengine.models import gpt
    layers = gpt.layer_factories(gpt.Config(block_size=64, n_layer=2, n_head=2, n_embd=16))
    fit = flops_per_length(layers, 64)
    assert fit is not None and fit[0] > 0 and fit[1] > 0
    for n in (1, 7, 33):
        counted = flops_per_example(layers, torch.zeros(n, dtype=torch.int64))
        assert fit[0] * n + fit[1] * n * n == pytest.approx(counted, rel=1e-9)


def test_the_peak_starts_again_at_the_baseline() -> None:
    """A process that held more before the run (a notebook, a test session) reports the run's own peak: on Linux the
    resident high-water mark starts again where the baseline is taken."""
    import os

    from pipeengine.training.prediction import resident_bytes
    from pipeengine.training.resources import peak_memory, set_baseline
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs: the peak is the process's")
    big = torch.ones(100 * 2**20)   # 400 MiB, touched
    del big
    before = peak_memory(torch.device("cpu"))["rss"]
    set_baseline(resident_bytes(trim=True))
    after = peak_memory(torch.device("cpu"))
    assert after["rss"] < before - 300 and after["above_baseline"] < 50, (before, after)


def test_the_optimizer_probe_is_not_the_runs_peak_and_what_came_before_it_is() -> None:
    """[Note: the optimizer's probe] in pipeengine/training/prediction.py: the probe runs on the rank's whole size on
    CPU, outside the run's peak; a peak the run reached before the probe still counts."""
    import os

    from pipeengine.training.prediction import optimizer_bandwidth, resident_bytes
    from pipeengine.training.resources import peak_memory, set_baseline
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/self/clear_refs: the probe stays small")
    cpu = torch.device("cpu")
    set_baseline(resident_bytes(trim=True))
    earlier = torch.ones(40 * 2**20)   # 160 MiB, touched: the run's own, before the probe
    del earlier
    resident_bytes(trim=True)
    seen = peak_memory(cpu)["above_baseline"]
    assert seen > 150, seen
    # 24 Mi elements: parameter, gradient and two AdamW states, 384 MiB, more than the run's peak so far
    bandwidth = optimizer_bandwidth(lambda ps: torch.optim.AdamW(ps, lr=1e-3), cpu, 2.0, 24 * 2**20)
    assert bandwidth > 0
    after = peak_memory(cpu)["above_baseline"]
    assert seen - 1 <= after < seen + 50, (seen, after)   # the earlier peak kept, the probe's 384 MiB not counted
