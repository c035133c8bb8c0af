"""Bamboo and TurboSparse-Mistral (`BambooForCausalLM`, model_type `bamboo`): the Mistral
layout with dReLU, relu(gate) * relu(up), although the config says `hidden_act` "relu".

TurboSparse carries its activation predictors in the checkpoint as
`model.layers.{i}.mlp.predictor.fc1/fc2.weight` (fc2(relu(fc1(x))) on the FFN input before
its norm, a neuron fires when sigmoid > 0.5, i.e. logit > 0); the engine copies them into
its predictor sidecar. Torch-free at import (see engine/arch/__init__.py).
"""

from __future__ import annotations

from ..config import ConfigFields, ModelConfig
from .llama import TENSORS, load_globals, load_layer, parse_gated  # noqa: F401 (same tensors)

NAME = "Bamboo"
SUPPORTS = "Mistral/Bamboo with dReLU (Bamboo, TurboSparse)"
ARCHITECTURES = ("BambooForCausalLM",)
MODEL_TYPES = ("bamboo", "turbosparse")
EXTENDS = ("mistral",)  # BambooForCausalLM under model_type "mistral" is still Bamboo (dReLU)
PREDICTOR_TENSORS = ("model.layers.{i}.mlp.predictor.fc1.weight", "model.layers.{i}.mlp.predictor.fc2.weight")


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    # "relu" here means relu on both gate and up (dReLU); anything not ReLU-family is refused.
    activation = read.activation("hidden_act", default="relu")
    if activation == "relu":
        activation = "drelu"
    return parse_gated(read, "bamboo", activation, model_type=str(read.raw.get("model_type") or "bamboo"))
