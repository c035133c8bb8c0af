"""Which architectures Thermocline runs, read from a model's config.json.

Sparse inference only pays with ReLU-family activations (most FFN outputs exactly zero):
- Llama / Mistral layouts (gated FFN) with `relu`, `relu2` or a FATReLU-style threshold
  (ProSparse: `fatrelu`);
- Bamboo / TurboSparse (`BambooForCausalLM`): dReLU, relu on both gate and up;
- Falcon (ungated FFN) with `relu`.
A SiLU/GELU model would run dense and is refused with a message that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ModelFormatError

SUPPORTED_TEXT = (
    "model_type llama or mistral with hidden_act relu, relu2 or fatrelu; "
    "Bamboo/TurboSparse (BambooForCausalLM, dReLU); falcon with relu; "
    "smallthinker (SmallThinkerForCausalLM, ReGLU experts)"
)
_LLAMA_TYPES = {"llama", "mistral"}
_FALCON_TYPES = {"falcon", "RefinedWeb", "RefinedWebModel"}
_BAMBOO_ARCHS = {"BambooForCausalLM"}
_RELU_NAMES = {"relu": "relu", "relu2": "relu2", "relu_squared": "relu2", "squared_relu": "relu2",
               "fatrelu": "fatrelu", "fat_relu": "fatrelu", "drelu": "drelu"}


@dataclass(frozen=True)
class ArchInfo:
    family: str  # "llama" (gated: llama, mistral, bamboo) | "falcon" (ungated) | "smallthinker" (ReGLU experts)
    model_type: str
    activation: str  # relu | relu2 | fatrelu | drelu
    gated: bool


def detect_architecture(config: dict, known_activation: str | None = None) -> ArchInfo:
    """Classify a config.json; raise ModelFormatError naming what is supported.

    `known_activation` comes from the catalogue for repos whose config does not name its
    activation (the Falcon config has no activation field before transformers 4.36).
    """
    if not isinstance(config, dict):
        raise ModelFormatError("config.json is not a JSON object")
    model_type = str(config.get("model_type", ""))
    archs = set(config.get("architectures") or ())
    act_field = config.get("hidden_act") or config.get("activation")
    act = _RELU_NAMES.get(str(act_field).lower()) if act_field is not None else None

    if "SmallThinkerForCausalLM" in archs or model_type.lower() == "smallthinker":
        return ArchInfo("smallthinker", "smallthinker", "relu", True)  # experts: relu(gate) * up
    if archs & _BAMBOO_ARCHS or model_type.lower() in {"bamboo", "turbosparse"}:
        # Bamboo's config says hidden_act "relu"; its MLP applies it to gate and up (dReLU).
        if act_field is not None and act is None:
            raise ModelFormatError(_refusal(model_type or "bamboo", act_field))
        return ArchInfo("llama", model_type or "bamboo", "drelu", True)
    if model_type in _LLAMA_TYPES:
        if act is None:
            raise ModelFormatError(_refusal(model_type, act_field))
        return ArchInfo("llama", model_type, act, True)
    if model_type in _FALCON_TYPES:
        if act is None and act_field is None and known_activation == "relu":
            act = "relu"
        if act not in {"relu", "relu2"}:
            raise ModelFormatError(_refusal(model_type, act_field or "gelu (the Falcon default)"))
        return ArchInfo("falcon", model_type, act, False)
    raise ModelFormatError(
        f"unsupported architecture model_type={model_type or '(missing)'!r}; supported: {SUPPORTED_TEXT}"
    )


def _refusal(model_type: str, act_field) -> str:
    return (
        f"{model_type} model with activation {act_field!r} is not sparse enough to run here; "
        f"supported: {SUPPORTED_TEXT}"
    )
