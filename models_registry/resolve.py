"""Turn what a user types as MODEL into a model folder.

Accepted: an existing local folder; `demo` (the small model shipped in `resources/demo/`);
a catalogue id (`relullama-7b`) or a Hugging Face repo id (`SparseLLM/ReluLLaMA-7B`) that
has been downloaded into the models folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import UserError

from .paths import models_dir, repo_folder_name

DEMO_ID = "demo"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def demo_model_dir() -> Path:
    """The embedded demo model of the installed package (may not be built yet)."""
    import resources

    return Path(resources.__file__).parent / "demo"


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text


def downloaded_model_dir(repo_id: str) -> Path:
    """Where a repo lives (or would live) under the models folder."""
    return models_dir() / repo_folder_name(repo_id)


def resolve_model(name_or_path: str) -> Path:
    """The folder of a model given as a path, `demo`, a catalogue id or a repo id."""
    text = str(name_or_path).strip()
    if not text:
        raise UserError("no model given: pass a folder, `demo`, a catalogue id or an org/name repo id")
    if text == DEMO_ID:
        folder = demo_model_dir()
        if not (folder / "config.json").is_file():
            raise UserError(
                f"the demo model is not available: {folder} has no config.json (it is built "
                "with the package; reinstall Thermocline or pass another model)"
            )
        return folder
    path = Path(text).expanduser()
    if path.is_dir():
        folder = path.resolve()
        record_catalogue_facts(folder)
        return folder
    if path.is_file():
        hint = ("import it first: `thermocline models import FILE`" if path.suffix.lower() == ".gguf"
                else "pass the folder that holds its config.json")
        raise UserError(f"{_shown(text)} is a file, not a folder: a model is a folder; {hint}")

    from .catalogue import find_entry  # local import: catalogue loads a data file

    entry = find_entry(text)
    repo_id = entry.repo if entry is not None else (text if is_repo_id(text) else None)
    if repo_id is None:
        if path.suffix or "/" in text or "\\" in text or text.startswith("."):
            raise UserError(f"model folder {_shown(text)} does not exist")
        raise UserError(
            f"unknown model {_shown(text)}: pass a model folder, `demo`, a catalogue id "
            "(see `thermocline models list`) or a Hugging Face repo id like org/name"
        )
    folder = downloaded_model_dir(repo_id)
    if not is_ready(folder) and repo_id.startswith("local/"):
        raise UserError(f"{text} is not ready: its import did not finish; import it again "
                        "(`thermocline models import`), which replaces it")
    if not is_ready(folder):
        raise UserError(f"model {text} is not downloaded: run `thermocline models download {text}`")
    record_catalogue_facts(folder)
    return folder


def _shown(text: str) -> str:
    """A name from the command line quoted in an error, never echoed at length."""
    return repr(text if len(text) <= 160 else text[:150] + "...")


def record_catalogue_facts(folder: Path) -> None:
    """Give a catalogue download made before its record carried them the facts of the
    checkpoint its config.json may leave out (the activation; engine.config reads it from
    the folder). Downloads record them themselves; a folder that cannot be written is left."""
    from .catalogue import find_entry
    from .state import read_state, write_state

    state = read_state(folder)
    if not state or state.get("status") != "ready" or "activation" in state or not isinstance(state.get("repo"), str):
        return
    entry = find_entry(state["repo"])
    if entry is None:
        return
    state["activation"] = entry.activation
    try:
        write_state(folder, state)
    except OSError:
        pass


def is_ready(folder: Path) -> bool:
    """A download is usable once it has been verified and marked complete."""
    from .state import read_state  # local import: avoids a cycle with the downloader

    state = read_state(folder)
    if state is None and folder.name.startswith("local--"):
        return False  # imports write their state last: without it, the import was cut short
    return (folder / "config.json").is_file() and (state is None or state.get("status") == "ready")
