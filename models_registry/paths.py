"""Where Thermocline keeps models and its registry settings.

Order of precedence for the models folder: the environment variable
`THERMOCLINE_MODELS_DIR` (tests and scripts), then the `models_dir` setting saved with
`set_models_dir()`, then `<platform user data dir>/Thermocline/models`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import platformdirs

APP_NAME = "Thermocline"
MODELS_DIR_ENV = "THERMOCLINE_MODELS_DIR"
CONFIG_DIR_ENV = "THERMOCLINE_CONFIG_DIR"
_SETTINGS_FILE = "registry.json"


def config_dir() -> Path:
    """Folder for the registry's settings and the stored Hub token."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def load_settings() -> dict:
    path = config_dir() / _SETTINGS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # a damaged settings file must not stop the app; defaults apply
    return data if isinstance(data, dict) else {}


def save_setting(key: str, value) -> None:
    """Set (or with None remove) one registry setting, written atomically."""
    settings = load_settings()
    if value is None:
        settings.pop(key, None)
    else:
        settings[key] = value
    folder = config_dir()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (_SETTINGS_FILE + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, folder / _SETTINGS_FILE)


def models_dir() -> Path:
    """The folder that holds downloaded models, one sub-folder per repo (`org--name`)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    configured = load_settings().get("models_dir")
    if isinstance(configured, str) and configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "models"


def set_models_dir(path: str | os.PathLike | None) -> None:
    """Remember a models folder chosen by the user (None: back to the default)."""
    save_setting("models_dir", str(Path(path).expanduser().resolve()) if path else None)


def repo_folder_name(repo_id: str) -> str:
    """`org/name` -> `org--name`, the folder name of a repo under the models folder."""
    return repo_id.replace("/", "--")


def set_offline(offline: bool) -> None:
    """Remember offline mode (no network; only downloaded models). HF_HUB_OFFLINE=1 also turns it on."""
    save_setting("offline", True if offline else None)
