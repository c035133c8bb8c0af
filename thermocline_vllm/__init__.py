"""Thermocline's vLLM plugin: the ReLU-family architectures vLLM does not run, on vLLM's own
tensor-parallel layers.

vLLM calls `register` in every process it starts (API server, engine core, each tensor- or
pipeline-parallel worker) through the `vllm.general_plugins` entry point in pyproject.toml.
This package imports nothing at import time: the model module (torch, vLLM's layers) is named
by string and loaded only when vLLM builds one of these models.

| architecture (config.json `architectures`) | family | FFN |
|---|---|---|
| `SparseLlamaForCausalLM` (`model_type: sparsellama`) | ProSparse-Llama-2 | down(fatrelu(gate) * up) |
| `BambooForCausalLM` (`model_type: bamboo`) | Bamboo, TurboSparse-Mistral | down(relu(gate) * relu(up)), predictor mask when the checkpoint has one |
| `ReluLlamaForCausalLM` (via `--hf-overrides`) | ReluLLaMA (`LlamaForCausalLM`, `hidden_act: relu`) | down(relu(gate) * up) |
| `TurboSparseMixtralForCausalLM` (`model_type: turbosparsemixtral`) | TurboSparse-Mixtral | top-k of 8 dReLU experts, each masked by its predictor |

ReluLLaMA's checkpoints name vLLM's own `LlamaForCausalLM`, whose MLP refuses ReLU. The plugin
does not replace vLLM's Llama (every SiLU Llama would run on it); the recipe names ours:
`vllm serve SparseLLM/ReluLLaMA-7B --hf-overrides '{"architectures": ["ReluLlamaForCausalLM"]}'`.
"""

from __future__ import annotations

# architecture -> class in thermocline_vllm.models
ARCHITECTURES = {
    "SparseLlamaForCausalLM": "SparseLlamaForCausalLM",
    "BambooForCausalLM": "BambooForCausalLM",
    "ReluLlamaForCausalLM": "ReluLlamaForCausalLM",
    "TurboSparseMixtralForCausalLM": "TurboSparseMixtralForCausalLM",
}


def register() -> None:
    """vLLM's general-plugin hook: the config classes of the families whose `model_type`
    transformers does not know (so no `--trust-remote-code` runs their repositories' code),
    then the model classes, lazily. Safe to call more than once (vLLM does)."""
    from vllm import ModelRegistry

    from thermocline_vllm.configs import register_configs

    register_configs()
    for arch, cls in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, f"thermocline_vllm.models:{cls}")
