"""The house move (issue #31): engine/ in ordered floors, bottom up.

    facts (engine/*.py) -> kernels -> model -> arch -> loading -> hotcold -> runtime -> calibration

A module imports its own floor and the floors below it (tests/test_layering.py checks it,
imports inside functions included). This script moves the files (`git mv`) and rewrites
every import and dotted reference across the repository by the explicit maps below:

    python tools/house_move.py                    # move the files, then rewrite imports
    python tools/house_move.py --rewrite-imports  # only rewrite imports (after merging main)

Both are idempotent. `--rewrite-imports` is what a branch runs after merging main, to fix
files it added (or changed) that still name the old modules: absolute and relative
imports, `import x.y`, `from x import y`, imports inside functions, and dotted names or
`engine/...py` paths in strings, comments and docs (`engine.runtime.model.Norm`, a
monkeypatch target). A name that moved to another module (`NAMES`) is imported from its
new module; an attribute read through a module alias (`sparse.default_budgets`) cannot be
rewritten safely and is printed as a warning instead.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# old module -> new module (files that move)
MOVES = {
    # facts: torch-free checks every floor may run
    "engine.runtime.validation": "engine.validation",
    # kernels: the matrix formats and huge-page helpers the kernels use
    "engine.loading.host_memory": "engine.kernels.host_memory",
    "engine.loading.tensor_kinds": "engine.kernels.tensor_kinds",
    "engine.loading.quantized": "engine.kernels.quantized",
    "engine.loading.ggml_quants": "engine.kernels.ggml_quants",
    # model: the layer types, the transformer and its decode, KV cache, RoPE, the FFN variants
    "engine.runtime.model": "engine.model.layers",
    "engine.runtime.kv_cache": "engine.model.kv_cache",
    "engine.runtime.rope": "engine.model.rope",
    "engine.hotcold.moe": "engine.model.moe",
    "engine.loading.q4_ffn": "engine.model.q4_ffn",
    # loading: the dense mode's quantized load; the predictor sets (stored, imported)
    "engine.runtime.dense_quant": "engine.loading.dense_quant",
    "engine.hotcold.predictors": "engine.loading.predictors",
    # round 2: the context policy is the engine's (Engine.fit), used by the window, the CLI, the server
    "app.gui.context_policy": "engine.runtime.context_policy",
}

# (module after MOVES, name) -> the module that defines the name now
NAMES = {
    ("engine.model.layers", "Transformer"): "engine.model.transformer",
    ("engine.model.layers", "FfnObserver"): "engine.model.layers",
    ("engine.config", "parse_config"): "engine.arch",
    ("engine.config", "read_config"): "engine.arch",
    ("engine.loading.predictors", "import_powerinfer_predictors"): "engine.loading.predictor_import",
    ("engine.loading.predictors", "import_checkpoint_predictors"): "engine.loading.predictor_import",
    ("engine.kernels.numba_pool", "njit"): "engine.kernels.numba_jit",
    ("engine.hotcold.placement", "predictor_cpu_format"): "engine.cpu_formats",
    # re-export shims removed: each name is imported from the module that defines it
    **{("engine.hotcold.sparse", n): "engine.hotcold.sparse_solve" for n in (
        "PlacementReport", "Solving", "default_budgets", "pick_fast_device", "placement_problem",
        "problem_for_model")},
    ("engine.runtime.engine", "DEFAULT_CTX"): "engine.config",
    ("engine.runtime.engine", "ModelConfig"): "engine.config",
    ("engine.kernels.triton_q4", "available"): "engine.kernels.triton_ffn",
    **{("models_registry.fit", n): "engine.budget_policy" for n in (
        "RAM_RESERVE_FRACTION", "RAM_RESERVE_MIN", "VRAM_RESERVE", "usable_ram", "usable_vram")},
}
# round 2: rooms with one job (cpu_q4.py and gguf_import.py split along their jobs)
_Q4_KERNELS = (
    "pow2", "prefetch", "scale_of", "row_dot", "row_axpy", "nonlinearity", "next_live", "positions", "rows_pass",
    "ffn_rows_q4", "matvec_rows_q4", "dot4_q4_avx2", "axpy_q4_avx2", "quantize_act_q4", "matvec_q4_avx2",
    "quantize_act_q4_rows", "linear_q4", "matmul_q4_avx2", "row_at", "dots_pass", "ffn_rows_q4_act",
    "ffn_rows_q4_avx2", "HAS_AVX2")
NAMES.update({
    **{("engine.kernels.cpu_q4", n): "engine.kernels.q4_format" for n in (
        "QK", "BLOCK_BYTES", "QUANT", "n_blocks", "row_bytes", "dequantize_rows_q4", "padded")},
    ("engine.kernels.cpu_q4", "quantize_rows_q4"): "engine.kernels.q4_quantize",
    ("engine.kernels.cpu_q4", "Q4FfnRows"): "engine.kernels.q4_rows",
    **{("engine.kernels.cpu_q4", n): "engine.kernels.cpu_q4_numba" for n in _Q4_KERNELS},
    **{("engine.loading.gguf_import", n): "engine.loading.gguf_reader" for n in (
        "POWERINFER_MAGIC", "GGUF_MAGIC", "ARCHITECTURES", "GgufTensor", "GgufModel", "read_gguf", "dequantize")},
    **{("engine.loading.gguf_import", n): "engine.loading.gguf_plan" for n in (
        "PREDICTOR_NAME", "import_output_bytes")},
    # the registry package's re-exports: each name from the module that defines it
    **{("models_registry", n): "models_registry.paths" for n in ("models_dir", "set_models_dir", "set_offline")},
    **{("models_registry", n): "models_registry.resolve" for n in (
        "demo_model_dir", "downloaded_model_dir", "resolve_model")},
})
NAMES = {k: v for k, v in NAMES.items() if k[0] != v}

# new packages and what they hold
PACKAGES = {
    "engine.model": "The model floor: the layer types (`layers`), the transformer and its decode (`transformer`), "
                    "the KV cache, RoPE, the FFN variants (mixture of experts, 4-bit staged rows).",
}

TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".txt"}
SKIP_PARTS = {".git", "__pycache__", ".venv", "node_modules"}
# README.md is the `fresh` engineer's front page (team rule: only they edit it)
SKIP_FILES = {"README.md"}


def _path(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def _git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def move_files() -> list[str]:
    done = []
    for package, doc in PACKAGES.items():
        init = ROOT / package.replace(".", "/") / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{doc}"""\n', encoding="utf-8")
            _git("add", str(init.relative_to(ROOT)))
    for old, new in MOVES.items():
        src, dst = _path(old), _path(new)
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            _git("mv", str(src.relative_to(ROOT)), str(dst.relative_to(ROOT)))
            done.append(f"{old} -> {new}")
    return done


# ------------------------------------------------------------------ the modules that exist
def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not SKIP_PARTS & set(rel.parts) and rel.as_posix() not in SKIP_FILES and \
                (path.suffix in TEXT_SUFFIXES or path.relative_to(ROOT).as_posix() == ".ci/run"):
            out.append(path)
    return sorted(out)


def _existing(files: list[Path]) -> set[str]:
    return {_module_of(p) for p in files if p.suffix == ".py"}


_REVERSE = {new: old for old, new in MOVES.items()}


def canonical(module: str) -> str:
    return MOVES.get(module, module)


# ------------------------------------------------------------------ imports (AST)
def _render(indent: str, module: str, names: list[tuple[str, str | None]]) -> str:
    parts = [n if a is None or a == n else f"{n} as {a}" for n, a in names]
    line = f"from {module} import {', '.join(parts)}"
    if len(indent) + len(line) <= 120:
        return line
    inner = "".join(f"{indent}    {p},\n" for p in parts)
    return f"from {module} import (\n{inner}{indent})"


def _resolve_relative(package: str, level: int, module: str | None) -> str:
    base = package.split(".") if package else []
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _rewrite_from(node: ast.ImportFrom, name: str, is_package: bool, modules: set[str]) -> list[tuple]:
    """[(module, [(name, asname)])] the statement becomes, or None when it stays."""
    if any(a.name == "*" for a in node.names):
        return None
    if node.level:
        package = name if is_package else name.rpartition(".")[0]
        stem = _resolve_relative(package, node.level, node.module)
        known = stem in modules or any(f"{stem}.{a.name}" in modules for a in node.names)
        if not known or stem in MOVES:  # written from the file's old place (a moved file)
            old = _REVERSE.get(name)
            if old is not None:
                old_package = old if is_package else old.rpartition(".")[0]
                stem = _resolve_relative(old_package, node.level, node.module)
    else:
        stem = node.module or ""
    stem_now = canonical(stem)
    groups: dict[str, list] = {}
    changed = stem_now != stem
    for a in node.names:
        full = f"{stem}.{a.name}"
        if canonical(full) != full or full in modules:  # a submodule
            target = canonical(full)
            parent, _, leaf = target.rpartition(".")
            groups.setdefault(parent, []).append((leaf, a.asname or (a.name if leaf != a.name else None)))
            changed |= target != full
        else:
            dest = NAMES.get((stem_now, a.name), stem_now)
            groups.setdefault(dest, []).append((a.name, a.asname))
            changed |= dest != stem_now
    if not changed:
        return None
    return list(groups.items())


def rewrite_imports(text: str, name: str, is_package: bool, modules: set[str]) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            groups = _rewrite_from(node, name, is_package, modules)
            if groups is None:
                continue
            indent = " " * node.col_offset
            new = f"\n{indent}".join(_render(indent, m, ns) for m, ns in groups)
        elif isinstance(node, ast.Import):
            if not any(canonical(a.name) != a.name for a in node.names):
                continue
            new = "import " + ", ".join(canonical(a.name) + (f" as {a.asname}" if a.asname else "")
                                        for a in node.names)
        else:
            continue
        start = offsets[node.lineno - 1] + _col(lines[node.lineno - 1], node.col_offset)
        end = offsets[node.end_lineno - 1] + _col(lines[node.end_lineno - 1], node.end_col_offset)
        edits.append((start, end, new))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _col(line: str, col: int) -> int:
    """ast's column (UTF-8 bytes) as a character index."""
    return len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))


# ------------------------------------------------------------------ dotted names and paths
def _dotted_map() -> list[tuple[re.Pattern, str]]:
    pairs = {}
    for (module, attr), dest in NAMES.items():
        pairs[f"{module}.{attr}"] = f"{dest}.{attr}"
        old = _REVERSE.get(module)
        if old:
            pairs[f"{old}.{attr}"] = f"{dest}.{attr}"
    for old, new in MOVES.items():
        pairs.setdefault(old, new)
    out = []
    for old in sorted(pairs, key=len, reverse=True):
        out.append((re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w])"), pairs[old]))
    for old, new in MOVES.items():
        out.append((re.compile(rf"(?<![\w/.]){re.escape(old.replace('.', '/'))}\.py\b"),
                    new.replace(".", "/") + ".py"))
    return out


def rewrite_text(text: str, patterns) -> str:
    for pattern, new in patterns:
        text = pattern.sub(new, text)
    return text


_ATTRIBUTE = re.compile(r"\b(\w+)\.(\w+)\b")


def _alias_of(node: ast.stmt, modules: set[str]) -> dict[str, str]:
    """name -> project module, for one import statement that binds modules."""
    out = {}
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for a in node.names:
            full = canonical(f"{node.module}.{a.name}")
            if full in modules:
                out[a.asname or a.name] = full
    elif isinstance(node, ast.Import):
        for a in node.names:
            if a.asname and canonical(a.name) in modules:
                out[a.asname] = canonical(a.name)
    return out


def _attribute_uses(tree: ast.AST, modules: set[str]):
    """(attribute node, module its alias names, the import statement) for every read
    `alias.name` of a module alias, the alias looked up in the scopes around the read
    (a function's own imports first, then the enclosing ones, then the module's)."""
    found = []

    def visit(node, scopes):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scopes = scopes + [{}]
            body = node.body if isinstance(node.body, list) else [node.body]
            for sub in ast.walk(ast.Module(body=body, type_ignores=[])):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    for name, module in _alias_of(sub, modules).items():
                        scopes[-1][name] = (module, sub)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            for scope in reversed(scopes):
                if node.value.id in scope:
                    module, imp = scope[node.value.id]
                    found.append((node, module, imp, scope))
                    break
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    top = {}
    for sub in tree.body:
        if isinstance(sub, (ast.Import, ast.ImportFrom, ast.If, ast.Try)):
            for s in ast.walk(sub):
                if isinstance(s, (ast.Import, ast.ImportFrom)):
                    for name, module in _alias_of(s, modules).items():
                        top[name] = (module, s)
    visit(tree, [top])
    return found


def rewrite_attributes(text: str, modules: set[str]) -> str:
    """Reads of a moved name through a module alias (`cpu_q4.row_bytes`, `cpu_q4.Q4FfnRows`)
    become reads through the module that defines it (`q4_format.row_bytes`), imported next
    to the alias's import (in the same scope); an alias left unused is then removed by
    `ruff check --fix --select F401`."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits, needed = [], {}
    for node, module, imp, scope in _attribute_uses(tree, modules):
        dest = NAMES.get((module, node.attr))
        if dest is None:
            continue
        pkg, _, leaf = dest.rpartition(".")
        v = node.value
        start = offsets[v.lineno - 1] + _col(lines[v.lineno - 1], v.col_offset)
        end = offsets[v.end_lineno - 1] + _col(lines[v.end_lineno - 1], v.end_col_offset)
        edits.append((start, end, leaf))
        if scope.get(leaf, (None,))[0] != dest:
            needed.setdefault(id(imp), (imp, set()))[1].add((pkg, leaf))
    for imp, wanted in needed.values():
        indent = " " * imp.col_offset
        if isinstance(imp, ast.ImportFrom) and {pkg for pkg, _ in wanted} == {imp.module}:
            # `from engine.kernels import cpu_q4` -> `from engine.kernels import cpu_q4, q4_format`
            names = sorted({(a.name, a.asname) for a in imp.names} | {(leaf, None) for _, leaf in wanted},
                           key=lambda n: n[0].lower())
            start = offsets[imp.lineno - 1] + _col(lines[imp.lineno - 1], imp.col_offset)
            end = offsets[imp.end_lineno - 1] + _col(lines[imp.end_lineno - 1], imp.end_col_offset)
            edits.append((start, end, _render(indent, imp.module, names)))
            continue
        at = offsets[imp.end_lineno]
        edits.append((at, at, "".join(f"{indent}from {pkg} import {leaf}\n" for pkg, leaf in sorted(wanted))))
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _alias_warnings(path: Path, text: str) -> list[str]:
    """Reads of a moved name through a module alias (`from engine.hotcold import sparse` ...
    `sparse.default_budgets`), which only a person can rewrite."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = canonical(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = canonical(a.name)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and (module, node.attr) in NAMES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr} "
                           f"now lives in {NAMES[(module, node.attr)]}")
    return out


def rewrite_all() -> tuple[list[str], list[str]]:
    files = _files()
    modules = _existing(files)
    patterns = _dotted_map()
    changed, warnings = [], []
    for path in files:
        text = path.read_text(encoding="utf-8")
        new = text
        if path.suffix == ".py":
            rel = path.relative_to(ROOT)
            name = _module_of(path) if rel.parts[0] != "tests" else ".".join(rel.with_suffix("").parts[1:])
            new = rewrite_imports(new, name, path.name == "__init__.py", modules)
            if path.resolve() != Path(__file__).resolve():
                new = rewrite_attributes(new, modules)
            warnings += _alias_warnings(path, new)
        if path.resolve() != Path(__file__).resolve():
            new = rewrite_text(new, patterns)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed, warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewrite-imports", action="store_true",
                        help="only rewrite imports and dotted names (no file moves)")
    args = parser.parse_args(argv)
    if not args.rewrite_imports:
        for line in move_files():
            print("moved", line)
    changed, warnings = rewrite_all()
    for path in changed:
        print("rewrote", path)
    for line in warnings:
        print("warning:", line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
