"""Falcon checkpoints (`transformer.h.{i}.*`): fused QKV in three layouts, ungated ReLU MLP.

Torch-free at import (the registry parses configs through `parse`); the loaders import
torch inside.
"""

from __future__ import annotations

from ..config import ConfigFields, ModelConfig
from ..errors import ModelFormatError

NAME = "Falcon"
SUPPORTS = "Falcon with ReLU (ReluFalcon)"
ARCHITECTURES = ("FalconForCausalLM", "RWForCausalLM")
MODEL_TYPES = ("falcon", "refinedweb", "refinedwebmodel")


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    # Falcon's default is GELU: a config without an activation key is refused unless
    # the catalogue says what its model uses.
    activation = read.activation("activation", "hidden_act", default="gelu", hint=activation_hint)
    hidden = read.int("hidden_size", "n_embed")
    heads = read.int("num_attention_heads", "n_head")
    if hidden % heads:
        raise read.invalid("hidden_size", hidden, f"a multiple of num_attention_heads ({heads})")
    if read.bool("alibi", False):
        raise ModelFormatError("Falcon with ALiBi positions is not supported; only rotary Falcon models are")
    new_arch = read.bool("new_decoder_architecture", False)
    if new_arch:
        kv_heads, layout = read.int("num_kv_heads", "n_head_kv", default=heads), "falcon_grouped"
    elif read.bool("multi_query", True):
        kv_heads, layout = 1, "falcon_mq"
    else:
        kv_heads, layout = heads, "falcon_interleaved"
    parallel = read.bool("parallel_attn", True) or new_arch
    n_ln = read.int("num_ln_in_parallel_attn", default=2 if new_arch else 1)
    max_pos = read.int("max_position_embeddings", default=2048)
    bias = read.bool("bias", False)
    return ModelConfig(
        family="falcon",
        arch="falcon",
        model_type="falcon",
        hidden_size=hidden,
        intermediate_size=read.int("ffn_hidden_size", default=4 * hidden),
        num_layers=read.int("num_hidden_layers", "n_layer"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=read.int("vocab_size"),
        activation=activation,
        gated=False,
        norm_eps=read.float("layer_norm_epsilon", default=1e-5, positive=True),
        norm_kind="layer",
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        max_positions=max_pos,
        rope=read.rope(max_pos),
        attention_bias=bias,
        mlp_bias=bias,
        parallel_attn=parallel,
        num_ln_in_parallel_attn=n_ln if parallel else 1,
        qkv_layout=layout,
        bos_token_id=read.token_id("bos_token_id"),
        eos_token_ids=read.eos_ids(),
    )


def _layer_norm(conv, prefix: str, where):
    from engine.model.layers import Norm

    d = conv.config.hidden_size
    return Norm(conv.get(prefix + ".weight", (d,), where), conv.get(prefix + ".bias", (d,), where),
                conv.config.norm_eps)


def _split_qkv(fused, layout: str, heads: int, kv_heads: int, hd: int):
    """Falcon's fused rows -> (q, k, v) row blocks in head order."""
    rest = fused.shape[1:]
    if layout == "falcon_grouped":  # [kv_groups, heads/kv + 2, hd]: queries of a group, then its k, v
        g = fused.reshape(kv_heads, heads // kv_heads + 2, hd, *rest)
        return g[:, :-2].reshape(heads * hd, *rest), g[:, -2].reshape(kv_heads * hd, *rest), g[:, -1].reshape(kv_heads * hd, *rest)
    if layout == "falcon_mq":  # [heads + 2, hd]: all queries, one k, one v
        g = fused.reshape(heads + 2, hd, *rest)
        return g[:-2].reshape(heads * hd, *rest), g[-2], g[-1]
    g = fused.reshape(heads, 3, hd, *rest)  # interleaved per head: q, k, v
    return g[:, 0].reshape(heads * hd, *rest), g[:, 1].reshape(heads * hd, *rest), g[:, 2].reshape(heads * hd, *rest)


def load_globals(conv, cpu, head):
    cfg = conv.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    embed = conv.get("transformer.word_embeddings.weight", (vocab, d), cpu)
    norm = _layer_norm(conv, "transformer.ln_f", head)
    return embed, norm, conv.output_head(embed, cpu, head)


def load_layer(conv, i: int, where, ffn_where=None):
    import torch

    from engine.model.layers import Layer

    cfg = conv.config
    d, hd, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    p = f"transformer.h.{i}."
    src = conv.source
    fused_rows = (heads + 2 * kv) * hd
    q, k, v = _split_qkv(src.get(p + "self_attention.query_key_value.weight", (fused_rows, d)),
                         cfg.qkv_layout, heads, kv, hd)
    qkv = conv.stack_rows([q, k, v], where)
    qkv_bias = None
    if src.has(p + "self_attention.query_key_value.bias"):
        qb, kb, vb = _split_qkv(src.get(p + "self_attention.query_key_value.bias", (fused_rows,)),
                                cfg.qkv_layout, heads, kv, hd)
        qkv_bias = torch.cat([qb, kb, vb]).to(where.device, where.dtype)
    if cfg.num_ln_in_parallel_attn == 2:
        attn_norm, mlp_norm = _layer_norm(conv, p + "ln_attn", where), _layer_norm(conv, p + "ln_mlp", where)
    else:
        attn_norm = _layer_norm(conv, p + "input_layernorm", where)
        mlp_norm = None if cfg.parallel_attn else _layer_norm(conv, p + "post_attention_layernorm", where)
    return Layer(
        attn_norm=attn_norm,
        mlp_norm=mlp_norm,
        qkv=qkv,
        qkv_bias=qkv_bias,
        out=conv.get(p + "self_attention.dense.weight", (d, heads * hd), where),
        out_bias=conv.maybe(p + "self_attention.dense.bias", (d,), where),
        ffn=conv.ffn(None, p + "mlp.dense_h_to_4h.weight", p + "mlp.dense_4h_to_h.weight", ffn_where or where,
                     p + "mlp.dense_h_to_4h.bias", p + "mlp.dense_4h_to_h.bias"),
        parallel=cfg.parallel_attn,
        device=where.device,
    )
