"""Model configuration parsed from a Hugging Face `config.json`.

One dataclass covers the three families we run (Llama, Mistral/Bamboo, Falcon): the
fields are what the engine needs, read from whichever names each family uses, and
unknown keys are ignored (mlx-lm style). Unsupported models are refused here, with a
message naming what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelFormatError

SUPPORTED = (
    "Llama with ReLU/FATReLU/ReLU² (ReluLLaMA, ProSparse), Mistral/Bamboo with dReLU "
    "(Bamboo, TurboSparse), Falcon with ReLU (ReluFalcon)"
)

# Activation names as configs spell them -> our four kernels' names.
_ACTIVATIONS = {
    "relu": "relu",
    "fatrelu": "fatrelu",
    "relu2": "relu2",
    "relu_squared": "relu2",
    "squared_relu": "relu2",
    "drelu": "drelu",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" (Llama and Mistral/Bamboo layout) or "falcon"
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    activation: str  # relu | fatrelu | drelu | relu2
    activation_threshold: float = 0.0  # FATReLU: values below it become 0
    gated: bool = True
    norm_eps: float = 1e-5
    norm_kind: str = "rms"  # rms | layer
    tie_word_embeddings: bool = False
    max_positions: int = 4096
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    mlp_bias: bool = False
    # Falcon layout details
    parallel_attn: bool = False
    num_ln_in_parallel_attn: int = 1
    qkv_layout: str = "separate"  # separate | falcon_grouped | falcon_mq | falcon_interleaved
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (SmallThinker): `num_experts` ReGLU experts of `intermediate_size`
    # neurons each, `experts_per_token` chosen by a router; 0 experts means a dense FFN.
    num_experts: int = 0
    experts_per_token: int = 0
    router_softmax: bool = False  # softmax over the chosen logits, else sigmoid renormalised
    # Per-layer attention layouts (SmallThinker's rope_layout / sliding_window_layout):
    # () = every layer alike (RoPE, and `sliding_window` for all). `window_layers[i]` True:
    # layer i attends over the last `layer_window` positions only.
    rope_layers: tuple[bool, ...] = ()
    window_layers: tuple[bool, ...] = ()
    layer_window: int | None = None

    @property
    def n_ff(self) -> int:
        """Units per layer that are profiled and placed: FFN neurons, or experts of a mixture."""
        return self.num_experts or self.intermediate_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelFormatError(f"{model_dir} has no config.json: is it a Hugging Face model folder?")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"cannot read {path}: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        try:
            return _parse(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"config.json is incomplete or malformed ({exc!r}); supported: {SUPPORTED}") from None


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(raw: dict, default_max: int) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; released checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params.update({k: v for k, v in scaling.items() if v is not None})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ModelFormatError(f"unsupported RoPE scaling {kind!r}: supported are linear, dynamic, llama3, yarn")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0) or 1.0),
        original_max_positions=params.get("original_max_position_embeddings") or default_max,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
    )


def _activation(name: str | None, model_type: str) -> str:
    act = _ACTIVATIONS.get((name or "").lower())
    if act is None:
        raise ModelFormatError(
            f"activation {name!r} of this {model_type} model is not sparse: Thermocline needs a ReLU-family "
            f"model; supported: {SUPPORTED}"
        )
    return act


def _parse(raw: dict) -> ModelConfig:
    model_type = str(raw.get("model_type", "")).lower()
    architectures = [a.lower() for a in raw.get("architectures") or []]
    if model_type == "smallthinker" or "smallthinkerforcausallm" in architectures:
        from .arch import smallthinker

        return smallthinker.parse_raw(raw, _rope(raw, int(raw.get("max_position_embeddings", 4096))), _eos_ids(raw))
    if model_type in ("falcon", "refinedweb", "refinedwebmodel") or any("falcon" in a or "rw" == a for a in architectures):
        return _parse_falcon(raw)
    is_bamboo = model_type in ("bamboo", "turbosparse") or any("bamboo" in a for a in architectures)
    if model_type not in ("llama", "mistral") and not is_bamboo:
        raise ModelFormatError(f"unknown model_type {model_type or '(none)'!r}; supported: {SUPPORTED}")

    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    act_name = raw.get("hidden_act", raw.get("hidden_activation"))
    activation = "drelu" if is_bamboo and (act_name or "relu") == "relu" else _activation(act_name, model_type)
    threshold = float(raw.get("hidden_act_param", 0.0) or 0.0) if activation == "fatrelu" else 0.0
    max_pos = int(raw.get("max_position_embeddings", 4096))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    return ModelConfig(
        family="llama",
        model_type=model_type or "bamboo",
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        vocab_size=int(raw["vocab_size"]),
        activation=activation,
        activation_threshold=threshold,
        gated=True,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        norm_kind="rms",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_positions=max_pos,
        sliding_window=int(window) if window else None,
        rope=_rope(raw, max_pos),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )


def _parse_falcon(raw: dict) -> ModelConfig:
    hidden = int(raw.get("hidden_size", raw.get("n_embed", 0)))
    heads = int(raw.get("num_attention_heads", raw.get("n_head", 0)))
    if raw.get("alibi"):
        raise ModelFormatError("Falcon with ALiBi positions is not supported; only rotary Falcon models are")
    new_arch = bool(raw.get("new_decoder_architecture", False))
    multi_query = bool(raw.get("multi_query", True))
    if new_arch:
        kv_heads = int(raw.get("num_kv_heads") or raw.get("n_head_kv") or heads)
        layout = "falcon_grouped"
    elif multi_query:
        kv_heads, layout = 1, "falcon_mq"
    else:
        kv_heads, layout = heads, "falcon_interleaved"
    parallel = bool(raw.get("parallel_attn", True)) or new_arch
    n_ln = raw.get("num_ln_in_parallel_attn")
    if n_ln is None:
        n_ln = 2 if new_arch else 1
    max_pos = int(raw.get("max_position_embeddings", 2048))
    return ModelConfig(
        family="falcon",
        model_type="falcon",
        hidden_size=hidden,
        intermediate_size=int(raw.get("ffn_hidden_size") or 4 * hidden),
        num_layers=int(raw.get("num_hidden_layers", raw.get("n_layer", 0))),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=int(raw["vocab_size"]),
        activation=_activation(raw.get("activation", "gelu"), "falcon"),
        gated=False,
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        norm_kind="layer",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_positions=max_pos,
        rope=_rope(raw, max_pos),
        attention_bias=bool(raw.get("bias", False)),
        mlp_bias=bool(raw.get("bias", False)),
        parallel_attn=parallel,
        num_ln_in_parallel_attn=int(n_ln) if parallel else 1,
        qkv_layout=layout,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )
