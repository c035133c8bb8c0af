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

from ..config import ConfigFields, ModelConfig
from ..errors import ModelFormatError
from .llama import GatedTensors

NAME = "SmallThinker"
SUPPORTS = "SmallThinker mixtures of ReGLU experts"
ARCHITECTURES = ("SmallThinkerForCausalLM",)
MODEL_TYPES = ("smallthinker",)

# Attention, norms, embeddings: the Llama names. The MoE ("{i}" = layer, "{e}" = expert):
TENSORS = GatedTensors(gate="", up="", down="")
ROUTER = "model.layers.{i}.block_sparse_moe.primary_router.weight"
EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight"  # part: gate | up | down


def _layout(read: ConfigFields, key: str, layers: int, default: int) -> tuple[bool, ...]:
    values = read.raw.get(key)
    if values is None:
        return tuple(bool(default) for _ in range(layers))
    if not isinstance(values, list) or len(values) != layers \
            or any(isinstance(v, bool) or v not in (0, 1) for v in values):
        raise ModelFormatError(f"config.json: {key} must be a list of {layers} zeros and ones (one per layer)")
    return tuple(bool(v) for v in values)


def parse(read: ConfigFields, activation_hint: str | None = None) -> ModelConfig:
    """config.json -> ModelConfig (torch-free). The experts are ReGLU whatever the config
    says: the modeling code hard-codes relu on the gate."""
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    layers = read.int("num_hidden_layers")
    experts = read.int("moe_num_primary_experts")
    active = read.int("moe_num_active_primary_experts")
    if active > experts:
        raise ModelFormatError(f"config.json: {active} active experts out of {experts}")
    if read.raw.get("moe_num_shared_experts") or read.raw.get("moe_num_secondary_experts"):
        raise ModelFormatError("SmallThinker with shared or secondary experts is not supported")
    head_dim = read.int("head_dim", default=0, minimum=0) or hidden // heads
    if head_dim == 0:
        raise read.invalid("hidden_size", hidden, f"a multiple of num_attention_heads ({heads})")
    windows = _layout(read, "sliding_window_layout", layers, 0)
    max_pos = read.int("max_position_embeddings", default=4096)
    return ModelConfig(
        family="smallthinker",
        arch="smallthinker",
        model_type="smallthinker",
        hidden_size=hidden,
        intermediate_size=read.int("moe_ffn_hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=read.int("num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab_size=read.int("vocab_size"),
        activation="relu",  # ReGLU: relu on the gate, times up
        gated=True,
        norm_eps=read.float("rms_norm_eps", default=1e-6, positive=True),
        norm_kind="rms",
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        max_positions=max_pos,
        sliding_window=None,  # per layer (window_layers); the cache keeps every position
        rope=read.rope(max_pos),
        bos_token_id=read.token_id("bos_token_id"),
        eos_token_ids=read.eos_ids(),
        num_experts=experts,
        experts_per_token=active,
        router_softmax=read.bool("moe_primary_router_apply_softmax", False),
        rope_layers=_layout(read, "rope_layout", layers, 1),
        window_layers=windows,
        layer_window=read.int("sliding_window_size", default=4096) if any(windows) else None,
    )


# ------------------------------------------------------------------------ tensors
def load_globals(conv, cpu, head):
    from .common import load_gated_globals

    return load_gated_globals(conv, TENSORS, cpu, head)


def load_experts(conv, i: int, where):
    """Layer i's experts as stacked gate, up, down_t [E, n, d] (one copy each, from the map)."""
    from .common import load_expert_stacks

    return load_expert_stacks(conv, i, where, EXPERT, ("gate", "up", "down"))


def load_layer(conv, i: int, where, ffn_where=None):
    from engine.model.layers import Layer, Norm
    from engine.model.moe import DenseMoe

    cfg = conv.config
    d, hd = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    names = TENSORS
    p = names.layer.format(i=i)
    src = conv.source
    qkv = conv.stack_rows([
        src.get(p + names.q + ".weight", (q_rows, d)),
        src.get(p + names.k + ".weight", (kv_rows, d)),
        src.get(p + names.v + ".weight", (kv_rows, d)),
    ], where)
    return Layer(
        attn_norm=Norm(conv.get(p + names.attn_norm, (d,), where), None, cfg.norm_eps),
        mlp_norm=Norm(conv.get(p + names.mlp_norm, (d,), where), None, cfg.norm_eps),
        qkv=qkv,
        qkv_bias=None,
        out=conv.get(p + names.o + ".weight", (d, q_rows), where),
        out_bias=None,
        # skip_ffn: the experts come from the MoE prepared file (engine.loading.prepared_moe)
        ffn=None if conv.skip_ffn else DenseMoe(*load_experts(conv, i, ffn_where or where)),
        parallel=False,
        device=where.device,
        router=conv.get(ROUTER.format(i=i), (cfg.num_experts, d), where),
        rope=cfg.rope_layers[i] if cfg.rope_layers else True,
        window=cfg.layer_window if cfg.window_layers and cfg.window_layers[i] else None,
    )
