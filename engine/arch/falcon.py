"""Falcon checkpoints (`transformer.h.{i}.*`): fused QKV in three layouts, ungated ReLU MLP."""

from __future__ import annotations

import torch

from ..model import Layer, Norm
from .common import Converter, Placement


def _layer_norm(conv: Converter, prefix: str, where: Placement) -> Norm:
    d = conv.config.hidden_size
    return Norm(conv.get(prefix + ".weight", (d,), where), conv.get(prefix + ".bias", (d,), where),
                conv.config.norm_eps)


def _split_qkv(fused: torch.Tensor, layout: str, heads: int, kv_heads: int, hd: int):
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


def load_globals(conv: Converter, cpu: Placement, head: Placement):
    cfg = conv.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    embed = conv.get("transformer.word_embeddings.weight", (vocab, d), cpu)
    norm = _layer_norm(conv, "transformer.ln_f", head)
    return embed, norm, conv.output_head(embed, cpu, head)


def load_layer(conv: Converter, i: int, where: Placement, ffn_where: Placement | None = None) -> Layer:
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
