"""The folder where Thermocline keeps its own files for a model: `<model>/thermocline/`."""

from __future__ import annotations

import re
from pathlib import Path

SIDECAR = "thermocline"
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def sidecar_dir(model_dir: Path) -> Path:
    return Path(model_dir) / SIDECAR


def group_by_layer(tensors: dict) -> dict[int, dict]:
    """{'layers.10.fc1.weight': t, ...} -> {10: {'fc1.weight': t}}, layers as integers."""
    layers: dict[int, dict] = {}
    for key, value in tensors.items():
        match = _LAYER_KEY.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = value
    return dict(sorted(layers.items()))
