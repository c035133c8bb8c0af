"""One module per architecture: its config parsing, its tensor names, its scales; and the
one reading of config.json (`parse_config`, `read_config`).

Adding an architecture means one module here, one catalogue row and one test family
(tests/test_real_configs.py); nothing lists the modules: every module of this package but
the shared loaders (`common`) is a family, found by `families()`. A module defines:

- `NAME`: what messages call it;
- `SUPPORTS`: what it runs, as the refusal of an unknown model lists it
  ("Falcon with ReLU (ReluFalcon)");
- `ARCHITECTURES`: the `architectures` entries of config.json it claims (the class the
  checkpoint was written by; the Hub's custom-code models often have no `model_type`);
- `MODEL_TYPES`: the `model_type` values it claims (lower case);
- `parse(fields, activation_hint) -> ModelConfig`: torch-free, reads config.json through
  `engine.config.ConfigFields` (checked values) and sets the optional scales;
- `load_globals(conv, cpu, head)` and `load_layer(conv, i, where, ffn_where)`: turn
  the checkpoint's tensors into the engine's layout (engine.model); they import torch
  inside, so the model registry can import this package to parse configs without it;
- optionally `PREDICTOR_TENSORS`: name templates ("{i}" = layer) of activation
  predictors carried inside the checkpoint (`fc1`, `fc2`), which the engine copies into
  its predictor sidecar (engine.loading.predictor_import.import_checkpoint_predictors);
- optionally `EXTENDS`: generic model types its architecture class builds on (Bamboo:
  "mistral"), so `architectures` picks it even where `model_type` names the generic one.

Detection: `model_type` names the family when a module claims it; `architectures` (the
class the checkpoint was written by) decides when `model_type` is missing, or when it
is one the class extends. Anything else is refused with the list of what is supported.
"""

from __future__ import annotations

import json
import pkgutil
from functools import cache
from importlib import import_module
from pathlib import Path
from types import ModuleType

from ..config import ConfigFields, ModelConfig, check_consistency, recorded_activation
from ..errors import ModelFormatError

# Modules of this package that are not families: the loaders the families share (torch).
_SHARED = frozenset({"common"})


@cache
def family_names() -> tuple[str, ...]:
    """The architecture modules of this package, by module name."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                        if not m.name.startswith("_") and m.name not in _SHARED))


def families() -> list[ModuleType]:
    return [import_module(f"{__name__}.{name}") for name in family_names()]


def supported() -> str:
    """What Thermocline runs, as refusals list it (each family's `SUPPORTS`)."""
    return ", ".join(module.SUPPORTS for module in families())


def module_for(raw: dict) -> ModuleType:
    """The architecture module that reads this config.json (a dict)."""
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ModelFormatError(f"config.json: architectures must be a list, not {archs!r}")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(f"config.json: model_type must be a string, not {model_type!r}")
    model_type = (model_type or "").lower()
    found = families()
    for arch in archs:
        for module in found:
            family = module.MODEL_TYPES + getattr(module, "EXTENDS", ())
            if arch in module.ARCHITECTURES and (not model_type or model_type in family):
                return module
    for module in found:
        if model_type in module.MODEL_TYPES:
            return module
    if model_type:
        raise ModelFormatError(f"unknown model_type {model_type!r} in config.json; supported: {supported()}")
    raise ModelFormatError(f"unknown architecture {archs or '(none named)'} in config.json, which has no model_type; "
                           f"supported: {supported()}")


def arch_module(name: str) -> ModuleType:
    """The module named by `ModelConfig.arch`."""
    if name not in family_names():
        raise ModelFormatError(f"no architecture module {name!r}")
    return import_module(f"{__name__}.{name}")


def parse_config(raw, activation_hint: str | None = None) -> ModelConfig:
    """config.json (already decoded) -> ModelConfig, or a ModelFormatError saying why not.

    `activation_hint` names the activation of a catalogue model whose config.json does not
    (Falcon configs before transformers 4.36 have no activation key); it never overrides one.
    """
    if not isinstance(raw, dict):
        raise ModelFormatError(f"config.json must be a JSON object, not a {type(raw).__name__}")
    module = module_for(raw)
    config = module.parse(ConfigFields(raw, module.NAME, supported()), activation_hint)
    check_consistency(config)
    return config


def read_config_json(model_dir: Path) -> dict:
    """A model folder's config.json as decoded JSON (the one reading of the file: `read_config`
    and the fit estimate's command take it from here), or a ModelFormatError saying why not."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{model_dir} has no config.json: is it a Hugging Face model folder?")
    shown = repr(str(path)[:160])  # quoted and cut: a downloaded folder's name is not ours to echo whole
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelFormatError(f"cannot read {shown}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(data)
    except ValueError as exc:  # bad JSON or bad UTF-8
        raise ModelFormatError(f"{shown} is not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{shown} is not a JSON object (it holds a {type(raw).__name__})")
    return raw


def read_config(model_dir: Path, activation_hint: str | None = None) -> ModelConfig:
    """A model folder's config.json -> ModelConfig (the activation the folder's download
    record names, when config.json names none and no hint is given)."""
    return parse_config(read_config_json(model_dir), activation_hint or recorded_activation(Path(model_dir)))
