"""SmallThinker (`SmallThinkerForCausalLM`, model_type `smallthinker`; PowerInfer/Tiiny
SmallThinker-4BA0.6B and -21BA3B): a sparse mixture of ReGLU experts made for local machines.

From the published config and modeling code:
- each layer: RMSNorm -> attention (GQA, no biases) -> residual -> RMSNorm -> MoE -> residual;
- the MoE router `block_sparse_moe.primary_router` [E, d] reads the layer INPUT, before
  `input_layernorm` (pre-attention routing); top-k of its logits, then sigmoid renormalised
  over the k, or softmax when `moe_primary_router_apply_softmax` is true;
- expert e: `block_sparse_moe.experts.{e}.{gate,up,down}` (no `_proj`), ReGLU
  `down(up(x) * relu(gate(x)))`, `moe_ffn_hidden_size` neurons, no shared expert;
- `rope_layout[i]` 0: layer i has no rotary positions; `sliding_window_layout[i]` 1: layer i
  attends over the last `sliding_window_size` positions;
- tied head (the checkpoint may still store `lm_head.weight`; the embeddings are used).
Config parsing is torch-free; the loaders import torch when called.
"""

from __future__ import annotations

from ..config import ModelConfig, RopeConfig
from ..errors import ModelFormatError

NAME = "SmallThinker"
ARCHITECTURES = ("SmallThinkerForCausalLM",)
MODEL_TYPES = ("smallthinker",)

# Tensor names ("{i}" = layer, "{e}" = expert).
ROUTER = "model.layers.{i}.block_sparse_moe.primary_router.weight"
EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight"  # part: gate | up | down


def _layout(raw: dict, key: str, layers: int, default: int) -> tuple[bool, ...]:
    values = raw.get(key)
    if values is None:
        return tuple(bool(default) for _ in range(layers))
    if not isinstance(values, list) or len(values) != layers or any(v not in (0, 1) for v in values):
        raise ModelFormatError(f"config.json: {key} must be a list of {layers} zeros and ones (one per layer)")
    return tuple(bool(v) for v in values)


def _positive_int(raw: dict, key: str, default=None) -> int:
    value = raw.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"config.json of this SmallThinker model: {key} must be an integer >= 1, not {value!r}")
    return value


def parse_raw(raw: dict, rope: RopeConfig, eos_ids: tuple[int, ...]) -> ModelConfig:
    """config.json (a dict) -> ModelConfig; `rope` and `eos_ids` read by the shared parser."""
    hidden = _positive_int(raw, "hidden_size")
    heads = _positive_int(raw, "num_attention_heads")
    layers = _positive_int(raw, "num_hidden_layers")
    experts = _positive_int(raw, "moe_num_primary_experts")
    active = _positive_int(raw, "moe_num_active_primary_experts")
    if active > experts:
        raise ModelFormatError(f"config.json: {active} active experts out of {experts}")
    windows = _layout(raw, "sliding_window_layout", layers, 0)
    window = _positive_int(raw, "sliding_window_size", 4096) if any(windows) else None
    if raw.get("moe_num_shared_experts") or raw.get("moe_num_secondary_experts"):
        raise ModelFormatError("SmallThinker with shared or secondary experts is not supported")
    return ModelConfig(
        family="smallthinker",
        model_type="smallthinker",
        hidden_size=hidden,
        intermediate_size=_positive_int(raw, "moe_ffn_hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_positive_int(raw, "num_key_value_heads", heads),
        head_dim=_positive_int(raw, "head_dim", hidden // heads),
        vocab_size=_positive_int(raw, "vocab_size"),
        activation="relu",  # ReGLU: relu on the gate, times up
        gated=True,
        norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        norm_kind="rms",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_positions=_positive_int(raw, "max_position_embeddings", 4096),
        sliding_window=None,  # per layer (window_layers); the cache keeps every position
        rope=rope,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_experts=experts,
        experts_per_token=active,
        router_softmax=bool(raw.get("moe_primary_router_apply_softmax", False)),
        rope_layers=_layout(raw, "rope_layout", layers, 1),
        window_layers=windows,
        layer_window=window,
    )


# ------------------------------------------------------------------------ tensors
def load_globals(conv, cpu, head):
    cfg = conv.config
    d, vocab = cfg.hidden_size, cfg.vocab_size
    from ..model import Norm

    embed = conv.get("model.embed_tokens.weight", (vocab, d), cpu)
    norm = Norm(conv.get("model.norm.weight", (d,), head), None, cfg.norm_eps)
    return embed, norm, conv.output_head(embed, cpu, head)


def load_experts(conv, i: int, where):
    """Layer i's experts as stacked gate, up, down_t [E, n, d] (one copy each, from the map)."""
    import torch

    cfg = conv.config
    d, n, count = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    src = conv.source
    stacks = [torch.empty(count, n, d, dtype=where.dtype, device=where.device) for _ in range(3)]
    for e in range(count):
        stacks[0][e].copy_(src.get(EXPERT.format(i=i, e=e, part="gate"), (n, d)))
        stacks[1][e].copy_(src.get(EXPERT.format(i=i, e=e, part="up"), (n, d)))
        stacks[2][e].copy_(src.get(EXPERT.format(i=i, e=e, part="down"), (d, n)).t())
    return stacks


def load_layer(conv, i: int, where, ffn_where=None):
    from ..model import Layer, Norm
    from ..moe import DenseMoe

    cfg = conv.config
    d, hd = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    p = f"model.layers.{i}."
    src = conv.source
    qkv = conv.stack_rows([
        src.get(p + "self_attn.q_proj.weight", (q_rows, d)),
        src.get(p + "self_attn.k_proj.weight", (kv_rows, d)),
        src.get(p + "self_attn.v_proj.weight", (kv_rows, d)),
    ], where)
    return Layer(
        attn_norm=Norm(conv.get(p + "input_layernorm.weight", (d,), where), None, cfg.norm_eps),
        mlp_norm=Norm(conv.get(p + "post_attention_layernorm.weight", (d,), where), None, cfg.norm_eps),
        qkv=qkv,
        qkv_bias=None,
        out=conv.get(p + "self_attn.o_proj.weight", (d, q_rows), where),
        out_bias=None,
        ffn=DenseMoe(*load_experts(conv, i, ffn_where or where)),
        parallel=False,
        device=where.device,
        router=conv.get(ROUTER.format(i=i), (cfg.num_experts, d), where),
        rope=cfg.rope_layers[i] if cfg.rope_layers else True,
        window=cfg.layer_window if cfg.window_layers and cfg.window_layers[i] else None,
    )
