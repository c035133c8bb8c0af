"""Neuron placement: which tensors live on the fast device under a VRAM and a RAM budget.

The solver first reserves the dense parts (output head, then each layer's attention,
norms, predictor and KV cache) on the fast device while they fit. Once every dense part
is there, the rest of the VRAM budget goes to FFN neurons, chosen across all layers by
activation frequency: every neuron costs the same bytes, so taking the most frequent
ones maximises the expected share of activated neurons served by the fast device. That
is a top-k over all neurons (argpartition, linear time), so it runs while a slider
moves. Everything not on the fast device must fit the RAM budget, or the answer is
"does not fit" with the minimum RAM.

A third tier, the disk (PowerInfer-2), where the problem allows it (`disk_tier`: int8/int4 CPU
rows of a dense FFN or of a mixture's experts, which the prepared files hold): the RAM budget
may go below the CPU side's bytes, down to its resident parts (attention, predictors, norms,
KV cache, head; the embeddings go to disk first where the head is not them) plus a working set
of neuron slots (`WORKING_SHARE` of the largest layer; a mixture's, one expert) and the
readers' buffers. What RAM is left is a neuron cache, seeded with the cold neurons needed most
often (`need_frequencies`: a mixture caches by expert and by neuron inside an expert, so the
experts the router rarely picks stay on disk); the rest stay in the prepared file and a token
reads those it needs (`disk_read_per_token`, expected from the same frequencies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.config import ModelConfig
from engine.cpu_formats import predictor_cpu_format
from engine.kv_storage import cpu_kv_bytes as kv_setting_bytes
from engine.kernels.tensor_kinds import Q4_0_BLOCK, Q4_0_BLOCK_BYTES


@dataclass(frozen=True)
class LayerCost:
    dense_fast: int  # attention + norms + predictor, stored on the fast device
    dense_cpu: int   # the same stored on the CPU
    kv_fast: int
    kv_cpu: int


@dataclass(frozen=True)
class PlacementProblem:
    layers: list[LayerCost]
    frequencies: list[np.ndarray]  # per layer, float [n_ff]: how often each neuron fires
    neuron_fast: int  # bytes of one hot neuron (its rows and index entry)
    neuron_cpu: int   # bytes of one cold neuron
    head_fast: int    # output head + final norm on the fast device
    head_cpu: int     # ... on the CPU (0 extra for the head when tied to the embeddings)
    embed_cpu: int    # token embeddings always stay on the CPU (a lookup)
    fast_device: str = "cuda:0"
    unit: str = "neurons"  # what is placed: FFN neurons, or neurons of a mixture's experts (engine/hotcold/moe_tiers.py)
    expert_size: int = 0   # a mixture: neurons per expert (a layer's units are expert e's at e*size..)
    disk_tier: bool = False  # cold rows beyond the RAM budget may stay in the prepared file
    # on the disk tier the embeddings may stay in the prepared file too (a token reads one row)
    # where they are not the head, which every token reads whole
    embed_disk: bool = False
    embed_row: int = 0  # bytes of one embedding row (what a token reads of them)
    # per layer, how often a token needs each unit's rows resident (the disk tier caches and reads
    # by it); None: `frequencies`. A mixture's neuron is needed whenever its expert is chosen (the
    # kernel reads every gate row of a chosen expert), or, where the experts carry predictors,
    # when it is predicted.
    need_frequencies: list[np.ndarray] | None = None
    read_buffers: int = 0  # the disk tier's read buffers (neuron_bundles.buffer_bytes), counted with the cache
    # the cold rows are a neuron cache's (a load that reads rows from disk): counted as its slots
    # even when every cold neuron fits, since the cache holds them
    cached: bool = False


@dataclass(frozen=True)
class ModelBytes:
    """The element counts that decide placement. Torch-free: the model registry builds
    one from config.json before a download, the engine from its loaded config."""
    d: int
    n_ff: int
    n_layers: int
    vocab: int
    attention_params: int  # per layer: q, k, v, o and their biases
    attention_rows: int    # per layer: rows of the qkv and output matrices (one int8 scale each)
    attention_bias_params: int  # per layer: the part of attention_params that is biases
    norm_params: int       # per layer
    final_norm_params: int
    kv_per_position: int   # per layer: 2 (k, v) * kv_heads * head_dim
    ffn_matrices: int      # rows per neuron: gate, up, down (3) or up, down (2)
    tied_embeddings: bool
    unit: str = "neurons"  # "experts": the units are the neurons of a mixture's experts
    expert_size: int = 0   # "experts": neurons per expert; n_ff = experts * expert_size
    # A tied head gets its own int8 (4-bit) copy on an int8 (int4) CPU tier (the embeddings
    # stay fp32 for the lookup): a quarter (an eighth) of the bytes per token. A mixture reads few FFN bytes per token,
    # so there the fp32 head would be most of them.
    int8_head_copy: bool = False

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelBytes":
        if config.num_experts:
            return cls.for_experts(config)
        d, hd = config.hidden_size, config.head_dim
        layer_norm = config.norm_kind == "layer"  # LayerNorm has a bias
        one_norm = config.parallel_attn and config.num_ln_in_parallel_attn == 1
        q_kv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
        bias = (q_kv_rows + d) if config.attention_bias else 0
        return cls(
            d=d, n_ff=config.intermediate_size, n_layers=config.num_layers, vocab=config.vocab_size,
            attention_params=q_kv_rows * d + d * config.num_heads * hd + bias,
            attention_rows=q_kv_rows + d, attention_bias_params=bias,
            norm_params=(2 if layer_norm else 1) * d * (1 if one_norm else 2),
            final_norm_params=(2 if layer_norm else 1) * d,
            kv_per_position=2 * config.num_kv_heads * hd,
            ffn_matrices=3 if config.gated else 2,
            tied_embeddings=config.tie_word_embeddings,
        )

    @classmethod
    def for_experts(cls, config: ModelConfig) -> "ModelBytes":
        """A mixture of experts placed by expert and by neuron: the unit is one neuron of one
        expert (its gate, up and down rows of d; expert e's neurons are units e*n..e*n+n-1),
        so the solver can take whole experts or the hot neurons of one. The router [E, d]
        is a dense matrix of the layer like attention (it reads the layer input)."""
        d, hd, experts = config.hidden_size, config.head_dim, config.num_experts
        q_kv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
        return cls(
            d=d, n_ff=experts * config.intermediate_size, n_layers=config.num_layers, vocab=config.vocab_size,
            attention_params=q_kv_rows * d + d * config.num_heads * hd + experts * d,
            attention_rows=q_kv_rows + d + experts, attention_bias_params=0,
            norm_params=2 * d, final_norm_params=d,
            kv_per_position=2 * config.num_kv_heads * hd,
            ffn_matrices=3,
            tied_embeddings=config.tie_word_embeddings,
            unit="experts", expert_size=config.intermediate_size,
            int8_head_copy=config.tie_word_embeddings,
        )


COLD_INT8 = "int8"  # CPU weights as int8 rows with one fp32 scale per row
COLD_INT4 = "int4"  # CPU weights as 4-bit rows: ggml's Q4_0 blocks, 18 bytes per 32 weights
CPU_BYTES = 4       # fp32 on the CPU: embeddings, norms, biases, and weights stored as fp32 (the KV cache: engine/kv_storage.py)
INDEX_BYTES = 8     # the int64 id kept with every hot and cold neuron
# The disk tier's smallest neuron cache: this share of the largest layer's neurons, slots a
# token's misses are read into. A layer's predicted set up to it is computed in one pass; a
# larger one chunk by chunk, as the kernel splits it over threads (the same bits); only a chunk
# whose predicted set exceeds it in rounds whose sums differ in order (neuron_cache.DiskFfn).
WORKING_SHARE = 0.25
DISK_FORMATS = (COLD_INT8, COLD_INT4)  # the prepared file holds rows in these formats
# A cached neuron's bookkeeping beside its rows (owner layer and position, int32 each; its
# CLOCK count and pinned flag; a kernel call's padded predictor id, int64); every cold neuron
# also has its slot (INDEX_BYTES, -1: on disk), and the padded ids take one more per neuron of
# the largest group (a layer, or a mixture's expert).
SLOT_META_BYTES = 18
Q4_BLOCK, Q4_BLOCK_BYTES = Q4_0_BLOCK, Q4_0_BLOCK_BYTES  # ggml's block_q4_0 (tensor_kinds: torch-free)


def hot_row_format(fast_device: str, cpu_weights: str, *, moe: bool = False) -> str | None:
    """The hot tier's row format: 4-bit rows ("int4", the CPU tier's Q4_0 bytes, hot_q4's
    kernels) on a CUDA fast tier when the CPU weights are int4, else None (the fast tier's
    compute dtype); a mixture's experts never. Torch-free: the engine (hot_q4.hot_weights)
    and the fit estimate (models_registry.fit) both take it from here."""
    if moe:
        return None
    return COLD_INT4 if fast_device.split(":")[0] == "cuda" and cpu_weights == COLD_INT4 else None


def cpu_matrix_bytes(params: int, rows: int, cpu_weights: str) -> int:
    """Bytes of weight matrices on the CPU tier: int8 values and an fp32 scale per row,
    4-bit rows of whole 32-weight blocks (exact when the rows share one length), or fp32."""
    if cpu_weights == COLD_INT4:
        if not rows:
            return 0
        cols = -(-params // rows)
        return rows * -(-cols // Q4_BLOCK) * Q4_BLOCK_BYTES
    return params + rows * CPU_BYTES if cpu_weights == COLD_INT8 else params * CPU_BYTES


def predictor_cpu_bytes(model: "ModelBytes", params: int, cpu_weights: str) -> int:
    """Bytes of one layer's predictor (fc1 [rank, d], fc2 [n_ff, rank]: params elements) on
    the CPU tier (a file's 4-bit predictors, kept as they are, take less). A mixture's
    experts each carry one (TurboSparse-Mixtral: fc1 [rank, d], fc2 [expert_size, rank])."""
    if model.unit == "experts":
        experts = model.n_ff // model.expert_size
        rank = params // (experts * (model.d + model.expert_size))
        rows = experts * (rank + model.expert_size)
    else:
        rows = params // (model.d + model.n_ff) + model.n_ff
    return cpu_matrix_bytes(params, rows if params else 0, predictor_cpu_format(cpu_weights))


def attention_cpu_bytes(model: "ModelBytes", params: int, cpu_weights: str) -> int:
    """Bytes of one layer's attention matrices (params weights, no biases) on the CPU tier.
    4-bit rows: q|k|v rows of d weights and d output rows of heads * head_dim counted apart."""
    if cpu_weights != COLD_INT4:
        return cpu_matrix_bytes(params, model.attention_rows, cpu_weights)
    qkv_rows = model.attention_rows - model.d
    out_cols = (params - qkv_rows * model.d) // model.d
    return cpu_matrix_bytes(qkv_rows * model.d, qkv_rows, cpu_weights) + cpu_matrix_bytes(model.d * out_cols, model.d,
                                                                                         cpu_weights)


def build_problem(model: ModelBytes, predictor_params: list[int], frequencies: list[np.ndarray], ctx: int,
                  fast_weight_bytes: int, fast_kv_bytes: int, cpu_weights: str,
                  fast_device: str = "cuda:0", hot_weights: str | None = None,
                  cpu_kv_bytes: int | None = None, disk_tier: bool | None = None,
                  need_frequencies: list[np.ndarray] | None = None) -> PlacementProblem:
    """Bytes of every placeable part, exactly as the engine allocates them.

    Fast tier: the output head (its own copy even when tied to the embeddings), each
    layer's attention, norms, predictor and KV cache, hot neurons (rows + id). CPU tier:
    the embeddings (always, fp32), whatever of those did not fit, cold neurons (rows +
    id). On the CPU tier the weight matrices (attention, an untied head, predictors, FFN
    rows) are int8 rows with an fp32 scale each when cpu_weights is int8, else fp32; the
    KV cache is cpu_kv_bytes per element (None: the setting, fp16 unless
    THERMOCLINE_KV_CACHE=fp32); the rest is fp32. hot_weights "int4": hot neurons are 4-bit
    rows (engine.hotcold.hot_q4). disk_tier (None: int8/int4 rows, which the prepared files
    hold, of a dense FFN or of experts) lets cold rows stay on disk below the RAM budget; its
    readers' buffers count with the cache; need_frequencies: PlacementProblem's.
    """
    from engine.hotcold.neuron_bundles import buffer_bytes, bundle_size

    if disk_tier is None:
        disk_tier = cpu_weights in DISK_FORMATS
    if cpu_kv_bytes is None:
        cpu_kv_bytes = kv_setting_bytes()
    layers = []
    attention_matrices = model.attention_params - model.attention_bias_params
    for params in predictor_params:
        dense = model.attention_params + model.norm_params + params
        dense_cpu = (attention_cpu_bytes(model, attention_matrices, cpu_weights)
                     + predictor_cpu_bytes(model, params, cpu_weights)
                     + (model.attention_bias_params + model.norm_params) * CPU_BYTES)
        kv = model.kv_per_position * ctx
        layers.append(LayerCost(dense * fast_weight_bytes, dense_cpu, kv * fast_kv_bytes, kv * cpu_kv_bytes))
    rows = model.ffn_matrices
    head = model.vocab * model.d
    shares_embeddings = model.tied_embeddings and not (model.int8_head_copy and cpu_weights in (COLD_INT8, COLD_INT4))
    head_cpu = 0 if shares_embeddings else cpu_matrix_bytes(head, model.vocab, cpu_weights)
    return PlacementProblem(
        layers=layers,
        frequencies=frequencies,
        neuron_fast=(cpu_matrix_bytes(rows * model.d, rows, COLD_INT4) if hot_weights == COLD_INT4
                     else rows * model.d * fast_weight_bytes) + INDEX_BYTES,
        neuron_cpu=cpu_matrix_bytes(rows * model.d, rows, cpu_weights) + INDEX_BYTES,
        head_fast=(head + model.final_norm_params) * fast_weight_bytes,
        head_cpu=model.final_norm_params * CPU_BYTES + head_cpu,
        embed_cpu=head * CPU_BYTES,
        fast_device=fast_device,
        unit=model.unit,
        expert_size=model.expert_size,
        disk_tier=disk_tier,
        embed_disk=disk_tier and not shares_embeddings,  # a lookup table only, where the head is its own
        need_frequencies=need_frequencies,
        embed_row=model.d * CPU_BYTES,
        read_buffers=buffer_bytes(bundle_size(cpu_matrix_bytes(rows * model.d, rows, cpu_weights)), model.n_ff)
        if disk_tier else 0,
    )


@dataclass
class Placement:
    head_on_fast: bool
    layer_on_fast: list[bool]
    hot_ids: list[np.ndarray]  # sorted neuron ids per layer
    vram_bytes: int
    ram_bytes: int
    tier_bytes: dict[str, int]
    hot_hit_fraction: float
    fits: bool
    verdict: str
    min_ram_bytes: int
    solve_s: float
    device: str
    hot_fraction_per_layer: list[float] = field(default_factory=list)
    unit: str = "neurons"
    total_units: int = 0  # neurons (of experts, for a mixture) of all layers
    expert_size: int = 0  # a mixture: neurons per expert
    # the disk tier: cold neurons in the RAM cache and on disk, the bytes on disk, and per token
    # the expected bytes read from disk and from RAM (weights a decode step reads)
    cache_neurons: int = 0
    disk_neurons: int = 0
    disk_bytes: int = 0
    disk_read_per_token: float = 0.0
    ram_read_per_token: float = 0.0
    expected_cache_hit: float = 1.0  # of the cold neurons a token computes, the share the cache serves
    resident_ram_bytes: int = 0  # the CPU side without its FFN rows: the least RAM that runs from disk
    embed_on_disk: bool = False  # the embeddings stay in the prepared file (the disk tier, an untied head)

    def summary(self) -> dict:
        out = {
            "device": self.device,
            "fits": self.fits,
            "verdict": self.verdict,
            "vram_bytes": self.vram_bytes,
            "ram_bytes": self.ram_bytes,
            "min_ram_bytes": self.min_ram_bytes,
            "tier_bytes": self.tier_bytes,
            "hot_hit_fraction": self.hot_hit_fraction,
            "head_on_fast": self.head_on_fast,
            "layers": [
                {"layer": i, "dense_on_fast": fast, "hot_neurons": int(len(ids)), "hot_fraction": frac}
                for i, (fast, ids, frac) in enumerate(zip(self.layer_on_fast, self.hot_ids,
                                                          self.hot_fraction_per_layer))
            ],
            "solve_s": self.solve_s,
            "disk": {"cache_neurons": self.cache_neurons, "disk_neurons": self.disk_neurons,
                     "disk_bytes": self.disk_bytes, "disk_read_per_token": self.disk_read_per_token,
                     "ram_read_per_token": self.ram_read_per_token, "expected_cache_hit": self.expected_cache_hit,
                     "resident_ram_bytes": self.resident_ram_bytes},
        }
        if self.unit == "experts":  # a mixture of experts: whole and split experts per tier and layer
            n = self.expert_size
            experts = self.total_units // max(n, 1)
            whole = split = 0
            out["unit"] = "experts"
            for layer, ids in zip(out["layers"], self.hot_ids):
                per_expert = np.bincount(np.asarray(ids, dtype=np.int64) // n, minlength=experts // len(self.hot_ids))
                layer["hot_experts"] = int((per_expert == n).sum())
                layer["split_experts"] = int(((per_expert > 0) & (per_expert < n)).sum())
                whole += layer["hot_experts"]
                split += layer["split_experts"]
            out["experts_per_tier"] = {"fast": whole, "split": split, "cpu": experts - whole - split}
        return out


def _top_neurons(frequencies: list[np.ndarray], count: int) -> list[np.ndarray]:
    """The `count` most frequent neurons over all layers; ties go to the lower (layer, id)."""
    sizes = [len(f) for f in frequencies]
    if count <= 0:
        return [np.empty(0, dtype=np.int64) for _ in sizes]
    flat = np.concatenate(frequencies)
    if count >= flat.size:
        chosen = np.arange(flat.size)
    else:
        kth = np.partition(flat, flat.size - count)[flat.size - count]
        above = np.flatnonzero(flat > kth)
        ties = np.flatnonzero(flat == kth)[: count - above.size]  # flatnonzero is ascending
        chosen = np.sort(np.concatenate([above, ties]))
    bounds = np.cumsum([0] + sizes)
    return [chosen[(chosen >= lo) & (chosen < hi)] - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def solve(problem: PlacementProblem, vram_budget: int, ram_budget: int) -> Placement:
    start = time.perf_counter()
    layers = problem.layers
    used = 0
    head_on_fast = problem.head_fast <= vram_budget
    if head_on_fast:
        used += problem.head_fast
    layer_on_fast = []
    for cost in layers:
        fits = used + cost.dense_fast + cost.kv_fast <= vram_budget
        layer_on_fast.append(fits)
        if fits:
            used += cost.dense_fast + cost.kv_fast

    # Hot neurons only once every dense part is on the fast device: a layer computed on
    # the CPU gains nothing from a few rows on the GPU, and this keeps the solution
    # monotone in the budget.
    hot_count = 0
    if all(layer_on_fast) and problem.neuron_fast > 0:
        total_neurons = sum(len(f) for f in problem.frequencies)
        hot_count = min(total_neurons, (vram_budget - used) // problem.neuron_fast)
    hot_ids = _top_neurons(problem.frequencies, hot_count)
    hot_bytes = hot_count * problem.neuron_fast
    cold_count = sum(len(f) for f in problem.frequencies) - hot_count

    tiers = {
        "fast_dense": (problem.head_fast if head_on_fast else 0)
        + sum(c.dense_fast for c, fast in zip(layers, layer_on_fast) if fast),
        "fast_kv": sum(c.kv_fast for c, fast in zip(layers, layer_on_fast) if fast),
        "fast_ffn": hot_bytes,
        "cpu_dense": problem.embed_cpu + (0 if head_on_fast else problem.head_cpu)
        + sum(c.dense_cpu for c, fast in zip(layers, layer_on_fast) if not fast),
        "cpu_kv": sum(c.kv_cpu for c, fast in zip(layers, layer_on_fast) if not fast),
        "cpu_ffn": cold_count * problem.neuron_cpu,
    }
    vram = tiers["fast_dense"] + tiers["fast_kv"] + tiers["fast_ffn"]
    ram = tiers["cpu_dense"] + tiers["cpu_kv"] + tiers["cpu_ffn"]

    total_freq = sum(float(f.sum()) for f in problem.frequencies)
    hot_freq = sum(float(f[ids].sum()) for f, ids in zip(problem.frequencies, hot_ids))
    hit = hot_freq / total_freq if total_freq > 0 else (hot_count / max(hot_count + cold_count, 1))
    resident = ram - tiers["cpu_ffn"]
    # Below the RAM budget the embeddings go to disk first (a token reads one row of them; the
    # engine maps them from the prepared file), then the least frequent cold rows.
    embed_on_disk = ram > ram_budget and problem.disk_tier and problem.embed_disk
    if embed_on_disk:
        resident -= problem.embed_cpu
    in_cache = ram > ram_budget or (problem.cached and problem.disk_tier)
    disk = _disk_tier(problem, hot_ids, cold_count, resident, ram_budget) if in_cache else None
    min_ram = ram
    if disk is not None:
        min_ram = disk.pop("min_ram")
    if disk is not None and disk["cache_neurons"] is not None:
        if embed_on_disk:
            tiers["cpu_dense"] -= problem.embed_cpu
            disk["disk_bytes"] += problem.embed_cpu
            disk["disk_read_per_token"] += problem.embed_row
        tiers["cpu_ffn"] = (disk["cache_neurons"] * (_row_bytes(problem) + SLOT_META_BYTES)
                            + (cold_count + largest_group(problem)) * INDEX_BYTES + problem.read_buffers)
        ram = resident + tiers["cpu_ffn"]
    else:
        # nothing runs from disk (the budget is below its minimum, or there is no disk tier):
        # the embeddings stay in RAM and in the tiers' counts (the registry's suggested budget
        # is the RAM side of a placement at a budget of 0)
        disk = None
        embed_on_disk = False
    # a cache below its working set cannot run, whatever the plain count says
    fits = ram <= ram_budget and not (problem.cached and problem.disk_tier and disk is None)
    if not fits:
        verdict = "does not fit"
    elif disk is not None and (disk["disk_neurons"] or embed_on_disk):
        verdict = "runs from disk"
    elif cold_count == 0 and all(layer_on_fast) and head_on_fast:
        verdict = "fits"
    else:
        verdict = "fits with cold neurons on CPU"
    cold_read = _cold_read_bytes(problem, hot_ids)
    return Placement(
        head_on_fast=head_on_fast,
        layer_on_fast=layer_on_fast,
        hot_ids=hot_ids,
        vram_bytes=vram,
        ram_bytes=ram,
        tier_bytes=tiers,
        hot_hit_fraction=hit,
        fits=fits,
        verdict=verdict,
        min_ram_bytes=min_ram,  # at this VRAM budget; more VRAM lowers it
        solve_s=time.perf_counter() - start,
        device=problem.fast_device,
        hot_fraction_per_layer=[len(ids) / max(len(f), 1) for ids, f in zip(hot_ids, problem.frequencies)],
        unit=problem.unit,
        total_units=sum(len(f) for f in problem.frequencies),
        expert_size=problem.expert_size,
        resident_ram_bytes=resident,
        ram_read_per_token=tiers["cpu_dense"] - (0 if embed_on_disk else problem.embed_cpu) + cold_read
        - (disk["disk_read_per_token"] - (problem.embed_row if embed_on_disk else 0) if disk else 0.0),
        embed_on_disk=embed_on_disk and disk is not None,
        **(disk or {}),
    )


def _row_bytes(problem: PlacementProblem) -> int:
    return problem.neuron_cpu - INDEX_BYTES


def _cold_read_bytes(problem: PlacementProblem, hot_ids: list[np.ndarray]) -> float:
    """Expected bytes of cold FFN rows one token reads (each neuron's firing frequency)."""
    total = 0.0
    for f, ids in zip(problem.frequencies, hot_ids):
        total += float(f.sum()) - float(f[ids].sum())
    return total * _row_bytes(problem)


def cold_frequencies(problem: PlacementProblem, hot_ids: list[np.ndarray], need: bool = False) -> list[np.ndarray]:
    """Per layer, the frequencies of the cold neurons in id order (hot ones left out); with
    `need`, how often each is needed resident (PlacementProblem.need_frequencies)."""
    out = []
    for f, ids in zip(problem.need_frequencies or problem.frequencies if need else problem.frequencies, hot_ids):
        mask = np.ones(len(f), dtype=bool)
        mask[ids] = False
        out.append(np.asarray(f, dtype=np.float64)[mask])
    return out


def largest_group(problem: PlacementProblem) -> int:
    """Neurons of the largest group the cache computes at once: a layer, or one expert."""
    if problem.unit == "experts":
        return problem.expert_size
    return max((len(f) for f in problem.frequencies), default=0)


def min_cache_neurons(problem: PlacementProblem) -> int:
    """The disk tier's working set: slots for a share of the largest layer's neurons; a
    mixture's, one whole expert (its experts are computed one at a time, so a token never
    needs more of them resident at once)."""
    if problem.unit == "experts":
        return problem.expert_size
    return int(np.ceil(WORKING_SHARE * max((len(f) for f in problem.frequencies), default=0)))


def _disk_tier(problem: PlacementProblem, hot_ids, cold_count: int, resident: int, ram_budget: int) -> dict | None:
    """The RAM cache and the disk share when the cold rows exceed the RAM budget: the most
    frequent cold neurons in the cache (its seed), the rest on disk. `cache_neurons` is None
    (with the least RAM in `min_ram`) when the budget is below the resident parts plus the
    working set, or the problem has no disk tier."""
    slot = _row_bytes(problem) + SLOT_META_BYTES
    maps = (cold_count + largest_group(problem)) * INDEX_BYTES + problem.read_buffers
    working = min(cold_count, min_cache_neurons(problem))
    min_ram = resident + maps + working * slot
    if not problem.disk_tier:
        return None
    if ram_budget < min_ram:
        return {"min_ram": min_ram, "cache_neurons": None}
    cache = min(cold_count, (ram_budget - resident - maps) // slot)
    freqs = np.sort(np.concatenate(cold_frequencies(problem, hot_ids, need=True) or [np.empty(0)]))[::-1]
    cached_freq, total = float(freqs[:cache].sum()), float(freqs.sum())
    disk_neurons = cold_count - cache
    return {"min_ram": min_ram, "cache_neurons": int(cache), "disk_neurons": int(disk_neurons),
            "disk_bytes": int(disk_neurons * _row_bytes(problem)),
            "disk_read_per_token": (total - cached_freq) * _row_bytes(problem),
            "expected_cache_hit": cached_freq / total if total > 0 else 1.0}


# What a speed estimate assumes when nothing was measured: the low end of desktop memory
# bandwidth (DESIGN.md: 20-70 GB/s), an NVMe SSD's random reads of a few KB at a deep queue,
# and English text's words per token.
RAM_BANDWIDTH = 20e9
DISK_BANDWIDTH = 1.5e9
WORDS_PER_TOKEN = 0.75


def words_per_second(plan: Placement, ram_bandwidth: float = RAM_BANDWIDTH,
                     disk_bandwidth: float = DISK_BANDWIDTH) -> float:
    """The decode speed in words a second the weight reads of a token allow (decode_speed)."""
    return decode_speed(plan, ram_bandwidth, disk_bandwidth) * WORDS_PER_TOKEN


def decode_speed(plan: Placement, ram_bandwidth: float, disk_bandwidth: float) -> float:
    """Tokens a second one decode step's weight reads allow: the RAM side at ram_bandwidth,
    the disk reads at disk_bandwidth (bytes a second), one after the other."""
    seconds = plan.ram_read_per_token / ram_bandwidth + plan.disk_read_per_token / disk_bandwidth
    return 1.0 / seconds if seconds > 0 else float("inf")
