"""Config classes for the families whose repositories ship their own (`auto_map` to
configuration_sparsellama.py / configuration_bamboo.py / configuration_turbosparsemixtral.py).
Their keys are Llama's, Mistral's and Mixtral's; registering them with transformers lets vLLM read the published config.json
without running the repository's code."""

from __future__ import annotations

from transformers import AutoConfig, LlamaConfig, MistralConfig, MixtralConfig


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


class TurboSparseMixtralConfig(MixtralConfig):
    """TurboSparse-Mixtral: Mixtral's keys (experts, top k, router); `hidden_act: relu` on both
    halves of each expert (dReLU). The predictors' ranks are not in the config: the
    checkpoint's shapes give them."""

    model_type = "turbosparsemixtral"


def register_configs() -> None:
    for config in (SparseLlamaConfig, BambooConfig, TurboSparseMixtralConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)
