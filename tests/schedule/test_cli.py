"""The schedule tool, ``python -m pipeengine.schedule``: timeline, figures, files, and --profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeengine.schedule.cli import main


def test_cli_prints_timeline_and_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("position 0 |F0 F1 F2 F3 ")
    assert "bubble (simulated)  0.273" in out and "bubble (theory)     0.273" in out
    assert "peak in flight      4 3 2 1" in out


@pytest.mark.parametrize("name,extra", [("gpipe", []), ("zb-h1", []), ("forward", []),
                                        ("interleaved-1f1b", ["--chunks", "2"])])
def test_cli_every_schedule(name: str, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schedule", name, *extra]) == 0
    assert "makespan" in capsys.readouterr().out


def test_cli_reports_deadlocked_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.txt"
    f.write_text("F0 B0 F1 B1\nF1 F0 B0 B1\n")
    assert main(["--file", str(f)]) == 1
    err = capsys.readouterr().err
    assert "deadlock: 0 -> 1 -> 0" in err
    assert main(["--file", str(tmp_path / "missing.txt")]) == 2


def test_cli_checks_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "ok.csv"
    f.write_text("F0,F1,B0,B1\nF0,B0,F1,B1\n")
    assert main(["--file", str(f), "--show-program"]) == 0
    assert "sendF0>1" in capsys.readouterr().out


def test_schedule_module_imports_no_torch() -> None:
    import subprocess
    import sys
    code = "import sys, pipeengine.schedule; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_cli_zb_h1_makespan_matches_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    # m(f+b+w) + (p-1)(f+b-w) = 8 * 2.5 + 3 * 1.5 = 24.5 (was 26 when lowered with unit costs)
    assert main(["--schedule", "zb-h1", "--pp", "4", "-m", "8", "--tw", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "makespan            24.5\n" in out
    assert "bubble (simulated)  0.184" in out and "bubble (theory)     0.184" in out


@pytest.mark.timeout(120)
def test_profile_cli_prints_measured_costs_and_every_schedules_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--profile", "mlp", "--preset", "tiny", "--pp", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")}
    assert set(rows) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}, out
    layers = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(layers) == 10   # mlp tiny: one row of costs per layer
    bounds = [int(b) for b in rows["1f1b"].split("[")[1].split("]")[0].split(",")]
    assert bounds[0] == 0 and bounds[-1] == 10 and len(bounds) == 3
    assert main(["--profile", "mlp", "--preset", "huge", "--pp", "2"]) == 2
    assert "not a mlp preset" in capsys.readouterr().err


def test_binary_schedule_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sched.bin"
    path.write_bytes(b"F0 B0\n\xff\xfe\x00")
    assert main(["--file", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: schedule file {str(path)!r} is not UTF-8 text (byte 0xff at offset 6); "
                                       f"a schedule file has one line per position, e.g. F0 F1 B0 B1\n")


@pytest.mark.parametrize("flags,message", [
    (["--tf", "-1"], "argument --tf: -1 is not a finite number >= 0"),
    (["--tb", "nan"], "argument --tb: nan is not a finite number >= 0"),
    (["--pp", "0"], "argument --pp: 0 is below 1"),
    (["-m", "two"], "argument --microbatches/-m: 'two' is not a whole number"),
])
def test_bad_numbers_are_named_not_a_traceback(flags: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_plans_auto_from_given_per_layer_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--schedule auto with costs per layer (lists or a file): what the trainer's auto would build, named; the
    same costs from a file give the same plan; bad input is one line and status 2; no torch is imported."""
    args = ["--schedule", "auto", "--pp", "2", "-m", "4", "--tf", "1,1,3,1,1,1", "--tb", "2,2,6,2,2,2", "--tw", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    said = next(line for line in out.splitlines() if line.startswith("schedule auto: "))
    assert said.startswith("schedule auto: zbv (from the library; placement v") and "bounds [0, 2, 3, 4, 6]" in said
    assert "simulated step 64 units" in out and out.startswith("position 0 |")
    costs = tmp_path / "costs.txt"
    costs.write_text("# f b w per layer\n" + "".join(f"{f} {2 * f} 1\n" for f in (1, 1, 3, 1, 1, 1)))
    assert main(["--schedule", "auto", "--pp", "2", "-m", "4", "--costs", str(costs)]) == 0
    assert said in capsys.readouterr().out
    for bad, message in ((["--tf", "1,2", "--tb", "1,2,3"], "give one each, or one per layer"),
                         (["--schedule", "1f1b", "--tf", "1,2"],
                          "costs per layer (--tf 1,2,...) are for --schedule auto")):
        assert main([*(["--schedule", "auto"] if "--schedule" not in bad else []), *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    import subprocess
    import sys
    code = ("import sys; from pipeengine.schedule.cli import main; main(['--schedule', 'auto', '--pp', '2']); "
            "print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip().endswith("False"), run.stdout[-300:] + run.stderr[-300:]
