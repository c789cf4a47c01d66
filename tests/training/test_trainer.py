"""The Trainer: one process decomposes its steps; progress on a terminal; every bad input is one line and status 2."""

from __future__ import annotations

import dataclasses

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeengine.training.cli import parse_args
from pipeengine.training.report import summary_text
from pipeengine.training.trainer import run
from tests.harness import ROOT, on_a_terminal


@pytest.mark.timeout(120)
def test_one_process_run_decomposes_its_steps_and_shows_bubble_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGINT)
    s = run(parse_args(["--model", "mlp", "--steps", "6", "--log-dir", str(tmp_path), "--run-name", "r", "--quiet"]))
    assert signal.getsignal(signal.SIGINT) is before   # run() gives Ctrl-C back to its caller
    out = capsys.readouterr().out
    assert s["measured_bubble"] == 0.0 and s["theoretical_bubble"] == 0.0 and s["status"] == "done"
    assert sum(s["step_parts"].values()) == pytest.approx(1.0, abs=0.02)
    assert s["warmup_steps"] == 1 and s["timed_steps"] == [1, 2, 3, 4, 5]
    assert "(5 timed steps, the first 1 left out as warm-up)" in out and " ms per step: data " in out
    assert list(s["step_parts"]) == ["data", "compute", "bubble", "comm", "overhead", "sync", "other"]
    # one wall time behind every rate: steps/s x global batch = samples/s, 1 / steps/s = the wall time per step
    assert s["samples_per_s"] == pytest.approx(s["steps_per_s"] * s["global_batch"], rel=1e-9)
    assert s["wall_s_per_step"] == pytest.approx(1 / s["steps_per_s"], rel=1e-9)
    assert s["wall_s_per_step"] >= s["median_step_s"] * 0.5 and s["data_s_per_step"] >= 0
    assert s["flops_per_sample"] > 0 and s["tflops_per_rank"] > 0 and s["mfu"] is None   # no peak on CPU
    assert set(s["peak_memory_mib"]) == {"0"} and s["peak_memory_mib"]["0"]["rss"] > 50
    # the twin's prediction beside the measured figures: the step, and the peak above the process's baseline
    memory, predicted = s["peak_memory_mib"]["0"], s["predicted_memory_parts_mib"]["0"]
    assert 0 < memory["above_baseline"] < memory["rss"] and s["predicted_step_s"] > 0
    assert list(predicted) == ["parameters", "gradients", "optimizer", "activations", "buffers"]
    assert s["predicted_peak_memory_mib"]["0"] == pytest.approx(sum(predicted.values()))
    assert predicted["optimizer"] == pytest.approx(2 * predicted["parameters"])   # AdamW: two states per parameter
    assert f"predicted {1e3 * s['predicted_step_s']:.1f} ms" in out and "MiB above the baseline, predicted " in out
    assert "[####" not in out   # --quiet
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "r"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("pipeline/timeline")] == [2, 6]   # first step after warm-up, and the last
    assert acc.Scalars("time/position0/bubble")[-1].value == 0.0
    assert acc.Scalars("time/predicted_step_s")[-1].value == pytest.approx(s["predicted_step_s"])
    assert acc.Scalars("memory/position0/predicted_mib")[-1].value == pytest.approx(s["predicted_peak_memory_mib"]["0"])
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["steps_done"] == 6 and saved["config"]["model"]["name"] == "mlp"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_progress_on_a_terminal_is_one_updating_line_with_eta(tmp_path: Path) -> None:
    code, text = on_a_terminal([sys.executable, "-m", "pipeengine.train", "--model", "mlp", "--steps", "8",
                                "--log-dir", str(tmp_path)], dict(os.environ, PYTHONPATH=str(ROOT)), ROOT)
    assert code == 0, text[-3000:]
    progress = text[text.index("[", text.index("logs in")):text.index("=" * 72)]
    updates = [u for u in progress.split("\r") if u.strip()]
    assert len(updates) == 8 and all("ETA 0:00:" in u and "steps/s" in u for u in updates), updates
    assert progress.count("\n") == 1   # only after the last update


def _file(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


BAD_INPUTS: list[tuple[list[str], str]] = [
    (["--timeout", "0"], "error: --timeout must be a positive number of seconds (got 0)"),
    (["--timeout", "-5"], "error: --timeout must be a positive number of seconds (got -5)"),
    (["--warmup", "-5"], "error: --warmup must be >= 0 (got -5)"),
    (["--min-lr", "-1"], "error: --min-lr must be a finite number >= 0 (got -1)"),
    (["--global-batch", "-8"], "error: --global-batch must be a positive number of examples (got -8)"),
    (["--steps", "10", "--trace-step", "12"], "error: --trace-step 12 is not one of the run's steps 0..9"),
    (["--partition", "0,3"], "error: boundaries [0, 3] must be 2 strictly increasing indices from 0 to 8"),
    (["--partition", "half"], "error: --partition must be profile, parameters, uniform or stage bounds like 0,3,6,10"),
    (["--model", "mlp", "--eval-interval", "-1"], "error: --eval-interval must be >= 0 (got -1)"),
    (["--data", "{tmp}/empty.txt"], "error: --data '{tmp}/empty.txt' is empty; give a text file"),
    (["--data", "{tmp}/blob.dat"], "error: --data: '{tmp}/blob.dat' is binary (it holds NUL bytes), not text"),
    (["--data", "{tmp}/blob.bin"], "error: --data '{tmp}/blob.bin' has no document index '{tmp}/blob.idx' beside it; "
                                   "write one there (little-endian int64 offsets"),
    (["--data", "{tmp}/short.txt"], "error: the val split has no examples"),
    (["--packing", "stuffed"], "error: --packing 'stuffed' is not one of pad, pack, ragged"),
    (["--model", "mlp", "--packing", "pad"], "error: --packing: --model 'mlp' takes no packing (its function has no "
                                             "packing parameter)"),
    (["--context", "0"], "error: --context must be a positive number of tokens (got 0)"),
    (["--data", "{tmp}/nofiles"], "error: --data '{tmp}/nofiles' is empty (a folder without files)"),
    (["--log-dir", "{tmp}/short.txt/logs"], "error: --log-dir '{tmp}/short.txt/logs' cannot be created: Not a "
                                            "directory; choose a writable folder"),
    (["--timeout", "nan"], "error: --timeout must be a positive number of seconds (got nan)"),
    (["--timeout", "inf"], "error: --timeout must be a positive number of seconds (got inf)"),
    (["--timeout", "1e-6"], "error: --timeout 1e-06 s is shorter than one exchange between ranks can take; give at "
                            "least 1 s"),
    (["--grad-clip", "nan"], "error: --grad-clip must be a finite gradient norm (got nan); 0 turns clipping off"),
    (["--seed", str(2**70)], "error: --seed must be a whole number from 0 to 2**63 - 1"),
    (["--schedule", "interleaved-1f1b", "--chunks", "1"], "error: --schedule interleaved-1f1b needs --chunks >= 2 "
                                                          "(got 1); use 1f1b for one stage per position"),
    (["--schedule", "auto", "--partition", "uniform"], "error: --schedule auto chooses the schedule and the split "
                                                       "together from measured layer costs: use --partition profile "
                                                       "(the default), not 'uniform'"),
    (["--schedule", "auto", "--chunks", "2"], "error: --schedule auto chooses the stages per position itself (got "
                                              "--chunks 2); drop --chunks"),
    (["--global-batch", "16", "-b", "3"], "error: --global-batch 16 is not a whole number of microbatches of "
                                          "--micro-batch-size 3 for dp 1 replicas"),
    (["--data", "/dev/zero"], "error: --data '/dev/zero' is not a regular file or folder (a device, pipe or socket)"),
    (["--data", "{tmp}/fifo"], "error: --data '{tmp}/fifo' is not a regular file or folder (a device, pipe or "
                               "socket)"),
    (["--model", "resnet", "--data", "{tmp}/nofiles"], "error: --data '{tmp}/nofiles' is no ImageFolder root "
                                                       "(Couldn't find any class folder in {tmp}/nofiles); give a "
                                                       "folder with one sub-folder of images per class"),
    (["--memory-budget", "0.001"], "error: --memory-budget 0.001 GiB: no plan fits the memory budget of 0.001 GiB "
                                   "per rank: the least any schedule, recompute and split needs is "),
    (["--memory-budget", "1", "--partition", "uniform"], "error: --memory-budget is planned for by --partition "
                                                         "profile only; drop it or use profile"),
    (["--memory-budget", "1", "--recompute", "full"], "error: --memory-budget chooses recompute per stage itself: "
                                                      "drop --recompute full"),
    (["--whole-microbatches"], "error: --whole-microbatches says how --memory-budget may plan: give a budget, or "
                               "drop it (without one, microbatches are never cut)"),
    (["--config", "{tmp}/blob.bin"], "error: --config '{tmp}/blob.bin' is not valid TOML: "),
    (["--config", "{tmp}/mpi.toml"], "error: parallel.backend (in --config '{tmp}/mpi.toml') 'mpi' is not one of "
                                     "auto, gloo, nccl (--backend takes the same values)"),
    (["--config", "{tmp}/lion.toml"], "error: optimizer.name (in --config '{tmp}/lion.toml') 'lion' is not one of "
                                      "adamw, sgd (--optimizer takes the same values)"),
]


@pytest.mark.timeout(120)
def test_bad_inputs_give_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _file(tmp_path, "empty.txt", b"")
    _file(tmp_path, "blob.bin", b"text\x00\x01\x02" * 100)
    _file(tmp_path, "blob.dat", b"text\x00\x01\x02" * 100)
    _file(tmp_path, "short.txt", b"0123456789")
    (tmp_path / "nofiles").mkdir()
    os.mkfifo(tmp_path / "fifo")   # nothing ever writes to it: reading it would wait for good
    _file(tmp_path, "mpi.toml", b'[parallel]\nbackend = "mpi"\n')
    _file(tmp_path, "lion.toml", b'[optimizer]\nname = "lion"\n')
    for flags, message in BAD_INPUTS:
        flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
        if "--log-dir" not in flags:
            flags += ["--log-dir", str(tmp_path / "runs")]
        with pytest.raises(SystemExit) as exc:   # a bad value on the command line, or met in set-up
            run(parse_args(["--steps", "2", *flags]))
        err = capsys.readouterr().err.strip().splitlines()
        # a budget run profiles first: on a busy machine the profile may warn that alike layers measured apart
        err = [line for line in err if not line.startswith("partition profile: layers")]
        assert exc.value.code == 2, (flags, err)
        assert len(err) == 1 and err[0].startswith(message.replace("{tmp}", str(tmp_path))), (flags, err)
        assert not torch.distributed.is_initialized()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,match", [
    (["--model", "mlp", "--schedule", "interleaved-1f1b", "--chunks", "16", "--microbatches", "4"],
     "mlp (tiny) has 10 layers but pp=1 x chunks=16 needs 16 stages"),
    (["--model", "gpt", "--preset", "huge"], "--preset 'huge' is not a gpt preset; choose tiny, tiny-1k, small"),
    (["--model", "gpt", "--data", "/nonexistent/corpus.txt"], "--data '/nonexistent/corpus.txt' does not exist"),
    (["--model", "mlp", "--precision", "fp16"], "precision fp16 (with a loss scale) needs CUDA; use bf16 on CPU"),
    (["--model", "mlp", "--resume", "/nonexistent/ck"], "checkpoint '/nonexistent/ck' does not exist"),
])
def test_trainer_prints_clear_error(flags: list[str], match: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(parse_args(["--log-dir", str(tmp_path), *flags]))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err[-2000:]
    assert match in err and "Traceback" not in err, err[-2000:]


def test_the_command_line_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeengine.train", "--log-dir", str(tmp_path), "--model", "gpt",
                           "--data", "/nonexistent/corpus.txt"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == "error: --data '/nonexistent/corpus.txt' does not exist; give a text file or a " \
                                  "folder of text files", proc.stderr[-2000:]


_RANK_DATA = '''
import torch.distributed as dist

from pipeengine.training.models import load_model


class Shifted:
    """The mlp's data, every value moved by the rank: the same path, other bytes (as on another node)."""

    def __init__(self, data, shift):
        self.data, self.shift = data, shift

    def num_examples(self, split):
        return self.data.num_examples(split)

    def example(self, split, index):
        x, y = self.data.example(split, index)
        return x + self.shift, y


def model(preset, data):
    built = load_model("mlp", None, None)
    built.data = Shifted(built.data, float(dist.get_rank()))
    return built
'''


def _differing(rank: int, world: int, common: list[str], rank1: list[str], path: str = "") -> tuple[int, str]:
    import contextlib
    import io
    if path and path not in sys.path:
        sys.path.insert(0, path)   # the pool's ranks were started before this test
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        run(parse_args([*common, *(rank1 if rank == 1 else [])]))
    return int(exc.value.code or 0), err.getvalue()


@pytest.mark.timeout(150)
def test_ranks_started_with_different_settings_or_data_are_told_which(tmp_path: Path, world2: Any) -> None:
    """Rank 1 given another value: one line on rank 0 naming the setting, both values and the ranks, exit 2,
    before anything else runs (no profiling, no checkpoint folder probe, no hang)."""
    (tmp_path / "rankdata.py").write_text(_RANK_DATA)
    common = ["--model", "mlp", "--steps", "2", "--pp", "2", "--log-dir", str(tmp_path), "--quiet"]
    rows = [
        (["--lr", "0.1"], "--lr: 0.003 on rank 0 but 0.1 on rank 1"),
        (["--partition", "uniform"], "--partition: 'profile' on rank 0 but 'uniform' on rank 1"),
        (["--precision", "bf16"], "--precision: 'fp32' on rank 0 but 'bf16' on rank 1"),
        (["--save-interval", "1"], "--save-interval: 0 on rank 0 but 1 on rank 1"),
        (["--pp", "1"], "--pp: 2 on rank 0 but 1 on rank 1"),   # the setting given, not one derived from it
    ]
    for rank1, message in rows:
        (code0, err0), (code1, err1) = world2.run(_differing, common, rank1)
        assert (code0, code1) == (2, 2), (rank1, err0, err1)
        assert err0 == f"error: the ranks were given different {message}; every rank must be started with the same " \
                       f"settings\n", (rank1, err0)
        assert err1 == ""   # said once, by rank 0
    common[1] = "rankdata:model"   # the same settings, other bytes behind them
    (code0, err0), _ = world2.run(_differing, common, [], str(tmp_path))
    assert code0 == 2 and re.fullmatch(
        r"error: the ranks were given different data \(--data\): '3,584 training and 512 validation examples, first "
        r"and last crc32 [0-9a-f]{8}' on rank 0 but '3,584 training and 512 validation examples, first and last "
        r"crc32 [0-9a-f]{8}' on rank 1; every rank must be started with the same settings\n", err0), err0


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    return run(parse_args(flags))


@pytest.mark.timeout(150)
def test_schedule_auto_trains_the_same_losses_as_1f1b_with_the_schedule_it_chose(tmp_path: Path, world2: Any) -> None:
    """auto measures, picks a schedule and a split (printed with the lower bound), and computes what 1f1b computes."""
    common = ["--model", "mlp", "--steps", "3", "--pp", "2", "--log-dir", str(tmp_path), "--quiet",
              "--eval-interval", "0", "--timeline-interval", "0"]
    auto = world2.run(_train, [*common, "--schedule", "auto"])[0]
    plain = world2.run(_train, [*common, "--schedule", "1f1b", "--partition", "uniform"])[0]
    assert auto["losses"] == plain["losses"]
    assert auto["schedule_run"] in ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "interleaved-zb", "zbv", "v-half",
                                    "v-min", "dualpipev") or auto["schedule_run"].startswith("synthesised-")
    assert auto["config"]["schedule"]["name"] == "auto"


@pytest.mark.timeout(150)
def test_static_shapes_from_the_command_line_train_the_same_losses(tmp_path: Path, world2: Any) -> None:
    """--static-shapes reaches the engine (no header after the first training step: tests/runtime/test_static_shapes.py)
    and changes nothing it computes."""
    common = ["--model", "mlp", "--steps", "3", "--pp", "2", "--log-dir", str(tmp_path), "--quiet",
              "--eval-interval", "0", "--timeline-interval", "0", "--partition", "uniform"]
    static = world2.run(_train_wire, [*common, "--static-shapes"])
    plain = world2.run(_train_wire, common)
    assert [r["static"] for r in static] == [True, True] and [r["static"] for r in plain] == [False, False]
    assert static[0]["losses"] == plain[0]["losses"]


def _train_wire(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    """The run's summary, and whether its engine's wire kept static training shapes."""
    from pipeengine.training.trainer import Trainer
    trainer = Trainer(parse_args(flags))
    return {**trainer.run(), "static": trainer.engine.wire.static}


@pytest.mark.timeout(150)
def test_dropout_masks_belong_to_the_model_not_to_the_layout(tmp_path: Path, world1: Any, world2: Any) -> None:
    """--dropout: pp 2 draws the masks one process draws (bitwise the same losses); two replicas draw the masks of
    their own microbatches, so dp 2 trains as dp 1 on the same global batch (to float round-off)."""
    common = ["--model", "mlp", "--steps", "3", "--dropout", "0.3", "-b", "4", "--global-batch", "32", "--quiet",
              "--log-dir", str(tmp_path), "--eval-interval", "0", "--timeline-interval", "0", "--partition", "uniform"]
    one = world1.run(_train, [*common, "--pp", "1"])[0]["losses"]
    two_positions = world2.run(_train, [*common, "--pp", "2"])[0]["losses"]
    two_replicas = world2.run(_train, [*common, "--pp", "1"])[0]["losses"]
    plain = world1.run(_train, [*common, "--pp", "1", "--dropout", "0"])[0]["losses"]
    assert two_positions == one and plain != one
    torch.testing.assert_close(torch.tensor(two_replicas), torch.tensor(one), rtol=1e-5, atol=0)


@pytest.mark.timeout(200)
def test_a_torch_dataset_or_a_stream_plugs_in(tmp_path: Path, world1: Any, world2: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A map-style Dataset (with val_data) trains as the engine's own protocol on the same examples, bitwise; an
    IterableDataset streams at pp 1 x dp 2 as one process reads it, resumes where it stopped (the examples
    consumed are skipped) and validates nowhere without val_data; a dataset of dicts is one line."""
    common = ["--steps", "4", "--quiet", "--log-dir", str(tmp_path), "--timeline-interval", "0", "--eval-interval",
              "2", "--partition", "uniform", "-b", "4"]
    plain = world2.run(_train, [*common, "--model", "mlp", "--pp", "2"])[0]
    mapped = world2.run(_train, [*common, "--model", "tests.training.datasets:mapstyle", "--pp", "2"])[0]
    assert mapped["losses"] == plain["losses"] and mapped["val_loss"] == plain["val_loss"]
    saves = str(tmp_path / "saves")
    stream = [*common, "--model", "tests.training.datasets:streamed", "--pp", "1", "--global-batch", "24"]
    one = world1.run(_train, stream)[0]
    two = world2.run(_train, [*stream, "--save-interval", "2", "--save-dir", saves])[0]
    resumed = world2.run(_train, [*stream, "--resume", os.path.join(saves, "step-00000002"), "--run-name", "r"])[0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert resumed["first_step"] == 2 and resumed["losses"] == two["losses"][2:]
    assert one["val_loss"] is None and "validation n/a (no validation data)" in summary_text(one)
    with pytest.raises(SystemExit) as exc:
        run(parse_args([*common, "--model", "tests.training.datasets:dicts"]))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Model.data[0] is a dict, not an (input, target) pair" in err, err


@pytest.mark.timeout(120)
def test_the_last_progress_line_shows_the_final_validation_and_tensorboard_counts_steps_as_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = run(parse_args(["--model", "mlp", "--steps", "3", "--log-interval", "1", "--log-dir", str(tmp_path),
                        "--run-name", "r", "--eval-interval", "2"]))
    lines = [line for line in capsys.readouterr().out.splitlines() if "] step " in line]
    assert [line.split("] step ")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"]
    assert f"val {s['val_loss']:.4f}" in lines[-1] and "val" not in lines[0], lines
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "r"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 3]   # after steps 2 and 3, as the console says


@pytest.mark.timeout(120)
def test_the_log_is_pythons_logging_with_the_rank_in_each_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Log lines are records of logger "pipeengine" (a handler of one's own sees the rank); --log-level warning keeps
    them off the screen while the summary (the run's screen, not a log) stays."""
    import logging
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append   # type: ignore[method-assign]
    logging.getLogger("pipeengine").addHandler(handler)
    try:
        common = ["--model", "mlp", "--steps", "2", "--log-dir", str(tmp_path), "--eval-interval", "0"]
        run(parse_args(common))
        out = capsys.readouterr().out
        mine = [r for r in seen if r.getMessage().startswith("model mlp/tiny: 10 layers")]
        assert "model mlp/tiny: 10 layers" in out and [getattr(r, "rank", None) for r in mine] == ["0"]
        run(parse_args([*common, "--log-level", "warning"]))
        out = capsys.readouterr().out
        assert "model mlp/tiny: 10 layers" not in out and "loss       first" in out
    finally:
        logging.getLogger("pipeengine").removeHandler(handler)
        logging.getLogger("pipeengine").setLevel(logging.INFO)


@pytest.mark.timeout(120)
def test_tokens_per_s_counts_real_tokens_with_the_padding_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Documents of their own lengths: tokens/s is the steady steps' real tokens over their wall time, and the
    padding fraction the positions they computed for nothing, in the summary, summary.json and TensorBoard
    (ragged at this short context: one document a row, tests/training/test_packing.py)."""
    from pipeengine.models.documents import Documents
    from pipeengine.training.data import step_indices
    from pipeengine.training.packing import Packing
    s = run(parse_args(["--model", "gpt", "--context", "32", "--packing", "ragged", "--steps", "5", "--log-dir",
                        str(tmp_path), "--run-name", "r", "--quiet", "--eval-interval", "0"]))
    out = capsys.readouterr().out
    size, m = s["global_batch"], s["config"]["schedule"]["microbatches"]
    docs, steady = Documents(context=32), s["timed_steps"]
    lengths = [docs.lengths("train")[step_indices(docs, "train", t * size, 1234, size)].tolist() for t in steady]
    real = sum(sum(x) for x in lengths)
    positions = sum(Packing("ragged", 32, linear_cost=12.0 * 64, one_row=False).positions(x, m)   # tiny: 64 wide
                    for x in lengths)
    assert s["padding_fraction"] == pytest.approx(1 - real / positions, rel=1e-12) and s["padding_fraction"] > 0
    assert s["tokens_per_s"] == pytest.approx(real / (s["wall_s_per_step"] * len(steady)), rel=1e-9)
    assert f"tokens/s (real tokens; padding {100 * s['padding_fraction']:.1f}% of the positions)" in out
    # model FLOPs: the real sequences' (a n + b n² each), the same wall time as tokens/s
    from pipeengine.models import gpt
    from pipeengine.training.resources import flops_per_length
    fit = flops_per_length(gpt.layer_factories(dataclasses.replace(gpt.presets()["tiny"](), block_size=32)), 32)
    assert fit is not None
    flops = sum(fit[0] * n + fit[1] * n * n for x in lengths for n in x)
    assert s["flops_per_sample"] == pytest.approx(flops / (size * len(steady)), rel=1e-9)
    assert s["tflops_per_rank"] == pytest.approx(flops / (s["wall_s_per_step"] * len(steady)) / 1e12, rel=1e-9)
    assert "FLOP per sample = 3 x its real tokens' forward, a mean)" in summary_text(s)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "r"), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Scalars("throughput/padding_fraction")[-1].value == pytest.approx(s["padding_fraction"], rel=1e-6)
    assert acc.Scalars("throughput/tokens_per_s")[-1].value == pytest.approx(s["tokens_per_s"], rel=1e-6)


@pytest.mark.timeout(120)
def test_a_dry_run_plans_predicts_and_takes_no_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = run(parse_args(["--model", "gpt", "--steps", "3", "--log-dir", str(tmp_path), "--run-name", "r", "--dry-run"]))
    out = capsys.readouterr().out
    assert s["dry_run"] and s["recompute"] == ["none"] and s["bounds"] == [0, 8] and s["predicted_step_s"] > 0
    assert "twin: predicted step" in out and "position 0: predicted peak" in out and "dry run: planned" in out
    assert "step 1/3" not in out and "=" * 72 not in out   # no step, no summary block
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["predicted_peak_memory_mib"] == s["predicted_peak_memory_mib"] and "losses" not in saved


def _probe_sizes(rank: int, world: int, flags: list[str]) -> tuple[int, int, int]:
    """(the element count the twin timed the optimizer on, the largest position's parameters, this rank's)."""
    import pipeengine.training.prediction as prediction
    from pipeengine.training.trainer import Trainer
    seen: list[int] = []
    timed = prediction.run_facts

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(args[5])
        return timed(*args, **kwargs)
    prediction.run_facts = recording   # type: ignore[assignment]
    try:
        trainer = Trainer(parse_args(flags))
        trainer.run()
    finally:
        prediction.run_facts = timed   # type: ignore[assignment]
    own = sum(p.numel() for p in trainer.engine.parameters)
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, own)
    return seen[-1], max(everyone), own


@pytest.mark.timeout(150)
def test_the_twin_times_the_optimizer_on_the_largest_positions_parameters(tmp_path: Path, world2: Any) -> None:
    """Its end of step is the step's, and a pass over more elements is slower per element ([Note: the optimizer's
    probe]): ResNet-18 at pp 2 holds 2.8 M parameters on position 0 and 8.4 M on position 1; both time 8.4 M."""
    got = world2.run(_probe_sizes, ["--model", "resnet", "--preset", "resnet18", "--pp", "2", "--steps", "1",
                                    "--log-dir", str(tmp_path), "--quiet", "--dry-run"])
    assert [g[0] for g in got] == [g[1] for g in got] == [max(g[2] for g in got)] * 2, got
    assert min(g[2] for g in got) < got[0][0] / 2, got   # one position holds well under half of it
