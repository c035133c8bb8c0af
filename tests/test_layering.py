"""Imports run with the grain.

- The top level: app -> models_registry -> engine (errors only), app -> engine. The engine
  loads folders and never asks the registry what a name means (names resolve in
  `app.open_model`); Qt and the app stay out of the engine.
- Inside engine/, its floors bottom up (import_graph.FLOORS: facts, kernels, model, arch,
  loading, hotcold, runtime, calibration): a module imports its own floor and those below,
  imports inside functions counted too.
- No import circle anywhere in the project (engine, models_registry, app, bench, tools,
  thermocline_vllm, the tests' helpers), imports inside functions counted too.
- The vLLM plugin (thermocline_vllm) stands alone: it imports nothing of Thermocline, and
  nothing at all when vLLM reads its entry point (vLLM loads it in every process it starts).
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import import_graph

import engine

# None: a catalogue fact of a checkpoint (the activation an old config.json leaves out) is
# recorded in the model's folder at download (engine/config.py `recorded_activation`).
_REGISTRY_READERS: set[str] = set()


def _imports(root: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(root)))
    return found


def test_engine_imports_neither_qt_nor_the_app():
    found = _imports(Path(engine.__file__).parent)
    assert not found.get("PySide6") and not found.get("app")


def test_engine_asks_the_registry_nothing_but_the_listed_facts():
    found = _imports(Path(engine.__file__).parent)
    assert found.get("models_registry", set()) <= _REGISTRY_READERS


def test_every_engine_subpackage_is_a_floor():
    root = Path(engine.__file__).parent
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == set(import_graph.FLOORS) - {"facts"}


def test_engine_imports_run_down_its_floors():
    up = [f"{e.source} -> {e.target} (line {e.line})" for e in import_graph.upward(import_graph.graph())]
    assert not up, "imports against engine's floors (facts < kernels < model < arch < loading < hotcold " \
                   "< runtime < calibration):\n" + "\n".join(up)


def test_no_import_circle_anywhere():
    found = import_graph.circles(import_graph.graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    """The checks above would pass on a graph that missed these (the kinds circles hide in)."""
    edges = {(e.source, e.target, e.in_function) for e in import_graph.graph()}
    assert ("app.cli", "app.gui.main", True) in edges  # the window, imported when it opens
    assert ("engine.arch.llama", "engine.arch.common", True) in edges  # `from .common import` in a function
    assert ("engine.arch.llama", "engine.config", False) in edges  # `from ..config import`


def test_every_name_asked_of_a_project_module_is_there():
    """A module or name that moved leaves nothing behind (what `house_move.py --rewrite-imports`
    fixed after each merge, found without running the code): every import of a project module,
    inside functions too, every read through a module alias, every dotted name in a string."""
    missing = import_graph.unresolved()
    assert not missing, "names asked of project modules that do not have them:\n" + "\n".join(missing)


def test_a_name_left_behind_by_a_move_is_found(tmp_path, monkeypatch):
    stale = tmp_path / "stale_helper.py"
    stale.write_text(
        "from engine.runtime.model import Norm\n"
        "from engine.kernels import cpu_q4\n"
        "from engine.kernels.cpu_q4 import quantize_rows_q4\n\n\n"
        "def f(monkeypatch):\n"
        "    from models_registry import resolve_model\n"
        "    monkeypatch.setattr('engine.kernels.cpu._NO_SUCH_NAME', 1)\n"
        "    return cpu_q4.n_blocks, Norm, quantize_rows_q4, resolve_model\n")
    real = import_graph.project_files()
    monkeypatch.setattr(import_graph, "project_files", lambda: {**real, "stale_helper": stale})
    found = "\n".join(import_graph.unresolved())
    for words in ("no module engine.runtime.model", "cpu_q4 has no quantize_rows_q4",
                  "models_registry has no resolve_model", "cpu_q4 has no n_blocks", "cpu has no _NO_SUCH_NAME"):
        assert "stale_helper.py:" in found and words in found, words


def test_the_vllm_plugin_imports_nothing_of_thermocline_and_nothing_until_registered():
    root = import_graph.ROOT / "thermocline_vllm"
    found = _imports(root)
    assert not {"engine", "app", "models_registry", "bench", "tools"} & set(found), found
    init = ast.parse((root / "__init__.py").read_text(encoding="utf-8"))
    top = [n for n in init.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in top)
    # importing it loads neither torch nor vLLM nor transformers (this venv has no vLLM)
    probe = "import sys, thermocline_vllm; print(sorted({'torch', 'vllm', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=import_graph.ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    project = tomllib.loads((import_graph.ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"thermocline": "thermocline_vllm:register"}
