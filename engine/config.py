"""Model configuration types: `ModelConfig` (what the engine needs of a `config.json`) and
`ConfigFields` (checked reads of its keys).

`engine.arch.parse_config` / `read_config` are the one reading of config.json (the engine,
`thermocline place` and the model registry all call them, so they agree on what is
loadable): they pick the architecture module, which fills a `ModelConfig` through
`ConfigFields`, from whichever names its family uses; unknown keys are ignored (mlx-lm
style). Every value is checked as it is read: a config that is not an object, a zero size,
a NaN or a string where a number belongs is a `ModelFormatError` naming the key. This
module and the per-architecture parsers are torch-free for the registry's sake.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import activations as activation_names
from .errors import ModelFormatError, UserError

# Context length when none is asked for: short enough to keep the KV cache small, and never
# longer than the model was trained for (`ModelConfig.context_length`).
DEFAULT_CTX = 2048

# Activation names as configs spell them -> our four kernels' names.
ACTIVATIONS = activation_names.ALIASES


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
    family: str  # tensor layout: "llama" (Llama, Mistral, Bamboo, MiniCPM) or "falcon"
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
    # The engine/arch module that parsed this config and loads its tensors.
    arch: str = "llama"
    # muP-style scales (MiniCPM); 1.0 means none. The embeddings are multiplied by
    # `embedding_scale`, each residual branch (attention output, FFN output) by
    # `residual_scale` before its add, the final hidden state by `logit_scale` before the head.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Mixture of experts (SmallThinker, TurboSparse-Mixtral): `num_experts` experts of
    # `intermediate_size` neurons each (ReGLU, or dReLU: `activation`), `experts_per_token` chosen by a router; 0 experts means a dense FFN.
    num_experts: int = 0
    experts_per_token: int = 0
    router_softmax: bool = False  # softmax over the chosen logits, else sigmoid renormalised
    # What the router reads: "layer" the layer input before attention (SmallThinker), "ffn"
    # the FFN's normed input after attention (Mixtral, TurboSparse-Mixtral).
    router_input: str = "layer"
    # A mixture whose experts carry neuron predictors (TurboSparse-Mixtral): their rank per
    # layer as the published code gives it, for size and fit estimates before a download
    # (the engine reads the checkpoint's shapes); () where not known.
    expert_predictor_ranks: tuple[int, ...] = ()
    # Per-layer attention layouts (SmallThinker's rope_layout / sliding_window_layout):
    # () = every layer alike (RoPE, and `sliding_window` for all). `window_layers[i]` True:
    # layer i attends over the last `layer_window` positions only.
    rope_layers: tuple[bool, ...] = ()
    window_layers: tuple[bool, ...] = ()
    layer_window: int | None = None
    # CATS (a SiLU model's opt-in sparse mode): per layer, |SiLU(gate)| below the threshold
    # becomes 0, as calibrated by `thermocline profile --target-sparsity` (`read_cats`);
    # () = none. Only the sparse modes load it: dense mode stays the model.
    cats_thresholds: tuple[float, ...] = ()

    def ffn_threshold(self, layer: int) -> float:
        """Layer `layer`'s activation threshold: its CATS threshold, else the model's own (FATReLU)."""
        return self.cats_thresholds[layer] if self.cats_thresholds else self.activation_threshold

    @property
    def n_ff(self) -> int:
        """Units per layer that are profiled and placed: FFN neurons, or experts of a mixture."""
        return self.num_experts or self.intermediate_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def context_length(self, requested: int | None = None) -> int:
        """The context the engine allocates, and `place`/`models fit` count: the requested
        length (default DEFAULT_CTX) capped at the positions the model was trained for."""
        if requested is not None and requested < 8:
            raise UserError(f"context length {requested} is too small (at least 8)")
        return min(requested or DEFAULT_CTX, self.max_positions)


def check_consistency(cfg: ModelConfig) -> None:
    """Consistency between fields (each field alone was checked as it was read)."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelFormatError(
            f"config.json: {cfg.num_heads} attention heads cannot share {cfg.num_kv_heads} key/value heads evenly"
        )
    if cfg.activation == "fatrelu" and cfg.activation_threshold < 0:
        raise ModelFormatError(f"config.json: the FATReLU threshold must be >= 0, not {cfg.activation_threshold}")
    for name in ("embedding_scale", "residual_scale", "logit_scale"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise ModelFormatError(f"config.json gives a {name.replace('_', ' ')} of {value}; it must be a positive number")


def recorded_activation(model_dir: Path) -> str | None:
    """The activation recorded in the folder for a checkpoint whose config.json may not name
    one: `thermocline/download.json`'s `activation`, which the registry writes from its
    catalogue when it downloads the model (see `engine.arch.read_config`). Read from the folder, so the
    engine asks the registry nothing; a missing or unreadable record is no hint."""
    path = Path(model_dir) / DOWNLOAD_RECORD
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("activation")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


DOWNLOAD_RECORD = Path("thermocline") / "download.json"  # written by models_registry (state.py)
CATS_RECORD = Path("thermocline") / "cats.json"  # written by engine.calibration.profiling


def read_cats(model_dir: Path, layers: int) -> dict | None:
    """The CATS calibration of a SiLU model's folder (`thermocline/cats.json`: `thresholds`,
    one per layer, and the `target_sparsity` they were calibrated to), None when there is none;
    a damaged record is a ModelFormatError naming the file."""
    path = Path(model_dir) / CATS_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        thresholds = [float(t) for t in record["thresholds"]]
        target = float(record["target_sparsity"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFormatError(f"{path} is damaged ({exc}): run `thermocline profile --target-sparsity` again") from None
    if len(thresholds) != layers or not all(math.isfinite(t) and t >= 0 for t in thresholds):
        raise ModelFormatError(f"{path} holds {len(thresholds)} thresholds for {layers} layers (or a negative or "
                               "non-finite one): run `thermocline profile --target-sparsity` again")
    return {"thresholds": tuple(thresholds), "target_sparsity": target}


# --------------------------------------------------------------------------- reading
_REQUIRED = object()


class ConfigFields:
    """Checked reads of config.json keys. A key may have aliases (Falcon's `n_head`); the
    first one present (and not null) is read. Every failure names the key and the value."""

    def __init__(self, raw: dict, arch: str, supported: str = ""):
        self.raw, self.arch = raw, arch
        self.supported = supported  # what the refusal of a non-sparse activation lists

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _lookup(self, keys: tuple[str, ...], default):
        for key in keys:
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        if default is _REQUIRED:
            raise ModelFormatError(f"config.json of this {self.arch} model has no {keys[0]!r}")
        return None, default

    def invalid(self, key: str, value, what: str) -> ModelFormatError:
        """The error for a value that is not `what` (for checks across keys, too)."""
        return ModelFormatError(f"config.json: {key} must be {what}, not {value!r}")

    def int(self, *keys: str, default=_REQUIRED, minimum: int = 1) -> int:
        key, value = self._lookup(keys, default)
        if key is None:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.invalid(key, value, f"an integer >= {minimum}")
        return value

    def float(self, *keys: str, default=_REQUIRED, positive: bool = False) -> float:
        key, value = self._lookup(keys, default)
        if key is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise self.invalid(key, value, "a positive number" if positive else "a finite number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.invalid(key, value, "true or false")
        return value

    def str(self, *keys: str, default=_REQUIRED) -> str:
        key, value = self._lookup(keys, default)
        if key is not None and not isinstance(value, str):
            raise self.invalid(key, value, "a string")
        return value

    def activation(self, *keys: str, default: str | None = None, hint: str | None = None) -> str:
        """The FFN activation, as one of our kernels' names; one we do not compute (GELU) is refused.
        SiLU is accepted: the model runs dense (engine.activations.is_sparse)."""
        key, value = self._lookup(keys, None)
        if key is None:
            value = hint or default
        name = ACTIVATIONS.get(value.lower()) if isinstance(value, str) else None
        if name is None:
            raise ModelFormatError(
                f"activation {value!r} of this {self.arch} model is not sparse: Thermocline needs a ReLU-family "
                f"model (or a SiLU one, which runs dense); supported: {self.supported}"
            )
        return name

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        if eos is None:
            return ()
        values = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.invalid("eos_token_id", eos, "a token id or a list of them")
        return tuple(values)

    def token_id(self, key: str) -> int | None:
        return self.int(key, default=None, minimum=0)

    def sliding_window(self) -> int | None:
        if not self.bool("use_sliding_window", True):
            return None
        return self.int("sliding_window", default=None)

    def rope(self, max_positions: int) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; released checkpoints use rope_theta + rope_scaling.
        params, scaling = self.raw.get("rope_parameters") or {}, self.raw.get("rope_scaling") or {}
        for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
            if not isinstance(value, dict):
                raise self.invalid(key, value, "an object")
        theta = self.float("rope_theta", default=None, positive=True)  # checked even where params override it
        merged = {"rope_theta": theta, **params}
        merged.update({k: v for k, v in scaling.items() if v is not None})
        read = ConfigFields(merged, self.arch, self.supported)
        kind = read.str("rope_type", "type", default="default")
        if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
            raise ModelFormatError(f"unsupported RoPE scaling {kind!r}: supported are linear, dynamic, llama3, yarn")
        return RopeConfig(
            theta=read.float("rope_theta", default=10000.0, positive=True),
            kind=kind,
            factor=read.float("factor", default=1.0, positive=True),
            original_max_positions=read.int("original_max_position_embeddings", default=max_positions),
            low_freq_factor=read.float("low_freq_factor", default=1.0, positive=True),
            high_freq_factor=read.float("high_freq_factor", default=4.0, positive=True),
            beta_fast=read.float("beta_fast", default=32.0, positive=True),
            beta_slow=read.float("beta_slow", default=1.0, positive=True),
            attention_factor=read.float("attention_factor", default=None, positive=True),
        )
