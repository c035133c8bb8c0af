"""The download state of a model folder: `<model>/thermocline/download.json`.

`status` is "downloading" until every file has been verified against the Hub's hashes,
then "ready". A folder with no state file was placed there by hand and is taken as is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SIDECAR = "thermocline"
STATE_FILE = "download.json"


def state_path(model_dir: Path) -> Path:
    return Path(model_dir) / SIDECAR / STATE_FILE


def read_state(model_dir: Path) -> dict | None:
    try:
        data = json.loads(state_path(model_dir).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"status": "damaged"}
    return data if isinstance(data, dict) else {"status": "damaged"}


def write_state(model_dir: Path, state: dict) -> None:
    path = state_path(model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
