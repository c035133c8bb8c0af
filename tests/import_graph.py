"""The project's import graph, read from the code (imports inside functions included).

`python tests/import_graph.py` prints the figures (circles, arrows against engine's floors,
imports inside functions, noqa comments); `tests/test_layering.py` asserts on the same graph.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "models_registry", "app", "bench", "tools", "thermocline_vllm")

# engine's floors, bottom up: a module may import its own floor and the ones below.
# The facts are engine's top-level modules (torch-free: errors, units, activations, config).
FLOORS = ("facts", "kernels", "model", "arch", "loading", "hotcold", "runtime", "calibration")


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "tests":  # the tests' helpers are imported by bare name (conftest's sys.path)
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    found = {}
    for top in PACKAGES + ("tests",):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(path)] = path
    return found


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of a dotted name that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _functions_lines(tree: ast.AST) -> set[int]:
    """ids of the import statements written inside a function."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inside.add(id(sub))
    return inside


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` names, relative ones resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".") if package else []
    base = base[: len(base) - node.level + 1] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict) -> list[Import]:
    tree = _tree(path)
    inside = _functions_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = _from_module(node, package)
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved and resolved != name:
                found.append(Import(name, resolved, node.lineno, id(node) in inside))
    return found


def graph() -> list[Import]:
    modules = project_files()
    edges = []
    for name, path in modules.items():
        edges += imports_of(name, path, modules)
    return edges


def floor_of(module: str) -> str | None:
    """engine's floor of a module; None outside engine."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    if len(parts) == 1 or parts[1] not in FLOORS:
        return "facts"
    return parts[1]


def upward(edges: list[Import]) -> list[Import]:
    """engine's imports that run up its floors."""
    out = []
    for e in edges:
        a, b = floor_of(e.source), floor_of(e.target)
        if a and b and FLOORS.index(b) > FLOORS.index(a) and e.source != "engine":
            out.append(e)
    return out


def circles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.source, set()).add(e.target)
        succ.setdefault(e.target, set())
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def defined_names(path: Path) -> set[str] | None:
    """The names a module defines at its top level (defs, classes, assignments, imports, also
    inside top-level if/try/with blocks); None when it has a module `__getattr__` (any name goes)."""
    names = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__dict__"}
    todo = list(_tree(path).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return names


def _has(module: str, name: str, modules: dict, cache: dict) -> bool:
    """Whether `module.name` is something: a submodule, or a name the module defines."""
    if f"{module}.{name}" in modules:
        return True
    if module not in cache:
        cache[module] = defined_names(modules[module])
    return cache[module] is None or name in cache[module]


def unresolved() -> list[str]:
    """Every name the project's code asks of a project module that the module does not have:
    `import a.b` and `from a.b import c` (inside functions too) of a module that is not there,
    or of a name it does not define; `alias.name` read through an alias bound to a project
    module (`from engine.kernels import cpu_q4` ... `cpu_q4.row_bytes`); and dotted names of
    project modules in strings (a monkeypatch target, `"engine.kernels.cpu._DENSE_MIN"`).
    What a moved file or name leaves behind, found without running the code."""
    modules = project_files()
    cache: dict = {}
    dotted = re.compile(r"^(?:%s)(?:\.\w+)+$" % "|".join(PACKAGES[:3]))
    out = []
    for name, path in modules.items():
        tree = _tree(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases: dict[str, str] = {}
        where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top in PACKAGES and a.name not in modules:
                        out.append(f"{where}:{node.lineno}: no module {a.name}")
                    elif a.asname and a.name in modules:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                stem = _from_module(node, package)
                if stem.split(".")[0] not in PACKAGES and not node.level:
                    continue
                if stem not in modules:
                    out.append(f"{where}:{node.lineno}: no module {stem}")
                    continue
                for a in node.names:
                    if a.name != "*" and not _has(stem, a.name, modules, cache):
                        out.append(f"{where}:{node.lineno}: {stem} has no {a.name}")
                    elif f"{stem}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{stem}.{a.name}"
        rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                    for a in n.args + n.kwonlyargs + n.posonlyargs}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and isinstance(node.ctx, ast.Load):
                module = aliases.get(node.value.id)
                if module and node.value.id not in rebound and not _has(module, node.attr, modules, cache):
                    out.append(f"{where}:{node.lineno}: {module} has no {node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.match(node.value):
                parts = node.value.split(".")
                for n in range(len(parts), 0, -1):
                    if ".".join(parts[:n]) in modules:
                        break
                module = ".".join(parts[:n])
                if n < len(parts) and module in modules and not _has(module, parts[n], modules, cache):
                    out.append(f"{where}:{node.lineno}: {module} has no {parts[n]} (in a string)")
    return out


def function_imports() -> int:
    count = 0
    for path in project_files().values():
        count += len(_functions_lines(_tree(path)))
    return count


def noqa_count() -> int:
    pattern = re.compile(r"#\s*noqa")
    return sum(len(pattern.findall(p.read_text(encoding="utf-8"))) for p in project_files().values())


def main() -> None:
    edges = graph()
    found = circles(edges)
    print(f"circles: {len(found)}")
    for c in found:
        print("   ", len(c), " ".join(c))
    up = upward(edges)
    print(f"upward arrows in engine: {len(up)}")
    for e in up:
        print(f"    {e.source} -> {e.target} (line {e.line}{', in a function' if e.in_function else ''})")
    inside = [e for e in edges if e.in_function]
    print(f"project imports inside functions: {len(inside)} "
          f"(engine: {sum(e.source.startswith('engine') for e in inside)})")
    print(f"import statements inside functions (any module): {function_imports()}")
    print(f"noqa comments: {noqa_count()}")


if __name__ == "__main__":
    main()
