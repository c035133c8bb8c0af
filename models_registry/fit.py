"""Will a model fit? A byte model of how the engine places tensors, over config.json alone.

It mirrors `engine/sparse.py::placement_problem` and `engine/placement.py::solve` (the
engine imports torch, this package must not), with every rule a parameter of `BytesModel`:

Fast device (CUDA, 16-bit: 2 bytes/element), filled in this order:
  1. the output head (lm_head, a copy even when tied, plus the final norm), if it fits;
  2. each layer's dense unit, in layer order, if it fits: attention (q, k, v, o and their
     biases), norms, the layer's predictor, and its KV cache = 2 (k,v) * ctx * n_kv_heads *
     head_dim elements;
  3. only when every layer's dense unit is there: hot FFN neurons, as many as the rest of
     the budget holds. One neuron = one row of gate (gated FFNs only), up and down^T, plus
     an 8-byte int64 index entry: n_mat * d * 2 + 8 bytes.
CPU, for the rest (4 bytes/element unless said otherwise):
  - the token embeddings, always (a lookup needs no GPU);
  - the head when it is not on the fast device (only its final norm when tied);
  - dense units of CPU layers, their KV cache in fp32;
  - cold FFN neurons as int8 rows with one fp32 scale per row, plus the index entry:
    n_mat * (d + 4) + 8 bytes (fp32 rows: n_mat * d * 4 + 8).
Predictor of a layer: fc1 [rank, d] + fc2 [n_ff, rank]; the real ranks from the model's
`thermocline/predictors.safetensors` when there is one, else rank 1024.
Verdict: "does not fit" when the CPU part exceeds the RAM budget; "fits" when no neuron is
cold and every dense part is on the GPU; else "fits with cold neurons on CPU".

Not counted: the CUDA context, activations and temporary buffers (small at batch 1), and
file pages the OS keeps cached. Suggested budgets leave room for them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.units import format_size

from .arch import ArchInfo, detect_architecture

VERDICT_FITS = "fits"
VERDICT_HYBRID = "fits with cold neurons on CPU"
VERDICT_NO = "does not fit"
DEFAULT_PREDICTOR_RANK = 1024
GiB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a config.json that decide memory."""

    family: str  # "llama" (gated FFN) | "falcon" (ungated)
    d: int
    n_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    gated: bool
    attn_bias: bool = False
    norm_params_per_layer: int = 0
    final_norm_params: int = 0

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def attention_params_per_layer(self) -> int:
        q = self.d * self.n_heads * self.head_dim
        kv = 2 * self.d * self.n_kv_heads * self.head_dim
        o = self.n_heads * self.head_dim * self.d
        bias = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.d if self.attn_bias else 0
        return q + kv + o + bias

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.d

    @property
    def ffn_params_per_neuron(self) -> int:
        return self.ffn_matrices * self.d

    @property
    def total_params(self) -> int:
        per_layer = (self.attention_params_per_layer + self.norm_params_per_layer
                     + self.n_ff * self.ffn_params_per_neuron)
        return (self.embedding_params + self.lm_head_params + self.final_norm_params
                + self.n_layers * per_layer)


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def shape_from_config(config: dict, arch: ArchInfo | None = None) -> ModelShape:
    """Read the memory-relevant numbers (Llama/Mistral/Bamboo or Falcon field names)."""
    arch = arch or detect_architecture(config)
    d = int(_first(config, "hidden_size", "n_embd", "d_model"))
    n_layers = int(_first(config, "num_hidden_layers", "n_layer", "num_layers"))
    n_heads = int(_first(config, "num_attention_heads", "n_head"))
    vocab = int(config["vocab_size"])
    head_dim = int(_first(config, "head_dim", default=d // n_heads))
    if arch.family == "falcon":
        new_arch = bool(config.get("new_decoder_architecture"))
        if new_arch:
            n_kv = int(_first(config, "num_kv_heads", "n_head_kv", default=n_heads))
        else:
            n_kv = 1 if config.get("multi_query", True) else n_heads
        parallel = bool(config.get("parallel_attn", True)) or new_arch
        n_ln = int(_first(config, "num_ln_in_parallel_attn", default=2 if new_arch else 1)) if parallel else 2
        norms = 2 * d * (1 if n_ln == 1 else 2)  # LayerNorm: weight + bias
        n_ff = int(_first(config, "ffn_hidden_size", default=4 * d))
        return ModelShape(
            family="falcon", d=d, n_ff=n_ff, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, vocab=vocab,
            tied_embeddings=bool(config.get("tie_word_embeddings", True)), gated=False,
            attn_bias=bool(config.get("bias", False)), norm_params_per_layer=norms,
            final_norm_params=2 * d,
        )
    return ModelShape(
        family="llama", d=d, n_ff=int(config["intermediate_size"]), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=int(_first(config, "num_key_value_heads", default=n_heads)),
        head_dim=head_dim, vocab=vocab,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), gated=True,
        attn_bias=bool(config.get("attention_bias", False)), norm_params_per_layer=2 * d,
        final_norm_params=d,
    )


def predictor_params_from_file(path: Path) -> list[int] | None:
    """Per-layer parameter counts of a predictors.safetensors, read from its header only."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    per_layer: dict[int, int] = {}
    for name, info in header.items():
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit() and isinstance(info, dict):
            count = 1
            for dim in info.get("shape", ()):
                count *= int(dim)
            per_layer[int(parts[1])] = per_layer.get(int(parts[1]), 0) + count
    return [per_layer[i] for i in sorted(per_layer)] or None


@dataclass(frozen=True)
class BytesModel:
    """Bytes per element on each tier and the engine's layout choices (module docstring)."""

    gpu_weight_bytes: int = 2  # fp16 / bf16 on CUDA (a CPU stand-in device would be 4)
    gpu_kv_bytes: int = 2
    cpu_dense_bytes: int = 4  # fp32
    cpu_kv_bytes: int = 4
    cold_quant: str = "int8"  # "int8": int8 rows + one fp32 scale per row; "fp32": plain rows
    neuron_index_bytes: int = 8  # the int64 id kept with every hot and cold neuron
    embeddings_on_gpu: bool = False  # the engine keeps the token embeddings in RAM

    def cold_neuron_bytes(self, shape: ModelShape) -> int:
        if self.cold_quant == "int8":
            return shape.ffn_matrices * (shape.d + 4) + self.neuron_index_bytes
        return shape.ffn_matrices * shape.d * self.cpu_dense_bytes + self.neuron_index_bytes

    def hot_neuron_bytes(self, shape: ModelShape) -> int:
        return shape.ffn_params_per_neuron * self.gpu_weight_bytes + self.neuron_index_bytes

    def kv_elements_per_layer(self, shape: ModelShape, ctx: int) -> int:
        return 2 * ctx * shape.n_kv_heads * shape.head_dim


@dataclass
class FitEstimate:
    """Where every byte of a model would go for given budgets and context length."""

    ctx: int
    vram_budget: int
    ram_budget: int
    total_params: int
    # bytes per part and tier
    dense_gpu_bytes: int = 0
    dense_cpu_bytes: int = 0
    predictor_gpu_bytes: int = 0
    predictor_cpu_bytes: int = 0
    kv_gpu_bytes: int = 0
    kv_cpu_bytes: int = 0
    hot_ffn_bytes: int = 0
    cold_ffn_bytes: int = 0
    hot_neurons: int = 0
    cold_neurons: int = 0
    gpu_layers: int = 0  # layers whose attention, predictor and KV cache are on the GPU
    globals_on_gpu: bool = False  # the output head (embeddings stay in RAM)
    verdict: str = VERDICT_NO
    reason: str = ""
    suggested_vram_budget: int | None = None
    suggested_ram_budget: int | None = None
    shape: dict = field(default_factory=dict)

    @property
    def vram_bytes(self) -> int:
        return self.dense_gpu_bytes + self.predictor_gpu_bytes + self.kv_gpu_bytes + self.hot_ffn_bytes

    @property
    def ram_bytes(self) -> int:
        return self.dense_cpu_bytes + self.predictor_cpu_bytes + self.kv_cpu_bytes + self.cold_ffn_bytes

    @property
    def hot_fraction(self) -> float:
        total = self.hot_neurons + self.cold_neurons
        return self.hot_neurons / total if total else 0.0

    def tier_bytes(self) -> dict[str, int]:
        """The same bytes under the engine's PlacementReport.tier_bytes names."""
        return {"fast_dense": self.dense_gpu_bytes + self.predictor_gpu_bytes, "fast_kv": self.kv_gpu_bytes,
                "fast_ffn": self.hot_ffn_bytes, "cpu_dense": self.dense_cpu_bytes + self.predictor_cpu_bytes,
                "cpu_kv": self.kv_cpu_bytes, "cpu_ffn": self.cold_ffn_bytes}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tier_bytes"] = self.tier_bytes()
        out.update(vram_bytes=self.vram_bytes, ram_bytes=self.ram_bytes, hot_fraction=self.hot_fraction)
        return out


def place_bytes(shape: ModelShape, *, ctx: int, vram_budget: int, ram_budget: int,
                predictor_params: list[int] | None = None, predictor_rank: int = DEFAULT_PREDICTOR_RANK,
                bytes_model: BytesModel = BytesModel()) -> FitEstimate:
    """Apply the placement rules of the module docstring to one shape and budget pair."""
    if ctx <= 0:
        raise ValueError("ctx must be positive")
    bm = bytes_model
    if predictor_params is None or len(predictor_params) != shape.n_layers:
        predictor_params = [predictor_rank * (shape.d + shape.n_ff)] * shape.n_layers
    est = FitEstimate(ctx=ctx, vram_budget=vram_budget, ram_budget=ram_budget,
                      total_params=shape.total_params, shape=asdict(shape))
    budget = max(int(vram_budget), 0)
    used = 0

    embed = shape.embedding_params
    if bm.embeddings_on_gpu and embed * bm.gpu_weight_bytes <= budget:
        used += embed * bm.gpu_weight_bytes
        est.dense_gpu_bytes += embed * bm.gpu_weight_bytes
    else:
        est.dense_cpu_bytes += embed * bm.cpu_dense_bytes

    head = shape.vocab * shape.d + shape.final_norm_params  # a GPU copy even when tied
    if used + head * bm.gpu_weight_bytes <= budget:
        used += head * bm.gpu_weight_bytes
        est.dense_gpu_bytes += head * bm.gpu_weight_bytes
        est.globals_on_gpu = True
    else:
        est.dense_cpu_bytes += (shape.lm_head_params + shape.final_norm_params) * bm.cpu_dense_bytes

    layer_dense = shape.attention_params_per_layer + shape.norm_params_per_layer
    kv_elems = bm.kv_elements_per_layer(shape, ctx)
    for layer in range(shape.n_layers):
        need = (layer_dense + predictor_params[layer]) * bm.gpu_weight_bytes + kv_elems * bm.gpu_kv_bytes
        if used + need <= budget:
            used += need
            est.gpu_layers += 1
            est.dense_gpu_bytes += layer_dense * bm.gpu_weight_bytes
            est.predictor_gpu_bytes += predictor_params[layer] * bm.gpu_weight_bytes
            est.kv_gpu_bytes += kv_elems * bm.gpu_kv_bytes
        else:
            est.dense_cpu_bytes += layer_dense * bm.cpu_dense_bytes
            est.predictor_cpu_bytes += predictor_params[layer] * bm.cpu_dense_bytes
            est.kv_cpu_bytes += kv_elems * bm.cpu_kv_bytes

    total_neurons = shape.n_layers * shape.n_ff
    # Hot neurons only once every layer's dense unit is on the GPU (as the engine's solver).
    hot = 0
    if est.gpu_layers == shape.n_layers:
        hot = min(total_neurons, (budget - used) // bm.hot_neuron_bytes(shape))
    est.hot_neurons = int(hot)
    est.cold_neurons = total_neurons - est.hot_neurons
    est.hot_ffn_bytes = est.hot_neurons * bm.hot_neuron_bytes(shape)
    est.cold_ffn_bytes = est.cold_neurons * bm.cold_neuron_bytes(shape)

    if est.ram_bytes > ram_budget:
        est.verdict = VERDICT_NO
        est.reason = (f"needs {format_size(est.ram_bytes)} of RAM beside the GPU; the RAM budget is "
                      f"{format_size(ram_budget)}")
    elif est.cold_neurons == 0 and est.globals_on_gpu and est.gpu_layers == shape.n_layers:
        est.verdict, est.reason = VERDICT_FITS, "all layers and FFN neurons on the GPU (embeddings in RAM)"
    else:
        est.verdict = VERDICT_HYBRID
        est.reason = (f"{est.hot_fraction:.0%} of FFN neurons and {est.gpu_layers}/{shape.n_layers} layers' "
                      "attention on the GPU, the rest in RAM")
    return est


def gpu_bytes_for_everything(shape: ModelShape, ctx: int, predictor_params: list[int] | None = None,
                             bytes_model: BytesModel = BytesModel()) -> int:
    """VRAM that holds the whole model and its KV cache (verdict "fits")."""
    est = place_bytes(shape, ctx=ctx, vram_budget=1 << 62, ram_budget=0,
                      predictor_params=predictor_params, bytes_model=bytes_model)
    return est.vram_bytes


# What the suggestion leaves free: CUDA context, activations and allocator slack on the GPU;
# the OS, the app and page cache in RAM.
VRAM_RESERVE = 768 * 1024**2
RAM_RESERVE_FRACTION = 0.15
RAM_RESERVE_MIN = 2 * GiB


def suggest_budgets(shape: ModelShape, ctx: int, *, vram_free: int, ram_available: int,
                    predictor_params: list[int] | None = None,
                    bytes_model: BytesModel = BytesModel()) -> tuple[int, int]:
    """(VRAM budget, RAM budget) for a machine: as much GPU as useful, then the RAM it leaves."""
    usable_vram = max(0, vram_free - VRAM_RESERVE) if vram_free > 0 else 0
    vram = min(usable_vram, gpu_bytes_for_everything(shape, ctx, predictor_params, bytes_model))
    ram_usable = max(0, ram_available - max(RAM_RESERVE_MIN, int(ram_available * RAM_RESERVE_FRACTION)))
    need = place_bytes(shape, ctx=ctx, vram_budget=vram, ram_budget=0,
                       predictor_params=predictor_params, bytes_model=bytes_model).ram_bytes
    ram = need if need <= ram_usable else ram_usable
    return vram, ram


def estimate_fit(config: dict, *, ctx: int, vram_budget: int | None = None, ram_budget: int | None = None,
                 hardware=None, model_dir: Path | None = None, known_activation: str | None = None,
                 predictor_rank: int = DEFAULT_PREDICTOR_RANK,
                 bytes_model: BytesModel = BytesModel()) -> FitEstimate:
    """The fit of one model (its config.json dict) for budgets and a context length.

    Budgets left as None become the suggested ones for `hardware` (a `HardwareInfo`; no
    hardware and no budget means 0). With `model_dir`, the real predictor sizes are used.
    """
    arch = detect_architecture(config, known_activation)
    shape = shape_from_config(config, arch)
    pred = None
    if model_dir is not None:
        pred = predictor_params_from_file(Path(model_dir) / "thermocline" / "predictors.safetensors")
    suggested = (None, None)
    if hardware is not None:
        suggested = suggest_budgets(shape, ctx, vram_free=hardware.usable_vram_free,
                                    ram_available=hardware.ram_available, predictor_params=pred,
                                    bytes_model=bytes_model)
    vram = vram_budget if vram_budget is not None else (suggested[0] or 0)
    ram = ram_budget if ram_budget is not None else (suggested[1] or 0)
    est = place_bytes(shape, ctx=ctx, vram_budget=vram, ram_budget=ram, predictor_params=pred,
                      predictor_rank=predictor_rank, bytes_model=bytes_model)
    est.suggested_vram_budget, est.suggested_ram_budget = suggested
    return est
