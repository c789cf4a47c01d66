"""Shrinking to whatever world survives: every world gets a runnable layout (pp, dp, the global batch split), or one
line saying why none exists."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeengine.training.batch import resume_batch, split_global_batch
from pipeengine.training.elastic import HEADROOM, ModelState, replan_pp
from tests.harness import run_distributed

GIB = 2**30
# a 7B-like model in fp32: embedding, 32 blocks of 202 M parameters, head; AdamW; a rank has 80 GiB
SEVEN_B = ModelState([131_000_000 * 4] + [202_000_000 * 4] * 32 + [131_000_000 * 4], optimizer_states=2)
CAPACITY = 80 * GIB


def _runnable(world: int, asked: int, state: ModelState, capacity: float) -> tuple[int, str] | str:
    try:
        return replan_pp(world, asked, 1, state, capacity)
    except ValueError as exc:
        return str(exc)


def _fits(d: int, world: int, asked: int, state: ModelState, capacity: float) -> bool:
    return (world % d == 0 and d <= len(state.layer_bytes)
            and (d > asked or state.per_rank(d, world // d) <= HEADROOM * capacity))


@pytest.mark.parametrize("asked", [2, 4, 8])
def test_every_world_from_1_to_64_gets_a_layout_or_one_line(asked: int) -> None:
    """The property: the pp chosen divides the world, fits the layers and the memory, and no fitting divisor is
    nearer to --pp; a world --pp divides keeps it; the global batch then splits over dp, evenly or not."""
    laid_out, refused = [], []
    for world in range(1, 65):
        got = _runnable(world, asked, SEVEN_B, CAPACITY)
        if isinstance(got, str):
            assert "\n" not in got and f"{world} processes fit no pipeline" in got, got
            assert not any(_fits(d, world, asked, SEVEN_B, CAPACITY) for d in range(1, world + 1)), (world, got)
            refused.append(world)
            continue
        pp, why = got
        assert _fits(pp, world, asked, SEVEN_B, CAPACITY), (world, pp)
        assert world % asked or pp == asked
        nearer = [d for d in range(1, world + 1) if _fits(d, world, asked, SEVEN_B, CAPACITY)
                  and abs(math.log(d / asked)) < abs(math.log(pp / asked))]
        assert not nearer, (world, pp, nearer)
        assert why.startswith(f"elastic: {world} processes: pp {pp} x dp {world // pp}") and "\n" not in why
        dp = world // pp
        batch = resume_batch(dp, split_global_batch(8, None, None, None, pp=asked), None, None, None, pp=pp)[0]
        assert sum(batch.counts(dp)) * batch.micro == batch.size and min(batch.counts(dp)) >= 1
        laid_out.append(world)
    print(f"--pp {asked}: {len(laid_out)} of 64 worlds laid out, refused {refused}")
    assert len(laid_out) >= 50   # only worlds whose divisors are all too deep or too shallow are refused


@pytest.mark.parametrize("world, want", [(1016, (8, 127)), (1000, (8, 125)), (999, (9, 111)), (1024, (8, 128))])
def test_a_1024_gpu_job_at_pp_8_losing_gpus(world: int, want: tuple[int, int]) -> None:
    pp, why = replan_pp(world, 8, 1, SEVEN_B, CAPACITY)
    assert (pp, world // pp) == want, why
    batch = resume_batch(world // pp, split_global_batch(128, None, None, None, pp=8), None, None, None, pp=pp)[0]
    assert batch.size == 2048 and min(batch.counts(world // pp)) >= 1   # the global batch of the 1024-GPU run


def test_a_shallower_pipeline_is_taken_only_when_a_rank_can_hold_it() -> None:
    tiny = ModelState([4 * 2**20] * 8)   # 32 MiB: any pp fits
    assert replan_pp(7, 4, 1, tiny, CAPACITY)[0] == 7 and replan_pp(6, 4, 1, tiny, CAPACITY)[0] == 3
    pp, why = replan_pp(6, 4, 2, tiny, CAPACITY)   # 2 stages per position: 8 layers allow at most pp 4
    assert pp == 3 and "no deeper one fits the model's 8 layers" in why
    with pytest.raises(ValueError, match=r"elastic: 37 processes fit no pipeline: --pp 4 does not divide 37; .*\(pp 1 "
                                         r"would hold an estimated .* GiB of model state per rank.*; restart on a "
                                         r"multiple of 4 processes \(36\)"):
        replan_pp(37, 4, 1, SEVEN_B, CAPACITY)   # 37 is prime, deeper than the 34 layers


def _shrink_run(rank: int, world: int, flags: list[str], run_id: str | None) -> dict[str, Any]:
    import contextlib
    import io
    import os
    from pipeengine.training.cli import parse_args
    from pipeengine.training.trainer import run
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    if run_id is not None:   # a group torchrun restarted: it resumes by itself from this run's newest checkpoint
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            s = run(parse_args(["--model", "mlp", "--pp", "1", "--steps", "6", "--eval-interval", "0", "--quiet",
                                "--partition", "uniform", "--timeline-interval", "0", "--dropout", "0.1", *flags]))
    except SystemExit as exc:
        raise AssertionError(f"exit {exc.code}: {err.getvalue()}") from None
    finally:
        os.environ.pop("TORCHELASTIC_RUN_ID", None)
    return {"losses": s["losses"], "first_step": s["first_step"], "change": s["world_change"], "err": err.getvalue(),
            "micro": s["config"]["data"]["micro_batch_size"], "m": s["config"]["schedule"]["microbatches"]}


def _runs(rank: int, world: int, runs: list[tuple[list[str], str | None]]) -> list[dict[str, Any]]:
    return [_shrink_run(rank, world, flags, run_id) for flags, run_id in runs]   # (one start of 3 processes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_shrunk_from_4_to_3_ranks_goes_on_with_the_same_global_batch(tmp_path: Path, world4: Any) -> None:
    """4 ranks at pp 1 (dp 4, 16 microbatches of 2) save at step 3; the group restarts with 3 (dp 3 does not divide
    16: 6, 5, 5 microbatches) and resumes by itself, as torchrun's elastic restart does: its losses are the
    uninterrupted run's (the same mean over the same examples and dropout masks, up to reduction order), and
    bitwise those of a run started fresh at world 3 from the same checkpoint."""
    saves = str(tmp_path / "saves")
    common = ["--log-dir", str(tmp_path), "--save-dir", saves]
    straight = world4.run(_shrink_run, [*common, "--save-interval", "3", "--run-name", "straight"], "job")[0]
    # the survivors' save folder holds the checkpoint of step 3 (the pool's rank 0 still holds the first one's lock)
    shutil.copytree(os.path.join(saves, "step-00000003"), tmp_path / "survivors" / "step-00000003")
    shrunk, fresh = run_distributed(_runs, 3, [
        (["--log-dir", str(tmp_path), "--save-dir", str(tmp_path / "survivors"), "--run-name", "shrunk",
          "--save-interval", "3"], "job"),
        ([*common, "--run-name", "fresh", "--resume", os.path.join(saves, "step-00000003")], None)], timeout=200)[0]
    assert straight["micro"] == 2 and straight["m"] == 4
    assert shrunk["first_step"] == 3 and shrunk["micro"] == 2 and shrunk["m"] == 6, shrunk
    assert "restart: the group changed size: resuming from" in shrunk["err"]
    assert (shrunk["change"]["from"], shrunk["change"]["to"], shrunk["change"]["dp"]) == (4, 3, 3)
    assert fresh["losses"] == shrunk["losses"]
    torch.testing.assert_close(torch.tensor(shrunk["losses"]), torch.tensor(straight["losses"][3:]), rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 64, 128])
def test_the_slurm_example_starts_on_any_node_count_with_a_full_pipeline(nodes: int) -> None:
    """launch/slurm.sbatch's own flags (8 GPUs per node): every node count gets a global batch that gives each
    replica at least 2 x pp microbatches (a 1F1B bubble of at most (pp - 1) / (3 pp - 1))."""
    from pipeengine.training.cli import parse_args
    from tests.harness import ROOT
    text = (ROOT / "launch" / "slurm.sbatch").read_text()
    flags = text[text.index("launch/pipe.sh 8 gpus") + len("launch/pipe.sh 8 gpus"):].split("--max-restarts")[0]
    cfg = parse_args(flags.replace("\\", " ").split())
    topo = cfg.resolve(8 * nodes)
    counts = cfg.batch.counts(topo.dp)
    assert topo.pp == 8 and min(counts) >= 2 * topo.pp, (nodes, cfg.batch)
