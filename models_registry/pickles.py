"""PyTorch-pickle checkpoints in a model folder: have them converted, record the result.

The conversion itself needs torch (`engine.loading.checkpoint_convert`), which this package must
not import. The caller hands a converter in (the CLI passes the engine function); without
one, the engine module runs in a child process, so the window's downloads convert too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from engine.errors import UnsafePickleError, UserError

PICKLE_SHARD = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")
PICKLE_INDEX = "pytorch_model.bin.index.json"

Converter = Callable[[Path], dict]


def is_pickle_weight(name: str) -> bool:
    return bool(PICKLE_SHARD.match(name))


def has_pickle_weights(folder: Path) -> bool:
    return Path(folder).is_dir() and any(is_pickle_weight(p.name) for p in Path(folder).iterdir())


def convert_in_subprocess(model_dir: Path) -> dict:
    """`python -m engine.loading.checkpoint_convert MODEL_DIR` in a child process."""
    proc = subprocess.run([sys.executable, "-m", "engine.loading.checkpoint_convert", str(model_dir)],
                          capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    message = next((ln[len("error: "):] for ln in reversed(lines) if ln.startswith("error: ")), None)
    if proc.returncode == 3:
        raise UnsafePickleError(message or "a PyTorch pickle of the model was refused")
    raise UserError(message or f"converting the PyTorch checkpoint failed: {lines[-1] if lines else proc.returncode}")


def convert_pickles(model_dir: Path, state: dict, converter: Converter | None, *, origin: str) -> dict | None:
    """Convert the folder's pickles (if any) and update `state["files"]` to what is on disk.

    A refused pickle deletes the whole folder (nothing of a hostile model is kept) and
    raises UnsafePickleError naming `origin`.
    """
    model_dir = Path(model_dir)
    if not has_pickle_weights(model_dir):
        return None
    try:
        result = (converter or convert_in_subprocess)(model_dir)
    except UnsafePickleError as exc:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise UnsafePickleError(f"{origin}: {exc}; nothing of it was kept") from None
    files = state.setdefault("files", {})
    for rel in list(files):
        if is_pickle_weight(rel) or rel == PICKLE_INDEX:
            del files[rel]
    for rel in list(result.get("converted", {}).values()) + ([result["index"]] if result.get("index") else []):
        files[rel] = {"size": (model_dir / rel).stat().st_size, "hash": None, "verified": False,
                      "converted": True}
    state.setdefault("converted", {}).update(result.get("converted", {}))
    state["weights_format"] = "safetensors (converted from pytorch-bin)"
    return result
