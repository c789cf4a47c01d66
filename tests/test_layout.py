"""The shape of the code: layers import downwards, modules say what they hold, nothing grows past its size."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

PACKAGE = ROOT / "pipeengine"
LAYERS = ("schedule", "runtime", "training")   # each may import only the ones before it
# entry points may reach every layer: the schedule tool's --profile mode times a real model (lazily)
ENTRY_POINTS = {"pipeengine/schedule/cli.py", "pipeengine/train.py", "pipeengine/checkpoint.py"}
TORCH_FREE = ["pipeengine.schedule", "pipeengine.schedule.cli", "pipeengine.runtime.options",
              "pipeengine.runtime.topology", "pipeengine.training.config", "pipeengine.training.cli"]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def name_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The pipeengine modules ``path`` imports (resolved from relative imports)."""
    tree = ast.parse(path.read_text())
    package = name_of(path) if path.name == "__init__.py" else name_of(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if mod.startswith("pipeengine"):
                # "from . import planner" imports the module pipeengine.runtime.planner
                found |= {f"{mod}.{a.name}" if (ROOT / f"{mod}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                          else mod for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeengine")}
    return found


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_downwards() -> None:
    upward = []
    for path in modules():
        if rel(path) in ENTRY_POINTS:
            continue
        mine = layer_of(name_of(path))
        for mod in imports(path, top_level_only=False):
            theirs = layer_of(mod)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{rel(path)} imports {mod}")
    assert not upward, upward


def test_no_import_cycles() -> None:
    graph = {name_of(p): {m for m in imports(p, top_level_only=True) if m != name_of(p)} for p in modules()}

    def visit(node: str, path: list[str], done: set[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            if nxt in graph and not (nxt.count(".") < node.count(".") and node.startswith(nxt + ".")):
                visit(nxt, path + [node], done)   # a submodule importing its own package's __init__ is no cycle
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        visit(node, [], done)


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_every_module_says_what_it_holds_and_stays_small(path: Path) -> None:
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), f"{rel(path)}: a one-line module docstring first"
    shims = ENTRY_POINTS - {"pipeengine/schedule/cli.py"}   # python -m pipeengine.train / .checkpoint
    if path.name not in ("__init__.py", "__main__.py") and rel(path) not in shims:
        assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
                   for n in tree.body), f"{rel(path)}: an explicit __all__"
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{rel(path)}: {lines} lines (split it by concept)"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno is not None and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{rel(path)}: {long}"


def test_the_schedule_compiler_and_the_command_line_import_no_torch() -> None:
    code = (f"import sys, importlib\nfor m in {TORCH_FREE!r}:\n    importlib.import_module(m)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_public_api_is_small_and_lazy() -> None:
    import pipeengine
    assert set(pipeengine.__all__) == {"PipelineEngine", "Topology", "Plan", "make_plan", "build_schedule",
                                       "compile_schedule", "simulate", "Costs", "Model", "Packing", "save_checkpoint",
                                       "load_checkpoint", "export_checkpoint"}
    for name in pipeengine.__all__:
        assert getattr(pipeengine, name) is not None
