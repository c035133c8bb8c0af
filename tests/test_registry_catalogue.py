"""The catalogue data file and the supported-architecture check."""

from __future__ import annotations

import json

import pytest

from engine.errors import ModelFormatError
from models_registry.arch import SUPPORTED_TEXT, detect_architecture
from models_registry.catalogue import BASE_MODEL_NOTE, DTYPE_BYTES, get_entry, load_catalogue, recommended_entry
from models_registry.fit import shape_from_config
from real_config_models import REAL_CONFIGS

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
    "minicpm-s-1b": "openbmb/MiniCPM-S-1B-sft-gguf",
}
# catalogue id -> folder of the published config.json (copied with its source)
PUBLISHED = {
    "relullama-7b": "relullama-7b", "relullama-70b": "relullama-70b", "prosparse-llama-2-7b": "prosparse-llama-2-7b",
    "bamboo-base": "bamboo-base", "bamboo-dpo": "bamboo-dpo", "turbosparse-mistral": "turbosparse-mistral",
    "minicpm-s-1b": "minicpm-s-1b-sft", "turbosparse-mixtral": "turbosparse-mixtral",
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
            assert {"config.json", "*.safetensors", "tokenizer.json", "tokenizer.model"} <= set(entry.files)
        if predictor_repo:
            assert ("model_*.pt" if entry.predictor.source == "powerinfer" else "*.gguf") in entry.predictor.files
    assert entries["turbosparse-mistral"].predictor.source == "checkpoint"
    assert get_entry("SparseLLM/ReluLLaMA-7B").id == "relullama-7b"  # repo ids work too


def test_catalogue_shapes_are_supported_and_agree_with_the_listed_size():
    for entry in load_catalogue():
        if entry.config is None:
            assert entry.id == "demo"
            continue
        arch = detect_architecture(entry.config, entry.activation)
        assert arch.activation == entry.activation
        assert arch.model_type == entry.architecture
        assert entry.size_bytes == DTYPE_BYTES[entry.dtype] * shape_from_config(entry.config, arch).total_params


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
    {"model_type": "llama", "hidden_act": "gelu"},
    {"model_type": "gemma3", "hidden_activation": "gelu_pytorch_tanh"},
    {"model_type": "falcon"},  # gelu by default
    {"model_type": "phi3", "hidden_act": "silu"},
    {},
])
def test_unsupported_architectures_are_refused_naming_what_is_supported(config):
    with pytest.raises(ModelFormatError) as info:
        detect_architecture(config)
    assert SUPPORTED_TEXT in str(info.value)


@pytest.mark.parametrize("config", [{"model_type": "mistral"}, {"model_type": "qwen2", "hidden_act": "silu"},
                                    {"model_type": "llama", "hidden_act": "silu"}])
def test_swiglu_llama_layouts_are_accepted_as_silu(config):
    # SwiGLU (Mistral's default activation): they run dense, not refused
    assert detect_architecture({**SIZES, **config}).activation == "silu"


def test_falcon_without_activation_field_is_accepted_when_the_catalogue_says_relu():
    assert detect_architecture({**SIZES, "model_type": "falcon"}, known_activation="relu").activation == "relu"


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_catalogue_agrees_with_the_published_config(model_id):
    published = json.loads((REAL_CONFIGS / PUBLISHED[model_id] / "config.json").read_text())
    entry = get_entry(model_id)
    assert entry.context_length == published["max_position_embeddings"]
    assert entry.dtype == published["torch_dtype"]
    for key, value in entry.config.items():
        assert published.get(key) == value, key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert entry.config[key] == published[key]
    assert detect_architecture(published).activation == entry.activation


def test_relullama_7b_is_fp32_with_2048_positions_and_relufalcon_ships_pickles():
    e = get_entry("relullama-7b")
    assert (e.dtype, e.context_length) == ("float32", 2048) and 26e9 < e.size_bytes < 28e9
    falcon = get_entry("relufalcon-40b")
    assert falcon.dtype == "float32" and "pytorch_model" in falcon.weights_format
    assert "pytorch_model*.bin" in falcon.files


def test_chat_and_base_models_are_marked():
    chat = {e.id for e in load_catalogue() if e.chat}
    assert chat == {"minicpm-s-1b", "bamboo-dpo", "turbosparse-mistral", "turbosparse-mixtral",
                    "smallthinker-4b-a0.6b-instruct", "smallthinker-21b-a3b-instruct"}
    for model_id in ("relullama-7b", "prosparse-llama-2-7b", "bamboo-base", "relufalcon-40b"):
        entry = get_entry(model_id)
        assert entry.kind_note == BASE_MODEL_NOTE and entry.chat_format == "plain"
        assert BASE_MODEL_NOTE in entry.description
    from engine.runtime.chat_formats import FORMATS

    assert all(e.chat_format in FORMATS for e in load_catalogue() if e.chat_format)
    assert get_entry("turbosparse-mistral").chat_format == "chatml"
    assert get_entry("minicpm-s-1b").chat_format == "minicpm"


def test_minicpm_s_1b_is_the_recommended_first_download():
    entry = recommended_entry()
    assert entry is not None and entry.id == "minicpm-s-1b" and load_catalogue()[0] is entry
    assert entry.repo == "openbmb/MiniCPM-S-1B-sft" and entry.chat and entry.size_bytes < 3e9
    assert entry.predictor.source == "gguf" and entry.predictor.repo == "openbmb/MiniCPM-S-1B-sft-gguf"
