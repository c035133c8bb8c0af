"""A GGUF's metadata as a Hugging Face config.json (the synthesis the engine's arch/ reads)."""

from __future__ import annotations

from engine.activations import NAMES as ACTIVATIONS
from engine.errors import ModelFormatError, UserError
from engine.loading.gguf_reader import GgufModel


def hf_config(m: GgufModel, activation: str | None) -> dict:
    f, a = m.fields, m.arch

    def need(key):
        value = f.get(f"{a}.{key}")
        if value is None:
            raise ModelFormatError(f"{m.path.name} lacks the metadata {a}.{key}")
        return value

    d, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = m.tensors.get("token_embd.weight")
    if vocab is None:
        raise ModelFormatError(f"{m.path.name} has no token_embd.weight")
    if activation is None:
        if a == "bamboo":
            activation = "drelu"
        elif m.powerinfer or "blk.0.fc1.weight" in m.tensors:
            activation = "relu"  # PowerInfer's llama models are ReluLLaMA / ProSparse
        else:  # llama.cpp's `llama` computes SiLU: a ReLU Llama's plain file needs --activation relu
            activation = "silu"
    if activation not in ACTIVATIONS:
        raise UserError(f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
    family = {"bamboo": ("BambooForCausalLM", "bamboo"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
    architecture, model_type = family.get(a, ("LlamaForCausalLM", "llama"))
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        # Bamboo's dReLU is spelled "relu" in its config (engine.config reads it so)
        "hidden_act": "relu" if a == "bamboo" else activation,
        "hidden_size": d,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(f"{a}.attention.head_count_kv") or heads),
        "head_dim": int(f.get(f"{a}.attention.key_length") or d // heads),
        "rms_norm_eps": float(f.get(f"{a}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(f.get(f"{a}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(f.get(f"{a}.context_length") or 2048),
        "vocab_size": vocab.shape[0],
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "attention_bias": "blk.0.attn_q.bias" in m.tensors,  # Qwen2's q/k/v biases
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{name}")
        if value is not None:
            config[key] = int(value)
    return config
