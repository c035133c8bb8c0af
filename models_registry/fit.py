"""Will a model fit? The engine's placement rules applied to config.json alone.

The rules themselves live in `engine.hotcold.placement` (torch-free, so this package may use
them): fast device first for the output head, then each layer's attention, norms,
predictor and KV cache in layer order, then, once every layer's dense part is there, hot
FFN neurons; the CPU keeps the embeddings and everything else, its weight matrices
(attention, an untied head, predictors, cold FFN rows) as int8 rows with one fp32 scale
per row. `BytesModel` says how many bytes an element takes on each
tier. Predictor sizes come from the model's `thermocline/predictors.safetensors` header
when there is one, else rank 1024.

Not counted: the CUDA context, activations and temporary buffers (small at batch 1), and
file pages the OS keeps cached. Suggested budgets leave room for them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.budget_policy import usable_ram, usable_vram
from engine.hotcold.placement import (
    ModelBytes,
    build_problem,
    hot_row_format,
    predictor_cpu_bytes,
    solve,
    words_per_second,
)
from engine.units import format_rate, format_size

from .arch import ArchInfo, detect_architecture

VERDICT_FITS = "fits"
VERDICT_HYBRID = "fits with cold neurons on CPU"
VERDICT_NO = "does not fit"
UNLIMITED = 1 << 62  # a RAM budget no machine has: the placement with nothing on disk
VERDICT_DISK = "runs from disk"  # cold rows beyond a RAM neuron cache read from the prepared file
DEFAULT_ACTIVE_SHARE = 0.15  # neurons a token computes when the catalogue gives no sparsity (ReLU models: 10-33%)
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
    # A mixture of experts (SmallThinker): n_ff counts experts of `expert_ff` neurons each,
    # the placed unit; every layer also has a router [n_ff, d]. 0: a dense FFN.
    expert_ff: int = 0
    experts_per_token: int = 0  # a mixture: experts the router chooses for a token
    max_positions: int | None = None  # the context cap (ModelConfig.context_length)
    # Experts that carry neuron predictors (TurboSparse-Mixtral): each layer's predictor
    # parameters over all its experts, E * rank * (d + expert_ff); () where none or unknown.
    expert_predictor_params: tuple[int, ...] = ()

    @property
    def ffn_matrices(self) -> int:
        """Rows of d per placed unit: a neuron's gate, up, down (or up, down), or an expert's."""
        return 3 * self.expert_ff if self.expert_ff else (3 if self.gated else 2)

    @property
    def router_params_per_layer(self) -> int:
        return self.n_ff * self.d if self.expert_ff else 0

    @property
    def attention_params_per_layer(self) -> int:
        q = self.d * self.n_heads * self.head_dim
        kv = 2 * self.d * self.n_kv_heads * self.head_dim
        o = self.n_heads * self.head_dim * self.d
        return q + kv + o + self.attention_bias_params_per_layer + self.router_params_per_layer

    @property
    def attention_bias_params_per_layer(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.d if self.attn_bias else 0

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
                + self.n_layers * per_layer + sum(self.expert_predictor_params))


def shape_from_config(config: dict, arch: ArchInfo | None = None) -> ModelShape:
    """Read the memory-relevant numbers through the engine's parser (engine.config)."""
    arch = arch or detect_architecture(config)
    cfg = arch.config or detect_architecture(config).config
    d = cfg.hidden_size
    per_norm = 2 * d if cfg.norm_kind == "layer" else d  # LayerNorm: weight + bias; RMSNorm: weight
    shared_norm = cfg.parallel_attn and cfg.num_ln_in_parallel_attn == 1  # one norm feeds attention and MLP
    norms, final_norm = per_norm * (1 if shared_norm else 2), per_norm
    return ModelShape(
        family=cfg.family, d=d, n_ff=cfg.n_ff, n_layers=cfg.num_layers, n_heads=cfg.num_heads,
        n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
        tied_embeddings=cfg.tie_word_embeddings, gated=cfg.gated, attn_bias=cfg.attention_bias,
        norm_params_per_layer=norms, final_norm_params=final_norm, max_positions=cfg.max_positions,
        expert_ff=cfg.intermediate_size if cfg.num_experts else 0,
        experts_per_token=cfg.experts_per_token if cfg.num_experts else 0,
        expert_predictor_params=tuple(cfg.num_experts * rank * (d + cfg.intermediate_size)
                                      for rank in cfg.expert_predictor_ranks),
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
    """Bytes per element on the fast tier, and the CPU tier's format of weight matrices."""

    gpu_weight_bytes: int = 2  # fp16 / bf16 on CUDA (a CPU stand-in device holds fp32: 4)
    gpu_kv_bytes: int = 2
    cpu_weights: str = "int8"  # CPU matrices: "int8" rows + one fp32 scale per row; "fp32"
    cpu_kv_bytes: int | None = None  # the CPU KV cache (None: the engine's setting, fp16 unless fp32 is asked)
    fast_device: str = "cuda"  # the fast tier ("cpu" for a CPU stand-in): CUDA + int4 CPU weights = 4-bit hot rows


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
    # the disk tier (engine.hotcold.placement): cold neurons in the RAM cache and on disk, and
    # per token the expected bytes read from disk and RAM, and the speed they allow
    cache_neurons: int = 0
    disk_neurons: int = 0
    disk_bytes: int = 0
    disk_read_per_token: float = 0.0
    ram_read_per_token: float = 0.0
    words_per_s: float = 0.0
    min_ram_bytes: int = 0  # the least RAM budget that runs at this VRAM budget
    dense: bool = False  # a SwiGLU model without CATS thresholds: no predictors, every neuron read
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


def power_law_frequencies(n: int, mean: float) -> np.ndarray:
    """How often each of n neurons fires when nothing was profiled: Zipf's law (exponent 1,
    which puts about 80% of the firings on the top 20% of the neurons, PowerInfer's
    observation), scaled to the mean share, capped at every token."""
    f = 1.0 / np.arange(1, n + 1, dtype=np.float64)
    scale = mean * n / f.sum()
    for _ in range(8):  # capping at 1 lowers the mean: scale up what is left
        capped = np.minimum(f * scale, 1.0)
        if capped.sum() >= mean * n * 0.999:
            break
        scale *= mean * n / capped.sum()
    return np.minimum(f * scale, 1.0)


def moe_frequencies(shape: ModelShape, active_share: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A mixture with no profile: (what the solver ranks units by, how often a token needs
    each unit resident; engine.model.moe's two measures), per layer. The router is taken as
    balanced (each expert chosen on experts_per_token / experts of the tokens: training
    balances it; a profile shows the skew the disk tier exploits); inside a chosen expert
    the neurons fire by `power_law_frequencies`, `active_share` of all experts' neurons in
    all. A chosen expert reads every gate row (needed whenever chosen) unless its experts
    carry predictors (needed when predicted: when it fires)."""
    experts, n = shape.n_ff, shape.expert_ff
    chosen = min(1.0, (shape.experts_per_token or 1) / experts)
    fires = chosen * power_law_frequencies(n, min(1.0, active_share / chosen))
    rank = np.tile((chosen + 2 * fires) / 3, experts)
    need = np.tile(fires, experts) if shape.expert_predictor_params else np.full(experts * n, chosen)
    return [rank] * shape.n_layers, [need] * shape.n_layers


def placement_bytes(shape: ModelShape) -> ModelBytes:
    """The element counts the engine's placement rules take."""
    return ModelBytes(
        # a mixture places the neurons of its experts: n_ff experts of expert_ff neurons
        d=shape.d, n_ff=shape.n_ff * (shape.expert_ff or 1), n_layers=shape.n_layers, vocab=shape.vocab,
        attention_params=shape.attention_params_per_layer, norm_params=shape.norm_params_per_layer,
        attention_rows=(shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim + shape.d
        + (shape.n_ff if shape.expert_ff else 0),  # a router's rows
        attention_bias_params=shape.attention_bias_params_per_layer,
        final_norm_params=shape.final_norm_params, kv_per_position=2 * shape.n_kv_heads * shape.head_dim,
        ffn_matrices=3 if shape.expert_ff else shape.ffn_matrices, tied_embeddings=shape.tied_embeddings,
        unit="experts" if shape.expert_ff else "neurons", expert_size=shape.expert_ff,
        int8_head_copy=bool(shape.expert_ff) and shape.tied_embeddings,
    )


def place_bytes(shape: ModelShape, *, ctx: int, vram_budget: int, ram_budget: int,
                predictor_params: list[int] | None = None, predictor_rank: int = DEFAULT_PREDICTOR_RANK,
                bytes_model: BytesModel = BytesModel(), active_share: float | None = None) -> FitEstimate:
    """Where the engine's own placement rules (engine.placement) put one shape's bytes.
    `active_share`: the share of neurons a token computes (1 - the catalogue's sparsity),
    which sets the bytes a token reads; neurons fire by `power_law_frequencies` (which ones
    are hot changes no byte count, only the disk tier's expected cache hits)."""
    if ctx <= 0:
        raise ValueError("ctx must be positive")
    if shape.max_positions:  # the engine's cap (ModelConfig.context_length): no longer than trained
        ctx = min(ctx, shape.max_positions)
    bm = bytes_model
    if shape.expert_ff:  # the router chooses the experts; predictors only where the experts carry them
        predictor_params = list(shape.expert_predictor_params) or [0] * shape.n_layers
    elif predictor_params is None or len(predictor_params) != shape.n_layers:
        predictor_params = [predictor_rank * (shape.d + shape.n_ff)] * shape.n_layers
    # Which neurons are hot does not change any byte count: uniform frequencies will do.
    model = placement_bytes(shape)
    share = DEFAULT_ACTIVE_SHARE if active_share is None else active_share
    need = None
    if shape.expert_ff:
        frequencies, need = moe_frequencies(shape, share)
    else:
        frequencies = [power_law_frequencies(model.n_ff, share)] * shape.n_layers
    hot = hot_row_format(bm.fast_device, bm.cpu_weights, moe=bool(shape.expert_ff))  # the engine's rule
    problem = build_problem(model, predictor_params, frequencies, ctx, bm.gpu_weight_bytes,
                            bm.gpu_kv_bytes, bm.cpu_weights, fast_device=bm.fast_device, hot_weights=hot,
                            cpu_kv_bytes=bm.cpu_kv_bytes, need_frequencies=need)
    plan = solve(problem, max(int(vram_budget), 0), ram_budget)
    tiers = plan.tier_bytes
    on_gpu = plan.layer_on_fast
    est = FitEstimate(ctx=ctx, vram_budget=vram_budget, ram_budget=ram_budget,
                      total_params=shape.total_params, shape=asdict(shape))
    est.predictor_gpu_bytes = sum(p for p, fast in zip(predictor_params, on_gpu) if fast) * bm.gpu_weight_bytes
    est.predictor_cpu_bytes = sum(predictor_cpu_bytes(model, p, bm.cpu_weights)
                                  for p, fast in zip(predictor_params, on_gpu) if not fast)
    est.dense_gpu_bytes = tiers["fast_dense"] - est.predictor_gpu_bytes
    est.dense_cpu_bytes = tiers["cpu_dense"] - est.predictor_cpu_bytes
    est.kv_gpu_bytes, est.kv_cpu_bytes = tiers["fast_kv"], tiers["cpu_kv"]
    est.hot_ffn_bytes, est.cold_ffn_bytes = tiers["fast_ffn"], tiers["cpu_ffn"]
    est.hot_neurons = sum(len(ids) for ids in plan.hot_ids)
    est.cold_neurons = shape.n_layers * model.n_ff - est.hot_neurons  # of experts, for a mixture
    est.gpu_layers = sum(on_gpu)
    est.globals_on_gpu = plan.head_on_fast
    est.verdict = plan.verdict
    est.cache_neurons, est.disk_neurons, est.disk_bytes = plan.cache_neurons, plan.disk_neurons, plan.disk_bytes
    est.disk_read_per_token, est.ram_read_per_token = plan.disk_read_per_token, plan.ram_read_per_token
    est.words_per_s = round(words_per_second(plan), 1)
    est.min_ram_bytes = plan.min_ram_bytes
    if est.verdict == VERDICT_NO:
        beside = " beside the GPU" if vram_budget > 0 else ""  # no GPU: "beside the GPU" misleads
        est.reason = (f"needs {format_size(plan.min_ram_bytes)} of RAM{beside}; the RAM budget is "
                      f"{format_size(ram_budget)}")
    elif est.verdict == VERDICT_DISK:
        est.reason = disk_reason(est, est.words_per_s)
    elif est.verdict == VERDICT_FITS:
        est.reason = "all layers and FFN neurons on the GPU (embeddings in RAM)"
    elif est.hot_neurons == 0 and est.gpu_layers == 0:
        # No GPU (or a zero VRAM budget): "0% on the GPU" reads like a failure; say what happens.
        est.reason = "runs on the CPU alone: every layer in RAM"
    else:
        est.reason = (f"{est.hot_fraction:.0%} of FFN neurons and {est.gpu_layers}/{shape.n_layers} layers' "
                      "attention on the GPU, the rest in RAM")
    return est


def disk_reason(est: FitEstimate, words_s: float | None) -> str:
    """What a "runs from disk" verdict rests on; with the speed the placement's fixed bandwidths
    give, or without it where a speed measured on this machine is shown beside (one speed a card)."""
    text = (f"{format_size(est.disk_bytes)} of cold FFN rows on disk, a neuron cache in RAM; reads "
            f"{format_size(int(est.disk_read_per_token))} from disk per token")
    if words_s is not None:
        text += f" and runs from disk at about {format_rate(words_s)} words a second"
    return text


def gpu_bytes_for_everything(shape: ModelShape, ctx: int, predictor_params: list[int] | None = None,
                             bytes_model: BytesModel = BytesModel()) -> int:
    """VRAM that holds the whole model and its KV cache (verdict "fits")."""
    est = place_bytes(shape, ctx=ctx, vram_budget=1 << 62, ram_budget=0,
                      predictor_params=predictor_params, bytes_model=bytes_model)
    return est.vram_bytes


def suggest_budgets(shape: ModelShape, ctx: int, *, vram_free: int, ram_available: int,
                    predictor_params: list[int] | None = None,
                    bytes_model: BytesModel = BytesModel()) -> tuple[int, int]:
    """(VRAM budget, RAM budget) for a machine: as much GPU as useful, then the RAM it leaves
    (the engine's default budgets, `engine.budget_policy`, capped at what the model needs)."""
    vram = min(usable_vram(vram_free), gpu_bytes_for_everything(shape, ctx, predictor_params, bytes_model))
    ram_usable = usable_ram(ram_available)
    # what the model takes with every byte in RAM: a budget of 0 would be the disk tier's least
    need = place_bytes(shape, ctx=ctx, vram_budget=vram, ram_budget=UNLIMITED,
                       predictor_params=predictor_params, bytes_model=bytes_model).ram_bytes
    ram = need if need <= ram_usable else ram_usable
    return vram, ram


def estimate_fit(config: dict, *, ctx: int, vram_budget: int | None = None, ram_budget: int | None = None,
                 hardware=None, model_dir: Path | None = None, known_activation: str | None = None,
                 predictor_rank: int = DEFAULT_PREDICTOR_RANK,
                 bytes_model: BytesModel = BytesModel(), sparsity: float | None = None) -> FitEstimate:
    """The fit of one model (its config.json dict) for budgets and a context length.

    Budgets left as None become the suggested ones for `hardware` (a `HardwareInfo`; no
    hardware and no budget means 0). With `model_dir`, the real predictor sizes are used.
    `sparsity` (the catalogue's) sets the bytes a token reads (DEFAULT_ACTIVE_SHARE without).
    """
    arch = detect_architecture(config, known_activation)
    shape = shape_from_config(config, arch)
    pred = None
    dense = runs_dense(arch, model_dir)
    if dense:
        pred = [0] * shape.n_layers  # no predictors: every neuron is computed
    elif model_dir is not None:
        pred = predictor_params_from_file(Path(model_dir) / "thermocline" / "predictors.safetensors")
    suggested = (None, None)
    if hardware is not None:
        suggested = suggest_budgets(shape, ctx, vram_free=hardware.usable_vram_free,
                                    ram_available=hardware.ram_available, predictor_params=pred,
                                    bytes_model=bytes_model)
    vram = vram_budget if vram_budget is not None else (suggested[0] or 0)
    ram = ram_budget if ram_budget is not None else (suggested[1] or 0)
    est = place_bytes(shape, ctx=ctx, vram_budget=vram, ram_budget=ram, predictor_params=pred,
                      predictor_rank=predictor_rank, bytes_model=bytes_model,
                      active_share=1.0 if dense else None if sparsity is None else 1.0 - sparsity)
    est.suggested_vram_budget, est.suggested_ram_budget = suggested
    est.dense = dense
    return est


def runs_dense(arch: ArchInfo, model_dir: Path | None) -> bool:
    """Whether the engine runs this model dense (no predictors, every neuron read): the engine's
    own rule (Engine.load: `is_sparse` over the config and the folder's CATS record), so a SwiGLU
    model is dense until `thermocline profile --target-sparsity` calibrated its thresholds."""
    from engine.activations import is_sparse
    from engine.config import read_cats

    cfg = arch.config
    threshold = cfg.activation_threshold if cfg is not None else 0.0
    cats = read_cats(model_dir, cfg.num_layers) if model_dir is not None and cfg is not None else None
    return not is_sparse(arch.activation, threshold, cats["thresholds"] if cats else ())
