"""The trainer's settings, defined once: flags, --help, TOML files and checks generated from one declaration."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeengine.training.cli import parse_args, to_toml
from pipeengine.training.config import Config, settings
from tests.harness import ROOT


def problem(flags: list[str], world: int, capsys: pytest.CaptureFixture[str]) -> str:
    """What is wrong with these flags for this world: the command line's one line, or resolve()'s error."""
    try:
        cfg = parse_args(flags)
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]
    try:
        cfg.resolve(world)
    except ValueError as exc:
        return str(exc)
    return "no problem"


@pytest.mark.parametrize("flags,world,match", [
    (["--pp", "3"], 4, r"world size 4 is not divisible by --pp 3; use --pp in \[1, 2, 4\]"),
    (["--pp", "2", "--dp", "3"], 4, r"pp=2 x dp=3 = 6 ranks, but the world has 4"),
    (["--microbatches", "0"], 1, r"--microbatches must be >= 1 \(got 0\)"),
    (["--global-batch", "30", "--microbatches", "4", "--pp", "2"], 4,
     r"--global-batch 30 cannot be cut into equal microbatches with 4 on the fullest of dp 2 replicas; --microbatches "
     r"1, 2, 3, 5, 8, 15 can, or pass another --global-batch"),
    (["--global-batch", "16", "-b", "3"], 1, r"--global-batch 16 is not a whole number of microbatches of "
                                             r"--micro-batch-size 3 for dp 1 replicas"),
    (["--global-batch", "16", "-b", "3", "-m", "4"], 1,
     r"--global-batch 16 is not 4 microbatches of --micro-batch-size 3 on each of dp 1 replicas \(the first ones may "
     r"take one more\); give two of the three"),
    (["-m", "3", "--pp", "1"], 2,
     r"the global batch \(32 by default\) cannot be cut into equal microbatches with 3 on the fullest of dp 2 "
     r"replicas; --microbatches 1, 2, 4, 8, 16 can"),
    (["--global-batch", "3", "--pp", "1"], 4, r"--global-batch 3 has fewer examples than dp 4 has replicas"),
    (["--schedule", "forward"], 1, r"--schedule 'forward' is not one of gpipe, 1f1b, interleaved-1f1b, zb-h1"),
    (["--checkpoint", "some"], 1, r"--recompute must be 'none', 'selective', 'full' or 'every:K'"),
    (["--recompute", "every:0"], 1, r"every:K' with K >= 1 layers per region \(got 'every:0'\)"),
    (["--keep", "-1"], 1, r"--keep must be >= 0 \(got -1\)"),
    (["--save-interval", "-1"], 1, r"--save-interval must be >= 0 \(got -1\)"),
    (["--partition", "time"], 1, r"--partition must be profile, parameters, uniform or stage bounds like 0,3,6,10"),
    (["--memory-cap", "0"], 1, r"--memory-cap must be a positive number of GiB \(got 0\)"),
    (["--memory-cap", "2", "--partition", "uniform"], 1, r"--memory-cap is planned for by --partition profile"),
    (["--link-gbps", "0"], 1, r"--link-gbps must be a positive number of Gbit/s \(got 0\)"),
    (["--link-gbps", "100", "--partition", "uniform"], 1, r"--link-gbps is planned for by --partition profile"),
    (["--schedule", "interleaved-1f1b", "--chunks", "1"], 1, r"interleaved-1f1b needs --chunks >= 2 \(got 1\)"),
    (["--schedule", "1f1b", "--chunks", "2"], 1, r"--schedule 1f1b runs one stage per position"),
    (["--min-lr", "1", "--lr", "0.1"], 1, r"--min-lr 1 is above --lr 0.1"),
    (["--lr", "-1"], 1, r"--lr must be a positive number \(got -1\)"),
    (["--grad-clip", "nan"], 1, r"--grad-clip must be a finite gradient norm \(got nan\); 0 turns clipping off"),
    (["--timeout", "inf"], 1, r"--timeout must be a positive number of seconds \(got inf\)"),
    (["--timeout", "1e-6"], 1, r"--timeout 1e-06 s is shorter than one exchange between ranks can take"),
    (["--seed", str(2**70)], 1, r"--seed must be a whole number from 0 to 2\*\*63 - 1"),
    (["--optimizer", "lion"], 1, r"--optimizer 'lion' is not one of adamw, sgd"),
])
def test_bad_configs_are_explained(flags: list[str], world: int, match: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert re.search(match, problem(flags, world, capsys))


def test_interleaved_defaults_to_two_chunks() -> None:
    cfg = parse_args(["--schedule", "interleaved-1f1b"])
    cfg.resolve(2)
    assert cfg.schedule.chunks == 2
    cfg = parse_args(["--schedule", "1f1b"])
    cfg.resolve(2)
    assert cfg.schedule.chunks == 1


def test_every_setting_is_declared_once_with_a_flag_a_help_and_a_default() -> None:
    flags = [f for s in settings() for f in (s.flag, *s.aliases, *([s.short] if s.short else []))]
    assert len(flags) == len(set(flags))
    assert all(s.help and s.flag.startswith("--") for s in settings())
    sections = {"model", "data", "parallel", "schedule", "optimizer", "precision", "recompute", "saving", "faults",
                "logging"}
    assert {s.section for s in settings()} == sections
    assert parse_args([]) == Config()   # the flags' defaults are the dataclasses' defaults


def test_help_lists_every_default_and_every_preset_without_importing_torch() -> None:
    code = ("import sys, pipeengine.training.cli as t\ntry:\n    t.parse_args(['--help'])\n"
            "except SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    assert out.strip().endswith("TORCH False"), out[-300:]
    text = " ".join(out[out.index("options:"):].split())   # argparse wraps lines
    for flag, default in [("--lr", "0.003"), ("--warmup", "5"), ("--microbatches", "None"),
                          ("--global-batch", "None"), ("--seed", "1234"),
                          ("--grad-clip", "1.0"), ("--steps", "50"), ("--keep", "3"), ("--on-nonfinite", "stop")]:
        after = text[text.index(f"{flag} "):]
        assert f"(default: {default})" in after[:400], flag
    assert ("--global-batch INT examples per optimizer step over all replicas, whatever pp x dp; dp need not divide "
            "it (None: 32, or dp x 2pp if more") in text
    assert ("gpt: tiny, tiny-1k, small, gpt2-124m; resnet: tiny, resnet18, resnet18-gn, resnet50, resnet50-imagenet; "
            "mlp: tiny, small, large") in text


def test_the_engine_and_the_command_line_check_with_the_same_functions() -> None:
    """One place per check: the command line takes the engine's choices and checks from runtime/options.py,
    which imports no torch."""
    from pipeengine.runtime import options
    from pipeengine.training import sections
    assert sections.PRECISIONS is options.PRECISIONS and sections.WIRE_MODES is options.WIRE_MODES
    from pipeengine.training import checks
    assert checks.check_timeout is options.check_timeout and checks.parse_recompute is options.parse_recompute
    code = "import sys, pipeengine.training.config, pipeengine.runtime.options; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip() == \
        "False"


def test_config_file_then_flags_and_unknown_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text('model = "mlp"\nsteps = 7\nmicro-batch-size = 2\nlr = 1\nsave_on_exit = true\n')
    cfg = parse_args(["--config", str(path), "--steps", "9"])
    assert (cfg.model.name, cfg.optimizer.steps, cfg.data.micro_batch_size, cfg.optimizer.lr, cfg.saving.on_exit) == \
        ("mlp", 9, 2, 1.0, True)
    # --print-config writes a complete file that reads back to the same settings
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path), "--steps", "9", "--print-config"])
    assert exc.value.code == 0
    (tmp_path / "again.toml").write_text(capsys.readouterr().out)
    assert parse_args(["--config", str(tmp_path / "again.toml")]) == cfg
    text = to_toml(cfg)
    assert text.count(" =") == len(list(settings())) and text.count("\n[") == 10   # every setting, by section
    for text, message in [("stepz = 3\n", "unknown setting 'stepz'; did you mean 'steps'?"),
                          ('steps = "many"\n', "steps = 'many' should be int"),
                          ("steps = \n", "is not valid TOML"),
                          ('optimizer = "lion"\n', "optimizer (in --config"),       # the flags' checks, from a file
                          ('[optimizer]\nname = "lion"\n', "optimizer.name (in --config"),
                          ('device = "tpu"\n', "'tpu' is not one of auto, cpu, cuda"),
                          ("[optimizer]\nlrr = 1\n", "unknown setting 'lrr' in [optimizer]; did you mean 'lr'?"),
                          ("grad_clip = nan\n", "must be a finite gradient norm (got nan); 0 turns clipping off")]:
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            parse_args(["--config", str(path)])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_elastic_group_re_plans_pp_and_dp_for_its_size(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """launch/pipe.sh NNODES=MIN:MAX: a group restarted at a size --pp does not divide runs the deepest pipeline
    that does, the rest data-parallel; --dp follows the world; outside an elastic group it is an error."""
    with pytest.raises(ValueError, match="world size 2 is not divisible by --pp 4"):
        parse_args(["--pp", "4"]).resolve(2)
    monkeypatch.setenv("PIPEENGINE_ELASTIC", "1")
    cases = ((2, ["--pp", "4"], (2, 1)), (6, ["--pp", "4"], (3, 2)), (3, ["--pp", "2", "--global-batch", "24"], (1, 3)),
             (4, ["--pp", "2", "--dp", "4"], (2, 2)), (8, ["--pp", "4"], (4, 2)))
    for world, flags, want in cases:
        topo = parse_args(flags).resolve(world)
        assert (topo.pp, topo.dp) == want, (world, flags, topo)
    assert "elastic: 2 processes: pp 2 x dp 1 (--pp 4 does not divide 2)" in capsys.readouterr().err


@pytest.mark.parametrize("torch_version, vision, said", [
    ("2.14.1+cu130", "0.29.1+cu130", None),
    ("2.14.1", "0.29.1", None),
    ("2.13.0+cpu", "0.29.1", "torchvision 0.29.1 does not match torch 2.13.0+cpu (its compiled operators would fail "
                             "to load): pip install 'torchvision==0.28.*'"),
    ("2.14.1", "0.28.0", "pip install 'torchvision==0.29.*'"),
    ("2.13.0+cpu", "0.28.0", "torch 2.13.0+cpu is not the series pipeengine is tested on (2.14): pip install -e . "
                             "installs it"),
])
def test_the_installed_torch_and_torchvision_are_checked_at_start(torch_version: str, vision: str,
                                                                  said: str | None) -> None:
    from pipeengine.training.install import install_problem
    got = install_problem(torch_version, vision)
    assert (got is None) if said is None else (got is not None and said in got and "\n" not in got), got
    assert install_problem() is None   # what the tests run on


def test_setup_cfg_admits_exactly_the_tested_torch() -> None:
    from pipeengine.training.install import TESTED_TORCH, torchvision_for
    text = (Path(__file__).parents[2] / "setup.cfg").read_text()
    series = ".".join(map(str, TESTED_TORCH))
    assert f"torch>={series}.1,<2.{TESTED_TORCH[1] + 1}" in text
    assert f"torchvision>={torchvision_for(series)}.1,<0.{TESTED_TORCH[1] + 16}" in text


@pytest.mark.parametrize("flags, said", [
    (["--lrr", "3"], "error: unrecognized arguments: --lrr (did you mean --lr?) 3 (see --help)"),
    (["--sched", "1f1b"], "error: unrecognized arguments: --sched (did you mean --schedule?) 1f1b"),   # no prefixes
    (["--collective-timeout", "-1"], "error: --collective-timeout must be a positive number of seconds (got -1); "
                                     "leave it out for the default (1800 s: long, for legitimately slow collectives "
                                     "such as a checkpoint write)"),
    (["--exit-save-budget", "0.5"], "error: --exit-save-budget 0.5 s is shorter than writing a checkpoint can take"),
    (["--timeout", "0"], "error: --timeout must be a positive number of seconds (got 0); leave it out for the default "
                         "(600 s until the first step, then max(60 s, 20 x the median step))"),
])
def test_a_mistyped_flag_is_named_with_its_nearest_and_each_flag_quotes_its_own_default(
        flags: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(said) and len(err.splitlines()) == 1, err


def test_print_config_writes_every_setting_under_its_flags_name_and_reads_back(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    from pipeengine.training.config import to_toml
    text = to_toml(parse_args(["--save-interval", "7", "--model", "mlp"]))
    keys = {line.split("=")[0].strip("# ").strip() for line in text.splitlines() if "=" in line}
    assert keys == {s.flag[2:] for s in settings()}
    assert "save-interval = 7" in text and 'model = "mlp"' in text
    (tmp_path / "run.toml").write_text(text)
    cfg = parse_args(["--config", str(tmp_path / "run.toml")])
    assert cfg.saving.interval == 7 and cfg.model.name == "mlp"
    (tmp_path / "old.toml").write_text("[saving]\ninterval = 5\n")   # a field's name works too
    assert parse_args(["--config", str(tmp_path / "old.toml")]).saving.interval == 5


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_trainers_optimizer_is_torchs_fused_one_where_the_device_has_it(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--optimizer adamw|sgd: torch's fused step on CPU, the same hyperparameters, the default step's results to the
    rounding; where torch has no fused kernel (refused at construction) the default implementation."""
    import torch
    cfg = parse_args(["--optimizer", name, "--lr", "0.01", "--weight-decay", "0.1"]).optimizer
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(1003)), torch.nn.Parameter(torch.randn(17, 5))]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = cfg.build(ours)
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    ref = cls(plain, lr=0.01, weight_decay=0.1, **({"momentum": 0.9} if name == "sgd" else {}))
    assert type(opt) is cls and opt.defaults["fused"] is True and not ref.defaults.get("fused")
    assert {k: opt.defaults[k] for k in ("lr", "weight_decay")} == {"lr": 0.01, "weight_decay": 0.1}
    for _ in range(5):
        for p, q in zip(ours, plain):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, plain):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    real = cls.__init__

    def no_fused(self: Any, params: Any, **kw: Any) -> None:
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        real(self, params, **kw)

    monkeypatch.setattr(cls, "__init__", no_fused)
    assert not cfg.build([torch.nn.Parameter(torch.zeros(2))]).defaults.get("fused")
