"""Config classes for the families whose repositories ship their own (`auto_map` to
configuration_sparsellama.py / configuration_bamboo.py). Their keys are Llama's and
Mistral's; registering them with transformers lets vLLM read the published config.json
without running the repository's code."""

from __future__ import annotations

from transformers import AutoConfig, LlamaConfig, MistralConfig


class SparseLlamaConfig(LlamaConfig):
    """ProSparse-Llama-2: Llama's keys plus `hidden_act: fatrelu` and its threshold
    `hidden_act_param`."""

    model_type = "sparsellama"

    def __init__(self, hidden_act_param: float = 0.0, **kwargs):
        self.hidden_act_param = hidden_act_param
        super().__init__(**kwargs)


class BambooConfig(MistralConfig):
    """Bamboo and TurboSparse-Mistral: Mistral's keys (sliding window included); the FFN is
    dReLU whatever `hidden_act` says."""

    model_type = "bamboo"


def register_configs() -> None:
    for config in (SparseLlamaConfig, BambooConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)
