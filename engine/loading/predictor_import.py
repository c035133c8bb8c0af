"""Where predictor sets come from besides training: PowerInfer's published `model_{N}.pt`
state dicts (loaded with `weights_only=True`, ordered by layer number, never as strings)
or its GGUF, and those a checkpoint carries (TurboSparse, found by the names its
architecture module lists). Each is checked against the model and saved to the sidecar.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from engine.arch import arch_module, read_config
from engine.errors import ModelFormatError
from engine.loading.gguf_predictors import import_gguf_predictors
from engine.loading.predictors import PredictorSet, at_own_precision
from engine.loading.weights import WeightSource

_POWERINFER_FILE = re.compile(r"^model_(\d+)\.pt$")


def import_powerinfer_predictors(src_dir: Path, model_dir: Path) -> Path:
    """PowerInfer's `model_{N}.pt` files (+ optional config.json sparse_threshold) -> our sidecar."""
    src_dir = Path(src_dir)
    files = {int(m.group(1)): p for p in src_dir.iterdir() if (m := _POWERINFER_FILE.match(p.name))}
    ggufs = sorted(src_dir.glob("*.gguf"))
    if not files and ggufs:  # PowerInfer's GGUF carries them as blk.N.fc1/fc2
        return import_gguf_predictors(ggufs[0], model_dir)
    if not files:
        raise ModelFormatError(f"{src_dir} has no model_N.pt predictor files")
    threshold = 0.0
    config = src_dir / "config.json"
    if config.is_file():
        try:
            threshold = float(json.loads(config.read_text(encoding="utf-8")).get("sparse_threshold", 0.0))
        except (OSError, ValueError, TypeError):
            raise ModelFormatError(f"cannot read {config}") from None
    layers = {}
    for number in sorted(files):  # numeric order: layer 10 after layer 2
        try:
            state = torch.load(files[number], map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - weights_only refuses anything but plain tensors
            # Never torch's message: it ends in advice to load the file with weights_only=False.
            raise ModelFormatError(f"{files[number].name} holds code, not only tensors, and cannot be loaded "
                                   "safely; Thermocline never runs it") from None
        if not isinstance(state, dict):
            raise ModelFormatError(f"{files[number].name} is not a state dict")
        layers[number] = {k: v for k, v in state.items() if k in ("fc1.weight", "fc2.weight")}
    predictors = PredictorSet._from_layers(layers, [threshold] * len(layers), "powerinfer", src_dir)
    if (Path(model_dir) / "config.json").is_file():
        cfg = read_config(model_dir)
        predictors.check(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)
    return predictors.save(model_dir)


def import_checkpoint_predictors(model_dir: Path, config) -> Path | None:
    """Predictors carried inside the checkpoint -> our sidecar (its path), unless there is
    one already. None when the architecture or this checkpoint carries none.

    The names come from the architecture module's `PREDICTOR_TENSORS` (engine/arch); every
    layer must have both, with shapes that fit the model. They are read with the threshold
    0: TurboSparse fires a neuron when sigmoid(logit) > 0.5, i.e. logit > 0 (equality has
    measure zero).
    """
    names = getattr(arch_module(config.arch), "PREDICTOR_TENSORS", None)
    if names is None or PredictorSet.exists(model_dir):
        return None
    source = WeightSource(model_dir)
    fc1_name, fc2_name = names
    layers = range(config.num_layers)
    present = [source.has(fc1_name.format(i=i)) and source.has(fc2_name.format(i=i)) for i in layers]
    if not any(present):
        return None
    if not all(present):
        missing = [i for i in layers if not present[i]]
        raise ModelFormatError(f"the checkpoint carries predictors for some layers only (none for {missing[:8]})")
    fc1 = [at_own_precision(source.get(fc1_name.format(i=i))) for i in layers]  # at the checkpoint's precision
    fc2 = [at_own_precision(source.get(fc2_name.format(i=i))) for i in layers]
    predictors = PredictorSet(fc1, fc2, [0.0] * config.num_layers, source="checkpoint")
    predictors.check(config.num_layers, config.hidden_size, config.intermediate_size)
    return predictors.save(model_dir)
