"""The trainer under a memory budget that runs microbatches as pieces: GPT's packing builds them (their rows
differ from microbatch to microbatch) and the run computes the losses of whole microbatches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeengine.runtime.budget import HEADROOM
from pipeengine.training.cli import parse_args
from pipeengine.training.trainer import run


def _train(rank: int, world: int, flags: list[str]) -> dict[str, Any]:
    return run(parse_args(flags))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gpt_on_pieces_trains_the_losses_of_whole_microbatches(tmp_path: Path, world2: Any) -> None:
    common = ["--model", "gpt", "--preset", "tiny", "--context", "512", "--pp", "2", "--schedule", "1f1b",
              "--log-dir", str(tmp_path), "--quiet", "--eval-interval", "2", "--timeline-interval", "0"]
    dry = world2.run(_train, [*common, "--dry-run"])[0]
    parts = dry["predicted_memory_parts_mib"].values()
    tight = max(sum(p.values()) - 0.75 * p["activations"] for p in parts) / (1 - HEADROOM) / 1024   # GiB
    cut = world2.run(_train, [*common, "--steps", "2", "--memory-budget", f"{tight:.4f}"])[0]
    whole = world2.run(_train, [*common, "--steps", "2"])[0]
    assert cut["pieces_per_microbatch"] > 1 and whole["pieces_per_microbatch"] == 1
    assert cut["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    assert cut["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)
