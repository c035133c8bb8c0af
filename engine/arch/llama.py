"""Llama, Mistral and Bamboo (dReLU) checkpoints: `model.layers.{i}.self_attn/mlp.*`."""

from __future__ import annotations

import torch

from ..model import Layer, Norm
from .common import Converter, Placement


def load_globals(conv: Converter, cpu: Placement, head: Placement) -> tuple[torch.Tensor, Norm, torch.Tensor]:
    cfg = conv.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    embed = conv.get("model.embed_tokens.weight", (vocab, d), cpu)
    norm = Norm(conv.get("model.norm.weight", (d,), head), None, cfg.norm_eps)
    return embed, norm, conv.output_head(embed, cpu, head)


def load_layer(conv: Converter, i: int, where: Placement, ffn_where: Placement | None = None) -> Layer:
    cfg = conv.config
    d, hd = cfg.hidden_size, cfg.head_dim
    p = f"model.layers.{i}."
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    src = conv.source
    qkv = conv.stack_rows([
        src.get(p + "self_attn.q_proj.weight", (q_rows, d)),
        src.get(p + "self_attn.k_proj.weight", (kv_rows, d)),
        src.get(p + "self_attn.v_proj.weight", (kv_rows, d)),
    ], where)
    qkv_bias = None
    if src.has(p + "self_attn.q_proj.bias"):
        qkv_bias = torch.cat([
            conv.get(p + "self_attn.q_proj.bias", (q_rows,), where),
            conv.get(p + "self_attn.k_proj.bias", (kv_rows,), where),
            conv.get(p + "self_attn.v_proj.bias", (kv_rows,), where),
        ])
    return Layer(
        attn_norm=Norm(conv.get(p + "input_layernorm.weight", (d,), where), None, cfg.norm_eps),
        mlp_norm=Norm(conv.get(p + "post_attention_layernorm.weight", (d,), where), None, cfg.norm_eps),
        qkv=qkv,
        qkv_bias=qkv_bias,
        out=conv.get(p + "self_attn.o_proj.weight", (d, q_rows), where),
        out_bias=conv.maybe(p + "self_attn.o_proj.bias", (d,), where),
        ffn=conv.ffn(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight",
                     ffn_where or where),
        parallel=False,
        device=where.device,
    )
