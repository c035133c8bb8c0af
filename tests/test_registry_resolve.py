"""resolve_model: what a user types as MODEL -> a model folder, or a clear UserError."""

import json
import subprocess
import sys

import pytest

from engine.errors import UserError
from models_registry.paths import models_dir, set_models_dir
from models_registry.resolve import resolve_model
from models_registry.resolve import demo_model_dir
from models_registry.state import write_state


@pytest.fixture
def registry_dirs(tmp_path, monkeypatch):
    models = tmp_path / "models"
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(models))
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "config"))
    return models


def _model_folder(path, status=None):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if status:
        write_state(path, {"status": status})
    return path


def test_existing_folder_is_itself(tmp_path, registry_dirs):
    folder = _model_folder(tmp_path / "mine")
    assert resolve_model(str(folder)) == folder.resolve()


def test_catalogue_id_and_repo_id_map_to_org_name_folder(registry_dirs):
    folder = _model_folder(registry_dirs / "SparseLLM--ReluLLaMA-7B", status="ready")
    assert resolve_model("relullama-7b") == folder
    assert resolve_model("SparseLLM/ReluLLaMA-7B") == folder
    other = _model_folder(registry_dirs / "someone--tiny-relu", status="ready")
    assert resolve_model("someone/tiny-relu") == other


def test_not_downloaded_or_unfinished_says_how_to_download(registry_dirs):
    with pytest.raises(UserError, match=r"not downloaded: run `thermocline models download relullama-13b`"):
        resolve_model("relullama-13b")
    _model_folder(registry_dirs / "someone--half", status="downloading")
    with pytest.raises(UserError, match="not downloaded"):
        resolve_model("someone/half")


def test_unknown_names_are_refused_naming_what_is_accepted(registry_dirs):
    with pytest.raises(UserError, match="catalogue id"):
        resolve_model("no-such-model")
    with pytest.raises(UserError, match="does not exist"):
        resolve_model("./missing/folder.bin")
    with pytest.raises(UserError, match="no model"):
        resolve_model("  ")


def test_demo_is_the_package_resource_folder(registry_dirs):
    folder = demo_model_dir()
    if (folder / "config.json").is_file():
        assert resolve_model("demo") == folder
    else:
        with pytest.raises(UserError, match="demo model is not available"):
            resolve_model("demo")


def test_models_dir_env_then_setting_then_platform_default(tmp_path, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("THERMOCLINE_MODELS_DIR", raising=False)
    assert models_dir().parts[-2:] == ("Thermocline", "models")
    set_models_dir(tmp_path / "chosen")
    assert models_dir() == (tmp_path / "chosen").resolve()
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(tmp_path / "env"))
    assert models_dir() == tmp_path / "env"
    set_models_dir(None)
    monkeypatch.delenv("THERMOCLINE_MODELS_DIR")
    assert models_dir().parts[-2:] == ("Thermocline", "models")


_REGISTRY_MODULES = (
    "models_registry, models_registry.catalogue, models_registry.resolve, models_registry.fit, "
    "models_registry.download, models_registry.hardware, models_registry.manage"
)


def test_registry_code_never_imports_torch_or_qt_itself():
    # DESIGN.md: models_registry imports neither torch nor Qt, not even inside functions
    # (the hardware probe only looks at sys.modules for an already-imported torch).
    import ast
    from pathlib import Path

    import models_registry

    offenders = []
    for path in Path(models_registry.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in ("torch", "PySide6", "app")]
    assert not offenders


def test_importing_the_registry_loads_neither_torch_nor_qt():
    # The registry needs engine.errors; that only stays light if engine/__init__.py does not
    # import the engine eagerly (a PEP 562 __getattr__ would keep `from engine import Engine`).
    code = (
        f"import json, sys\nimport {_REGISTRY_MODULES}\n"
        "print(json.dumps([m for m in ('torch', 'PySide6') if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
