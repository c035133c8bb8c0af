"""Which architectures Thermocline runs: the engine's own reading of config.json.

The registry's download, import and fit checks call `engine.arch.parse_config` (torch-free,
one module per architecture in engine/arch/), so a model the registry accepts is one the
engine loads, and one it refuses is refused with the engine's message. Sparse inference
only pays with ReLU-family activations; a SiLU/GELU model is refused with a message that
says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.arch import parse_config, supported
from engine.config import ModelConfig
from engine.errors import ModelFormatError

SUPPORTED_TEXT = supported()

__all__ = ["SUPPORTED_TEXT", "ArchInfo", "detect_architecture"]


@dataclass(frozen=True)
class ArchInfo:
    family: str  # "llama" (gated: llama, mistral, bamboo, minicpm) | "falcon" (ungated) | "smallthinker" (ReGLU experts)
    model_type: str
    activation: str  # relu | relu2 | fatrelu | drelu
    gated: bool
    config: ModelConfig | None = None  # the engine's parse of the same config.json


def detect_architecture(config, known_activation: str | None = None) -> ArchInfo:
    """Classify a config.json; raise ModelFormatError naming what is supported.

    `known_activation` comes from the catalogue for repos whose config does not name its
    activation (the Falcon config has no activation field before transformers 4.36); the
    engine reads the same hint for a model downloaded from the catalogue.
    """
    if not isinstance(config, dict):
        raise ModelFormatError(f"config.json must be a JSON object, not a {type(config).__name__}")
    parsed = parse_config(config, known_activation)
    return ArchInfo(parsed.family, parsed.model_type, parsed.activation, parsed.gated, parsed)
