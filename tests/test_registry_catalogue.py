"""The catalogue data file and the supported-architecture check."""

from __future__ import annotations

import pytest

from engine.errors import ModelFormatError
from models_registry.arch import SUPPORTED_TEXT, detect_architecture
from models_registry.catalogue import get_entry, load_catalogue
from models_registry.fit import shape_from_config

REQUIRED = {
    "demo": None,
    "relullama-7b": "PowerInfer/ReluLLaMA-7B-Predictor",
    "relullama-13b": "PowerInfer/ReluLLaMA-13B-Predictor",
    "relullama-70b": "PowerInfer/ReluLLaMA-70B-Predictor",
    "prosparse-llama-2-7b": "PowerInfer/prosparse-llama-2-7b-predictor",
    "prosparse-llama-2-13b": "PowerInfer/prosparse-llama-2-13b-predictor",
    "bamboo-base": "PowerInfer/Bamboo-base-v0.1-predictor",
    "bamboo-dpo": "PowerInfer/Bamboo-DPO-v0.1-predictor",
    "relufalcon-40b": "PowerInfer/ReluFalcon-40B-Predictor",
    "turbosparse-mistral": None,
}


def test_catalogue_lists_the_supported_models_with_their_predictor_repos():
    entries = {e.id: e for e in load_catalogue()}
    assert len(entries) == len(load_catalogue())  # ids are unique
    for model_id, predictor_repo in REQUIRED.items():
        entry = entries[model_id]
        assert entry.predictor.repo == predictor_repo
        assert entry.license and entry.description and entry.context_length > 0
        assert entry.activation in {"relu", "fatrelu", "drelu", "relu2"}
        if entry.repo:
            assert {"config.json", "*.safetensors", "tokenizer.json"} <= set(entry.files)
        if predictor_repo:
            assert "model_*.pt" in entry.predictor.files
    assert entries["turbosparse-mistral"].predictor.source == "train"
    assert get_entry("SparseLLM/ReluLLaMA-7B").id == "relullama-7b"  # repo ids work too


def test_catalogue_shapes_are_supported_and_agree_with_the_listed_size():
    for entry in load_catalogue():
        if entry.config is None:
            assert entry.id == "demo"
            continue
        arch = detect_architecture(entry.config, entry.activation)
        assert arch.activation == entry.activation
        assert arch.model_type == entry.architecture
        assert entry.size_bytes == 2 * shape_from_config(entry.config, arch).total_params


# The sizes every config needs (the registry reads them with the engine's parser).
SIZES = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 300}


@pytest.mark.parametrize("config, family, activation", [
    ({"model_type": "llama", "hidden_act": "relu"}, "llama", "relu"),
    ({"model_type": "llama", "hidden_act": "fatrelu"}, "llama", "fatrelu"),
    ({"model_type": "mistral", "hidden_act": "relu2"}, "llama", "relu2"),
    ({"model_type": "mistral", "architectures": ["BambooForCausalLM"], "hidden_act": "relu"}, "llama", "drelu"),
    ({"model_type": "falcon", "activation": "relu"}, "falcon", "relu"),
    ({"model_type": "RefinedWeb", "hidden_act": "relu"}, "falcon", "relu"),
])
def test_supported_architectures(config, family, activation):
    arch = detect_architecture({**SIZES, **config})
    assert (arch.family, arch.activation, arch.gated) == (family, activation, family == "llama")


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "hidden_act": "silu"},
    {"model_type": "mistral"},
    {"model_type": "falcon"},  # gelu by default
    {"model_type": "qwen2", "hidden_act": "relu"},
    {},
])
def test_unsupported_architectures_are_refused_naming_what_is_supported(config):
    with pytest.raises(ModelFormatError) as info:
        detect_architecture(config)
    assert SUPPORTED_TEXT in str(info.value)


def test_falcon_without_activation_field_is_accepted_when_the_catalogue_says_relu():
    assert detect_architecture({**SIZES, "model_type": "falcon"}, known_activation="relu").activation == "relu"
