"""Imports run with the grain: app -> models_registry -> engine (errors only), app -> engine.
The engine loads folders and never asks the registry what a name means (names resolve in
`app.open_model`); Qt and the app stay out of the engine."""

import ast
from pathlib import Path

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
