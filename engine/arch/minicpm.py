"""MiniCPM (`MiniCPMForCausalLM`, MiniCPM-S-1B / ProSparse-MiniCPM): the Llama layout with
FATReLU and muP scales, and often no `model_type` in config.json.

Scales (as mlx-lm's models/minicpm.py and the published modeling code apply them):
- the embeddings are multiplied by `scale_emb`;
- each residual branch (attention output, MLP output) by `scale_depth / sqrt(num_hidden_layers)`
  before its add;
- the final hidden state is divided by `hidden_size / dim_model_base` before the head;
- the head is the embeddings when the checkpoint has no `lm_head.weight`.
The "-llama-format" copies say model_type "llama" and are read by engine/arch/llama.py,
without scales, as transformers' Llama reads them. Torch-free at import.
"""

from __future__ import annotations

import math

from ..config import ConfigFields, ModelConfig
from .llama import TENSORS, load_globals, load_layer, parse_gated  # noqa: F401 (same tensors)

NAME = "MiniCPM"
SUPPORTS = "MiniCPM with FATReLU (MiniCPM-S)"
ARCHITECTURES = ("MiniCPMForCausalLM",)
MODEL_TYPES = ("minicpm",)


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    activation = read.activation("hidden_act", default="silu", hint=activation_hint)
    hidden = read.int("hidden_size")
    layers = read.int("num_hidden_layers")
    return parse_gated(
        read, "minicpm", activation,
        model_type=str(read.raw.get("model_type") or "minicpm"),
        # MiniCPM's head is the embeddings unless the checkpoint has its own (Converter.output_head).
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        embedding_scale=read.float("scale_emb", default=1.0, positive=True),
        residual_scale=read.float("scale_depth", default=1.0, positive=True) / math.sqrt(layers),
        logit_scale=read.float("dim_model_base", default=hidden, positive=True) / hidden,
    )
