"""Smoke tests of the benchmark scripts, run as modules from the repository root (``python -m benchmarks.X``).

The scripts start together, on the first test's demand, and each test waits for its own: their start-ups (each
imports torch in its processes) overlap. A script of two ranks starts as ``torchrun --standalone --nproc_per_node 2``
would start it (RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT), without torchrun's own interpreter: one import
of torch fewer per script, on a suite whose two cores are busy. None of the assertions is a timing (a benchmark's
figures are its own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from benchmarks.common import kill_tree, start_ranks, wait_ranks
from tests.harness import ROOT

PY = [sys.executable, "-m"]
SCRIPTS = {   # name -> (its ranks, its command)
    "efficiency": (2, [*PY, "benchmarks.efficiency", "--schedules", "1f1b", "zb-h1", "--microbatches", "4",
                       "--tf", "0.002", "--tb", "0.002", "--tw", "0.002", "--steps", "2", "--warmup", "1", "--out",
                       "{out}", "--engines", "ours", "torch", "torch-train", "--back-to-back", "--critical-path"]),
    "efficiency-real": (2, [*PY, "benchmarks.efficiency", "--real", "--hidden", "64", "--depth", "4",
                            "--global-batch", "32", "--microbatches", "4", "--steps", "2", "--out", "{out}"]),
    "overhead": (2, [*PY, "benchmarks.overhead", "--microbatches", "4", "--steps", "1", "--reps", "2"]),
    "memory": (1, [*PY, "benchmarks.memory", "--pp", "2", "--microbatches", "8", "12", "--schedules", "1f1b",
                   "--act-mib", "2", "--steps", "1", "--no-gpt", "--no-extra", "--out", "{out}"]),
    "profile_noise": (1, [*PY, "benchmarks.profile_noise", "--blocks", "4", "--width", "32"]),
    "lateness": (1, [*PY, "benchmarks.lateness", "--reps", "5", "--waits", "0.1", "1"]),
    "real": (2, [*PY, "benchmarks.real", "--model", "mlp", "--preset", "tiny", "-m", "4",
                 "--micro-batch-size", "4", "--rounds", "2", "--out", "{out}"]),
}


class Ranks:
    """A script's processes (one, or the ranks of a process group: benchmarks.common.start_ranks), ended as one: when a
    rank fails the others are killed, as torchrun would (they would wait for it in a collective)."""

    def __init__(self, ranks: int, cmd: list[str], out: Path) -> None:
        self.args = [a.replace("{out}", str(out)) for a in cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        pipes: dict[str, Any] = {"cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        self.procs = (start_ranks(self.args, ranks, env, **pipes) if ranks > 1
                      else [subprocess.Popen(self.args, env=env, **pipes)])
        self.outputs: list[tuple[str, str]] = [("", "")] * ranks
        self.readers = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in range(ranks)]
        for t in self.readers:   # (their pipes never fill while another rank is waited for)
            t.start()

    def _read(self, rank: int) -> None:
        self.outputs[rank] = self.procs[rank].communicate()

    def communicate(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Every rank's outcome: the exit status of the rank that failed (else 0), their outputs one after the other."""
        failed, culprit = wait_ranks(self.procs, timeout)
        for t in self.readers:
            t.join()
        assert not failed.startswith("timed out"), f"{' '.join(self.args)}: {failed}"
        return subprocess.CompletedProcess(self.args, self.procs[culprit].returncode if failed else 0,
                                           "".join(o for o, _ in self.outputs), "".join(e for _, e in self.outputs))

    def kill(self) -> None:
        """Each rank still running and what it started; their outputs read to the end."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
        for t in self.readers:
            t.join()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Ranks, Path]]]:
    """Every benchmark script started at once (name -> (its ranks, its --out file))."""
    started = {}
    for name in SCRIPTS:
        out = tmp_path_factory.mktemp(name) / "out.jsonl"
        started[name] = (Ranks(*SCRIPTS[name], out), out)
    yield started
    for ranks, _ in started.values():
        ranks.kill()


def finished(scripts: dict[str, tuple[Ranks, Path]], name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Script ``name``'s outcome, once it ended (as subprocess.run gives it) and its --out file."""
    ranks, out = scripts[name]
    return ranks.communicate(timeout=220), out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_efficiency_smoke(scripts: Any) -> None:
    proc, out = finished(scripts, "efficiency")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["schedule"], r["pp"], r["microbatches"]) for r in rows] == [("1f1b", 2, 4), ("zb-h1", 2, 4)]
    for r in rows:
        assert r["errors"] == {}
        for engine in ("ours", "torch"):
            assert 0 < r[f"{engine}_efficiency"] <= 1.05, r
            assert r[f"{engine}_median_s"] > r["ideal_s"] * 0.95
        assert r["ratio_ours_over_torch"] > 0 and r["ratio_ours_over_torch_training"] > 0
        assert r["torch-train_median_s"] > r["ideal_s"] * 0.95   # step() plus a training loop's epilogue
        for engine in ("ours", "torch", "torch-train"):   # --back-to-back: no step ends before its compute can
            assert r[f"{engine}_back_to_back_s"] > r["ideal_s"] * 0.95
            assert r[f"{engine}_cpu_ms_per_step"] > 0   # every rank posts and waits: some CPU, however little
            assert r[f"{engine}_cpu_main_ms_per_step"] <= r[f"{engine}_cpu_ms_per_step"] + 1e-6   # a part of it
        assert r["ratio_ours_over_torch_back_to_back"] == pytest.approx(
            r["torch_back_to_back_s"] / r["ours_back_to_back_s"])
        # the measured costs are each rank's mean action times: a sleep takes at least its time and a loaded machine
        # adds to it (1.28-1.37 x seen under this test's load); costs fed in the wrong unit or the wrong schedule
        # would be off by a factor of pp or m. Not a timing target: the engine's efficiency against them is the
        # benchmark's figure (it fell to 0.39 once under the load of the scripts started together)
        assert 0.95 < r["ideal_measured_costs_s"] / r["ideal_s"] < 2.5, r
        assert r["ours_efficiency_vs_measured_costs"] == pytest.approx(r["ideal_measured_costs_s"] / r["ours_median_s"])
    assert rows[0]["ours_peak_stored"] == {"0": 2, "1": 1}          # 1F1B: min(p - s, m)
    assert rows[0]["ideal_s"] == pytest.approx(5 * 0.006)           # (m + p - 1)(f + b + w)
    assert "| 1f1b | 2 | 4 |" in proc.stdout and "ours/torch training step |" in proc.stdout
    assert "ours/torch back to back |" in proc.stdout
    # --critical-path: 1F1B's steps in parts, per engine (zb-h1 splits its backward: none); a receiver starts after its
    # sender's part ended, and a rank returns after its last part: no hop, start or end is negative
    assert "critical_path_ms" not in rows[1]
    paths = rows[0]["critical_path_ms"]
    assert set(paths) == {"ours", "torch", "torch-train"}
    for parts in paths.values():
        assert len(parts["fill"]) == len(parts["cooldown"]) == 1
        assert min(parts["start"], parts["end"], *parts["fill"], *parts["cooldown"]) >= 0, parts
        assert parts["rest"] > 0.95 * rows[0]["ideal_s"] * 1e3, parts   # the computes on the critical path, at least
    assert "| 1f1b | 2 | 4 | ours - torch |" in proc.stdout


def test_the_efficiency_table_fits_the_excess_and_the_cpu_in_m() -> None:
    """The host's cost per microbatch: least-squares lines in m of the step's excess over the ideal and of its CPU."""
    from benchmarks.common import efficiency_table, excess_fits
    rows = [{"schedule": "1f1b", "pp": 2, "microbatches": m, "ideal_s": 0.006 * (m + 1),
             "ours_median_s": 0.006 * (m + 1) + 0.001 + 0.0005 * m, "ours_cpu_ms_per_step": 2.0 + 0.75 * m,
             "ours_cpu_main_ms_per_step": 1.0 + 0.5 * m,
             "torch_median_s": 0.006 * (m + 1) + 0.0004 * m} for m in (4, 8, 16)]
    assert excess_fits(rows)[("1f1b", 2, "ours")] == pytest.approx((0.0005, 0.001))
    assert excess_fits(rows, "cpu_ms_per_step")[("1f1b", 2, "ours")] == pytest.approx((0.75, 2.0))
    assert excess_fits(rows, "cpu_main_ms_per_step")[("1f1b", 2, "ours")] == pytest.approx((0.5, 1.0))
    table = efficiency_table(rows)
    assert "| 1f1b | 2 | ours | 0.500 | 1.00 | 0.750 | 2.000 | 0.500 |" in table
    assert "| 1f1b | 2 | torch | 0.400 | " in table and table.endswith("| n/a | n/a | n/a |")   # torch's CPU: none


def test_critical_path_splits_a_step_into_parts_that_add_up() -> None:
    """benchmarks.critical_path on a made-up pp 2, m 2 1F1B step (ms): the fill's and the cooldown's hops are measured
    between the right parts, and the parts add up to the step."""
    from benchmarks.critical_path import critical_path_table, decompose, summarise
    ms = 1e-3
    rank0 = (0.0, 30 * ms, [("F", 0.5 * ms, 2.5 * ms), ("F", 2.6 * ms, 4.6 * ms),   # no input gradient: W only
                            ("W", 7.0 * ms, 11 * ms), ("W", 15.0 * ms, 19 * ms)])
    rank1 = (0.2 * ms, 20 * ms, [("F", 2.9 * ms, 4.9 * ms), ("W", 5.0 * ms, 7 * ms), ("B", 7.0 * ms, 9 * ms),
                                 ("F", 9.1 * ms, 11.1 * ms), ("B", 11.2 * ms, 13.2 * ms), ("W", 13.2 * ms, 14.6 * ms)])
    parts = decompose([rank0, rank1], 2)
    assert parts["start"] == pytest.approx(0.5 * ms)
    assert parts["fill"] == [pytest.approx(0.4 * ms)]        # rank 0's first F ends 2.5, rank 1's starts 2.9
    assert parts["cooldown"] == [pytest.approx(0.4 * ms)]    # rank 1's last B + W ends 14.6, rank 0's last W 15.0
    assert parts["end"] == pytest.approx(11 * ms)            # the last part ends 19, rank 0 returns at 30
    assert parts["step"] == pytest.approx(30 * ms)
    assert parts["rest"] == pytest.approx(30 * ms - 0.5 * ms - 0.4 * ms - 0.4 * ms - 11 * ms)   # they add up
    with pytest.raises(ValueError, match="a whole backward per microbatch"):   # a split backward's Ws come apart
        decompose([rank0, (0.0, 20 * ms, rank1[2][:-1])], 2)
    summary = summarise([parts, parts])
    assert summary["fill"] == [0.4] and summary["end"] == 11.0
    row = {"schedule": "1f1b", "pp": 2, "microbatches": 2, "critical_path_ms": {"ours": summary, "torch": summary}}
    assert "| 1f1b | 2 | 2 | ours - torch | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 |" in critical_path_table([row])


def test_overhead_analysis_of_records() -> None:
    """benchmarks.overhead: hop latency counts only transfers the receiver was already blocked on."""
    from benchmarks.overhead import analyse
    rank0 = [("F", 0, 0.0, 0.010), ("COMM", 0, 0.010, 0.0102), ("F", 1, 0.0102, 0.020), ("COMM", 1, 0.020, 0.0203),
             ("WAIT", 0, 0.0203, 0.0400), ("B", 0, 0.0400, 0.050)]
    rank1 = [("WAIT", 0, 0.001, 0.0105), ("F", 0, 0.0105, 0.0205),
             ("WAIT", 1, 0.0205, 0.0210), ("F", 1, 0.0210, 0.031),     # waited after the data left: not a hop
             ("B", 0, 0.031, 0.0396), ("COMM", 0, 0.0396, 0.0398)]
    stats = analyse([[rank0], [rank1]])
    assert stats["hops"]["F"] == [pytest.approx(0.0005)]              # rank 0's F0 ends 10.0 ms, rank 1 resumes 10.5
    assert stats["hops"]["B"] == [pytest.approx(0.0004)]              # rank 1's B0 ends 39.6 ms, rank 0 resumes 40.0
    assert stats["posts"] == [pytest.approx(0.0002), pytest.approx(0.0003), pytest.approx(0.0002)]
    assert stats["ms_per_step"][0]["F"] == pytest.approx(19.8)
    assert stats["ms_per_step"][1]["WAIT"] == pytest.approx(10.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_efficiency_real_mode_smoke(scripts: Any) -> None:
    proc, out = finished(scripts, "efficiency-real")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["mode"] == "real" and row["microbatches"] == 4
    assert row["ideal_speedup"] == pytest.approx(2 * 4 / 5)
    assert row["speedup"] == pytest.approx(row["single_s"] / row["pp2_s"])
    assert row["machine_bound_speedup"] > 0 and row["halves_together_s"] > 0 and row["half_alone_s"] > 0
    assert row["ratio_to_machine_bound"] == pytest.approx(row["speedup"] / row["machine_bound_speedup"])
    assert "Real compute (MLP 4 x 64" in proc.stdout and "this machine allows" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overhead_script_smoke(scripts: Any) -> None:
    proc, _ = finished(scripts, "overhead")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("batch_isend_irecv", "dist.isend", "group.send", "part 2: our engine, 1f1b, pp=2, m=4",
                 "rank 1: B ", "hop latency, ", "Python before a batch's first op reaches Gloo"):
        assert line in proc.stdout, (line, proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lateness_smoke(scripts: Any) -> None:
    proc, _ = finished(scripts, "lateness")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| watch") or line.startswith("| sleep")]
    assert len(rows) == 4 and "| 0.1 ms |" in rows[0] and "| 1 ms |" in rows[1], proc.stdout
    assert "10 device reads counted" in proc.stdout, proc.stdout   # 2 distances x 5 waits, each one read


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_noise_smoke(scripts: Any) -> None:
    proc, _ = finished(scripts, "profile_noise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("  layer ") == 4, proc.stdout
    for pp in (2, 4):
        assert f"pp {pp}, raw measurements" in proc.stdout and f"pp {pp}, shared + noise rule" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_memory_smoke(scripts: Any) -> None:
    """benchmarks.memory measures both engines in fresh processes: ours flat in m, torch's buffers held."""
    proc, out = finished(scripts, "memory")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["schedule"], r["pp"], r["m"]) for r in rows] == [("1f1b", 2, 8), ("1f1b", 2, 12)]
    ours = [[rank["growth_mib"] for rank in r["results"]["ours"]] for r in rows]
    # flat in m (growth would be 4 activations of 2 MiB): within one activation, as whether the last stage holds the
    # next forward's input, received early, beside a gradient still being sent depends on timing (wire.py; it never
    # does at m 4); under the suite's load m 8 once held it and m 12 did not (10.6 / 11.9 MiB), alone both do
    assert all(abs(a - b) <= 2.5 for a, b in zip(*ours)), ours
    held = [max(rank["held_mib"] for rank in r["results"]["torch"]) for r in rows]
    assert held[1] > held[0] + 4 * 2 * 0.9, held                       # torch: a receive buffer per microbatch


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_models_smoke(scripts: Any) -> None:
    """benchmarks.real on the tiny MLP: every variant timed, ratios paired per round, the table printed."""
    proc, out = finished(scripts, "real")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    variants = {"ours profile 1f1b", "ours profile zb-h1", "ours profile zbv", "ours profile dualpipev",
                "ours profile auto", "ours parameters 1f1b", "ours uniform 1f1b", "torch 1F1B (uniform)",
                "torch ZB (uniform)", "torch ZBV (uniform)", "torch DualPipeV (uniform)",
                "single process (accumulation)"}
    assert set(row["throughput"]) == variants | {"machine bound"}
    assert all(len(row["times"][v]) == 2 for v in variants | {"halves at once"})
    assert row["vs_torch"]["torch 1F1B (uniform)"] == 1.0 and set(row["vs_torch"]) == variants
    assert row["bounds"]["ours uniform 1f1b"] == [0, 5, 10] and len(row["bounds"]["ours profile 1f1b"]) == 3
    assert row["predicted_s"] > 0 and len(row["halves_at_once_s"]) == 2
    assert "| mlp/tiny | 2 x 1 | ours profile 1f1b |" in proc.stderr


@pytest.mark.slow
def test_dryrun_times_the_plan_command() -> None:
    """benchmarks.dryrun: one ``python -m pipeengine.plan`` timed, its projection read back; a refusal's row."""
    from benchmarks.dryrun import run, table
    fits = run("small", 8)
    assert fits["returncode"] == 0 and fits["plan"]["chosen"]["pp"] * fits["plan"]["chosen"]["dp"] == 8
    refused = {"preset": "70b", "gpus": 8, "wall_s": 3.0, "returncode": 2, "plan": None,
               "error": "plan: nothing fits: the least any candidate needs is 152.7 GiB per GPU (...); try ..."}
    rows = table([fits, refused]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| small | 8 | ") and "nothing fits (exit 2)" in rows[3]
    assert "152.7 GiB per GPU" in rows[3]
