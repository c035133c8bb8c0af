"""One module per architecture: its config parsing, its tensor names, its scales.

Adding an architecture means one module here (named in `MODULES`), one catalogue row
and one test family (tests/test_real_configs.py). A module defines:

- `NAME`: what messages call it;
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
  its predictor sidecar (engine.predictors.import_checkpoint_predictors);
- optionally `EXTENDS`: generic model types its architecture class builds on (Bamboo:
  "mistral"), so `architectures` picks it even where `model_type` names the generic one.

Detection: `model_type` names the family when a module claims it; `architectures` (the
class the checkpoint was written by) decides when `model_type` is missing, or when it
is one the class extends. Anything else is refused with the list of what is supported.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from ..errors import ModelFormatError

MODULES = ("llama", "bamboo", "minicpm", "falcon", "smallthinker")


def modules() -> list[ModuleType]:
    return [import_module(f"{__name__}.{name}") for name in MODULES]


def module_for(raw: dict) -> ModuleType:
    """The architecture module that reads this config.json (a dict)."""
    from ..config import SUPPORTED

    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ModelFormatError(f"config.json: architectures must be a list, not {archs!r}")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(f"config.json: model_type must be a string, not {model_type!r}")
    model_type = (model_type or "").lower()
    found = modules()
    for arch in archs:
        for module in found:
            family = module.MODEL_TYPES + getattr(module, "EXTENDS", ())
            if arch in module.ARCHITECTURES and (not model_type or model_type in family):
                return module
    for module in found:
        if model_type in module.MODEL_TYPES:
            return module
    if model_type:
        raise ModelFormatError(f"unknown model_type {model_type!r} in config.json; supported: {SUPPORTED}")
    raise ModelFormatError(f"unknown architecture {archs or '(none named)'} in config.json, which has no model_type; "
                           f"supported: {SUPPORTED}")


def arch_module(name: str) -> ModuleType:
    """The module named by `ModelConfig.arch`."""
    if name not in MODULES:
        raise ModelFormatError(f"no architecture module {name!r}")
    return import_module(f"{__name__}.{name}")
