"""Llama, Mistral and Qwen2 checkpoints (ReluLLaMA, ProSparse's `sparsellama`, MiniCPM-S's Llama
format; SwiGLU Llama 2/3, Mistral, Qwen2, SmolLM2, which run dense): `model.layers.{i}.self_attn/mlp.*`,
gated FFN, RMSNorm.

Also the tensor names (`GatedTensors`) every Llama-layout family shares (Bamboo, MiniCPM).
Torch-free at import: the model registry parses configs through `parse`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigFields, ModelConfig

NAME = "Llama"
SUPPORTS = "Llama with ReLU/FATReLU/ReLU² (ReluLLaMA, ProSparse), SwiGLU Llama/Mistral/Qwen2/SmolLM2 (dense)"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "SparseLlamaForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = ("llama", "mistral", "sparsellama", "qwen2")  # qwen2: the same layout, q/k/v with biases


@dataclass(frozen=True)
class GatedTensors:
    """Checkpoint names of the Llama layout; `layer` is formatted with the layer index."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{i}."
    q: str = "self_attn.q_proj"  # + ".weight" / ".bias"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    attn_norm: str = "input_layernorm.weight"
    mlp_norm: str = "post_attention_layernorm.weight"
    gate: str = "mlp.gate_proj.weight"
    up: str = "mlp.up_proj.weight"
    down: str = "mlp.down_proj.weight"


TENSORS = GatedTensors()


def parse_gated(read: ConfigFields, arch: str, activation: str, **overrides) -> ModelConfig:
    """The fields every Llama-layout config shares (`overrides` set the family's own)."""
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    head_dim = read.int("head_dim", default=0, minimum=0) or hidden // heads
    if head_dim == 0 or (not read.has("head_dim") and hidden % heads):
        raise read.invalid("hidden_size", hidden, f"a multiple of num_attention_heads ({heads})")
    max_pos = read.int("max_position_embeddings", default=4096)
    threshold = read.float("hidden_act_param", default=0.0) if activation == "fatrelu" else 0.0
    fields = dict(
        family="llama",
        arch=arch,
        model_type=str(read.raw.get("model_type") or arch),
        hidden_size=hidden,
        intermediate_size=read.int("intermediate_size"),
        num_layers=read.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=read.int("num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab_size=read.int("vocab_size"),
        activation=activation,
        activation_threshold=threshold,
        gated=True,
        norm_eps=read.float("rms_norm_eps", default=1e-6, positive=True),
        norm_kind="rms",
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        max_positions=max_pos,
        sliding_window=read.sliding_window(),
        rope=read.rope(max_pos),
        attention_bias=read.bool("attention_bias", False),
        mlp_bias=read.bool("mlp_bias", False),
        bos_token_id=read.token_id("bos_token_id"),
        eos_token_ids=read.eos_ids(),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    activation = read.activation("hidden_act", "hidden_activation", default="silu", hint=activation_hint)
    return parse_gated(read, "llama", activation)


def load_globals(conv, cpu, head):
    from .common import load_gated_globals

    return load_gated_globals(conv, TENSORS, cpu, head)


def load_layer(conv, i, where, ffn_where=None):
    from .common import load_gated_layer

    return load_gated_layer(conv, TENSORS, i, where, ffn_where)
