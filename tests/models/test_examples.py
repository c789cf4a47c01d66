"""The examples and the README's code run as written: your own model through the Python API and from the
command line, and every ``python`` block of the README."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeengine.training.cli import parse_args
from pipeengine.training.trainer import run
from tests.harness import ROOT, WorldPool

EXAMPLES = ROOT / "models" / "examples"


def _on_path() -> None:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _exec_readme(rank: int, world: int, folder: str) -> list[str]:
    os.chdir(folder)
    names = []
    for code in _readme_blocks():
        scope: dict[str, Any] = {"__name__": "__readme__"}
        exec(compile(code, "README.md", "exec"), scope)
        names.extend(sorted(k for k in scope if not k.startswith("__")))
    return names


@pytest.mark.timeout(200)
def test_the_readme_python_blocks_run_as_written(tmp_path: Path, world4: WorldPool) -> None:
    assert _readme_blocks(), "the README has no python block"
    names = world4.run(_exec_readme, str(tmp_path), timeout=180)
    assert all("engine" in n and "val" in n for n in names)
    assert (tmp_path / "checkpoints" / "readme" / "step-00000010").is_dir()
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {"0.weight", "1.0.weight", "1.1.weight", "6.1.bias", "7.weight"} <= set(state)   # as nn.Sequential names


def _python_api(rank: int, world: int, folder: str) -> None:
    _on_path()
    import python_api
    python_api.main(folder)


@pytest.mark.timeout(200)
def test_the_python_api_example_trains_saves_resumes_and_exports(tmp_path: Path, world4: WorldPool) -> None:
    world4.run(_python_api, str(tmp_path), timeout=180)   # the example asserts its own outcomes on every rank
    assert (tmp_path / "step-00000020").is_dir() and (tmp_path / "model.pt").is_file()


def _own(tmp: Path, *flags: str) -> dict[str, Any]:
    _on_path()
    return run(parse_args(["--model", "own_model:model", "--log-dir", str(tmp), "--quiet", "--eval-interval", "0",
                           "--partition", "uniform", *flags]))


@pytest.mark.timeout(120)
def test_your_own_model_and_data_from_the_command_line(tmp_path: Path) -> None:
    s = _own(tmp_path, "--steps", "60", "--lr", "0.01")
    assert s["config"]["model"]["preset"] == "narrow" and s["global_batch"] == 32
    assert s["final_loss"] < 0.5 * s["first_loss"]
    rows = "\n".join(f"{i / 100:.2f},{(i * 7 % 100) / 100:.2f},{i % 2}" for i in range(100))
    (tmp_path / "points.csv").write_text(rows + "\n")
    s = _own(tmp_path, "--steps", "3", "--data", str(tmp_path / "points.csv"), "--preset", "wide")
    assert s["config"]["model"]["preset"] == "wide" and s["steps_done"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--model", "own_model:model", "--preset", "huge"], "--preset 'huge' is not one of narrow, wide"),
    (["--model", "own_model:nothing"], "--model 'own_model:nothing': own_model has no function 'nothing'"),
    (["--model", "no_such_module:model"], "--model 'no_such_module:model': no module named 'no_such_module' (is its "
                                          "folder on PYTHONPATH, or the package installed?)"),
    (["--model", "operator:is_"], "--model 'operator:is_' returned bool, not a pipeengine.Model"),
    (["--model", "os.path:join"], "--model 'os.path:join' raised TypeError inside ("),   # a bug inside, located
    (["--model", "operator:not_"], "--model 'operator:not_': it must be callable as function(preset, data) (got the "
                                   "signature not_(a, /)"),
    (["--model", "tests.training.datasets:three"], "the factory of layer 1 returned int, not an nn.Module"),
    (["--model", "own-model"], "--model 'own-model' is not gpt, resnet, mlp or package.module:function"),
    (["--model", "own_model:model", "--data", "/nonexistent.csv"], "--data '/nonexistent.csv': expected rows "
                                                                   "x,y,label (0 or 1): [Errno 2]"),
])
def test_a_bad_model_is_one_line(flags: list[str], message: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    _on_path()
    with pytest.raises(SystemExit) as exit_:
        run(parse_args([*flags, "--log-dir", str(tmp_path), "--steps", "1"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
