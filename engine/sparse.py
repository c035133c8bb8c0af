"""The sparse engine: placement applied to a loaded model, and live re-placement.

`build_sparse_engine` loads a model for the `sparse`, `hybrid` and `oracle` modes:
dense parts go where the placement puts them, each layer's FFN is split into hot rows
(fast device) and cold rows (CPU). `SparseRuntime.set_budgets` re-solves and moves only
the rows and tensors that change tier; during a generation the move happens at the next
token boundary, and the KV cache (the conversation) is kept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import host_memory
from .activation_stats import ActivationStats
from .config import ModelConfig
from .errors import BudgetError, UserError
from .hybrid_ffn import ColdRows, FfnCounters, HotRows, HybridFfn
from .kernels import cpu as cpu_kernels
from .kernels import cpu_q4
from .loader import compute_dtype, load_transformer
from .model import DenseFfn, Transformer
from .placement import ModelBytes, Placement, PlacementProblem, build_problem, solve
from .predictors import PredictorSet, import_checkpoint_predictors
from .quantized import QuantMatrix, quantize_matrix
from .units import format_size
from .weights import WeightSource

COLD_QUANTS = ("int4", "int8", "fp32")
log = logging.getLogger(__name__)


def pick_fast_device(device: str | None) -> torch.device:
    if device:
        from .validation import resolve_device

        return resolve_device(device)
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def default_budgets(fast: torch.device, mode: str) -> tuple[int, int]:
    """VRAM: 90% of the GPU's free memory (0 without one: the CPU stand-in starts empty).
    RAM: 90% of what is available now."""
    import psutil

    vram = 0
    if mode != "sparse" and fast.type == "cuda":
        free, _ = torch.cuda.mem_get_info(fast)
        vram = int(free * 0.9)
    return vram, int(psutil.virtual_memory().available * 0.9)


@dataclass
class PlacementReport:
    """What the app's budget panel shows (see docs/ARCHITECTURE.md)."""
    hot_fraction_per_layer: list[float]
    tier_bytes: dict[str, int]
    vram_bytes: int
    ram_bytes: int
    hot_hit_fraction: float
    verdict: str
    solve_s: float
    device: str
    applied: bool  # False: queued for the next token boundary of a running generation
    allocated: dict[str, int] | None = None  # bytes really held after applying

    @classmethod
    def from_placement(cls, plan: Placement, applied: bool, allocated: dict | None) -> "PlacementReport":
        return cls(plan.hot_fraction_per_layer, dict(plan.tier_bytes), plan.vram_bytes, plan.ram_bytes,
                   plan.hot_hit_fraction, plan.verdict, plan.solve_s, plan.device, applied, allocated)


def placement_problem(config: ModelConfig, predictor_ranks: list[int], frequencies: list[np.ndarray],
                      ctx: int, fast: torch.device, storage: torch.dtype, cold_quant: str) -> PlacementProblem:
    """The engine's placement problem: the fast tier holds its compute dtype."""
    fast_bytes = torch.finfo(compute_dtype(fast, storage)).bits // 8
    params = [rank * (config.hidden_size + config.intermediate_size) for rank in predictor_ranks]
    return build_problem(ModelBytes.from_config(config), params, frequencies, ctx, fast_bytes, fast_bytes,
                         cold_quant, str(fast))


class SparseRuntime:
    def __init__(self, engine_lock: threading.RLock, config: ModelConfig, mode: str, fast: torch.device,
                 storage: torch.dtype, predictors: PredictorSet | None, problem: PlacementProblem,
                 cold_quant: str):
        self.lock = engine_lock
        self.config, self.mode, self.fast, self.storage = config, mode, fast, storage
        self.predictors = predictors
        self.thresholds = list(predictors.thresholds) if predictors else [0.0] * config.num_layers
        self.problem, self.cold_quant = problem, cold_quant
        self.counters = FfnCounters()
        self.scoring_mode: str | None = None
        self.plan: Placement | None = None
        self.model: Transformer | None = None
        self.cache = None
        self._pending: Placement | None = None
        self._pending_lock = threading.Lock()
        self.override_masks = None  # benchmarks: callable(layer) -> bool mask [n_ff] replacing the threshold
        self.prepared_path: Path | None = None  # the prepared rows file read or written at load
        self.prepared_rows = None  # engine.prepared.PreparedRows when this load mapped one

    # --------------------------------------------------------------- per token
    def predictor_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.predictors is None:
            raise UserError("this mode needs activation predictors")
        logits = self.predictors.logits(layer, x)
        if self.override_masks is not None:
            threshold = self.thresholds[layer]
            return torch.where(self.override_masks(layer).to(logits.device), threshold + 1.0, threshold - 1.0)
        return logits

    def begin_generation(self) -> None:
        self.counters = FfnCounters()
        self.at_token_boundary()

    def at_token_boundary(self) -> None:
        with self._pending_lock:
            plan, self._pending = self._pending, None
        if plan is not None:
            self.apply(plan)

    def generation_fractions(self) -> tuple[float, float]:
        return self.counters.fractions()

    @contextlib.contextmanager
    def scoring(self, mode: str):
        if mode not in ("sparse", "hybrid", "oracle"):
            raise UserError(f"unknown scoring mode {mode}")
        if mode != "oracle" and self.predictors is None:
            raise UserError(f"mode {mode} needs activation predictors")
        self.scoring_mode = mode
        try:
            yield
        finally:
            self.scoring_mode = None

    # ------------------------------------------------------------- placement
    def solve(self, vram: int, ram: int) -> Placement:
        if self.mode == "sparse":
            vram = 0
        if self.fast.type == "cuda" and vram > 0:
            total = torch.cuda.get_device_properties(self.fast).total_memory
            if vram > total:
                raise BudgetError(f"VRAM budget {format_size(vram)} exceeds the GPU's {format_size(total)}")
        plan = solve(self.problem, vram, ram)
        if not plan.fits:
            best = solve(self.problem, 1 << 62, 1 << 62)
            raise BudgetError(
                f"RAM budget {format_size(ram)} is too small: at a VRAM budget of {format_size(vram)} the CPU "
                f"side needs {format_size(plan.ram_bytes)}; raise the RAM budget to at least that"
                + (f" (or give {format_size(best.vram_bytes)} of VRAM, which lowers it to "
                   f"{format_size(best.ram_bytes)})" if self.mode != "sparse" and self.fast.type == "cuda" else "")
            )
        return plan

    def set_budgets(self, vram: int | None, ram: int | None) -> PlacementReport:
        vram = self.budgets[0] if vram is None else int(vram)
        ram = self.budgets[1] if ram is None else int(ram)
        plan = self.solve(vram, ram)
        self.budgets = (vram, ram)
        if self.lock.acquire(blocking=False):
            try:
                self.apply(plan)
                return PlacementReport.from_placement(plan, True, self.memory()["tiers"])
            finally:
                self.lock.release()
        with self._pending_lock:  # a generation holds the engine: move at its next token
            self._pending = plan
        return PlacementReport.from_placement(plan, False, None)

    def report(self) -> PlacementReport:
        return PlacementReport.from_placement(self.plan, True, self.memory()["tiers"])

    # -------------------------------------------------------------- applying
    def fast_dtype(self) -> torch.dtype:
        return compute_dtype(self.fast, self.storage)

    def _where(self, on_fast: bool) -> tuple[torch.device, torch.dtype]:
        cpu = torch.device("cpu")
        return (self.fast, self.fast_dtype()) if on_fast else (cpu, torch.float32)

    def split_ffn(self, layer: int, dense: DenseFfn, hot_ids: np.ndarray, all_rows=None) -> HybridFfn:
        """Split a freshly loaded fp32 CPU FFN into hot and cold rows. `all_rows`: the whole
        layer already in the CPU format (rows are quantized one by one, so the cold rows
        are a selection of them)."""
        hot_idx = torch.as_tensor(hot_ids, dtype=torch.long)
        cold_mask = torch.ones(dense.n_ff, dtype=torch.bool)
        cold_mask[hot_idx] = False
        cold_idx = torch.nonzero(cold_mask).flatten()
        device, dtype = self._where(True)
        gate, up, down_t = dense.gate, dense.up, dense.down_t
        hot = HotRows(
            None if gate is None else _hot_rows(gate[hot_idx], device, dtype),
            _hot_rows(up[hot_idx], device, dtype), _hot_rows(down_t[hot_idx], device, dtype),
            hot_idx.to(device),
        )
        if all_rows is not None:
            rows = all_rows if len(cold_idx) == dense.n_ff else all_rows.select(cold_idx)
        else:
            rows = cold_rows_from_dense(None if gate is None else gate[cold_idx], up[cold_idx], down_t[cold_idx],
                                        self.cold_quant)
        cold = ColdRows(rows, cold_idx)
        return HybridFfn(layer, gate is not None, self.config.activation, self.config.activation_threshold,
                         dense.n_ff, hot, cold, self)

    def cold_ffn(self, layer: int, rows) -> HybridFfn:
        """A layer whose neurons all sit on the CPU, from rows already in the CPU format
        (a prepared file's mapped rows: taken as they are)."""
        device, dtype = self._where(True)
        d, n = self.config.hidden_size, self.config.intermediate_size
        empty = torch.empty(0, d, device=device, dtype=dtype)
        hot = HotRows(empty if rows.gated else None, empty, empty, torch.empty(0, dtype=torch.long, device=device))
        return HybridFfn(layer, rows.gated, self.config.activation, self.config.activation_threshold, n, hot,
                         ColdRows(rows, torch.arange(n)), self)

    def apply(self, plan: Placement) -> None:
        """Move what changed tier; called with the engine lock held (or between tokens)."""
        model = self.model
        if plan.head_on_fast != self.plan.head_on_fast:
            device, dtype = self._where(plan.head_on_fast)
            model.lm_head = self._head_weights(plan.head_on_fast)
            norm = model.final_norm
            norm.weight = norm.weight.to(device, dtype)
            norm.bias = None if norm.bias is None else norm.bias.to(device, dtype)
        for i, layer in enumerate(model.layers):
            if plan.layer_on_fast[i] != self.plan.layer_on_fast[i]:
                self._move_layer_dense(i, plan.layer_on_fast[i])
            new_ids = plan.hot_ids[i]
            if not np.array_equal(new_ids, self.plan.hot_ids[i]):
                self._move_neurons(layer.ffn, new_ids)
        self.plan = plan

    def _head_weights(self, on_fast: bool) -> torch.Tensor | QuantMatrix:
        """The output head for its tier. A tied head shares the embeddings on the CPU tier;
        on the fast tier it is its own copy, even when the CPU stands in for the GPU, so
        the bytes are those a GPU would hold."""
        model = self.model
        device, dtype = self._where(on_fast)
        if not self.config.tie_word_embeddings:
            return self._tier_matrix(model.lm_head, on_fast)
        return model.embed.to(device, dtype, copy=True) if on_fast else model.embed

    def _tier_matrix(self, w: torch.Tensor | QuantMatrix, on_fast: bool) -> torch.Tensor | QuantMatrix:
        """A dense weight matrix in its tier's storage: the fast tier's dtype, or on the CPU
        tier fp32, or int8 / 4-bit rows when the CPU weights are int8 / int4 (a quarter /
        about an eighth of the bytes to read per token)."""
        if not on_fast and self.cold_quant != "fp32":
            return quantize_matrix(w, self.cold_quant)
        device, dtype = self._where(on_fast)
        return w.to_dense(device, dtype) if isinstance(w, QuantMatrix) else w.to(device, dtype)

    def place_predictor(self, i: int, on_fast: bool) -> None:
        """Layer i's predictor in its tier's storage (int8 rows on an int8 CPU tier)."""
        if self.predictors is not None:
            quant = self.cold_quant if not on_fast and self.cold_quant != "fp32" else None
            self.predictors.to(i, *self._where(on_fast), quant=quant)

    def convert_layer_dense(self, layer, on_fast: bool) -> None:
        """The attention matrices of a freshly loaded layer into its tier's storage."""
        layer.qkv = self._tier_matrix(layer.qkv, on_fast)
        layer.out = self._tier_matrix(layer.out, on_fast)

    def _ensure_rotary(self, device: torch.device, dtype: torch.dtype) -> None:
        if device not in self.model.rotary:
            from .rope import RotaryTable

            self.model.rotary[device] = RotaryTable(self.config.rope, self.config.head_dim, self.cache.slots,
                                                    dtype, device)

    def _move_layer_dense(self, i: int, to_fast: bool) -> None:
        device, dtype = self._where(to_fast)
        layer = self.model.layers[i]
        self.convert_layer_dense(layer, to_fast)
        for name in ("qkv_bias", "out_bias"):
            t = getattr(layer, name)
            if t is not None:
                setattr(layer, name, t.to(device, dtype))
        for norm in (layer.attn_norm, layer.mlp_norm):
            if norm is not None:
                norm.weight = norm.weight.to(device, dtype)
                norm.bias = None if norm.bias is None else norm.bias.to(device, dtype)
        layer.device = device
        self.place_predictor(i, to_fast)
        kv_dtype = self.cache.storage_dtype(device, dtype)  # the conversation moves with its layer
        self.cache.k[i] = self.cache.k[i].to(device, kv_dtype)
        self.cache.v[i] = self.cache.v[i].to(device, kv_dtype)
        self._ensure_rotary(device, dtype)

    def _move_neurons(self, ffn: HybridFfn, new_hot: np.ndarray) -> None:
        """Promote and demote only the neurons whose tier changes."""
        old_hot_ids = ffn.hot.ids.cpu().numpy()
        new_hot = np.asarray(new_hot, dtype=np.int64)
        keep_hot = np.isin(old_hot_ids, new_hot)
        promote = np.setdiff1d(new_hot, old_hot_ids)
        cold_ids = ffn.cold.ids.numpy()
        keep_cold = ~np.isin(cold_ids, promote)
        device, dtype = self._where(True)

        # Hot rows: those that stay plus the promoted ones read from the cold tier.
        promote_pos = torch.as_tensor(np.flatnonzero(~keep_cold))
        pg, pu, pd = ffn.cold.rows.select(promote_pos).dequantized() if len(promote_pos) else (None, None, None)
        stay = torch.as_tensor(np.flatnonzero(keep_hot), device=ffn.hot.up.device)

        def hot_rows(old: torch.Tensor | None, promoted: torch.Tensor | None):
            if old is None:
                return None
            parts = [old.index_select(0, stay)]
            if promoted is not None:
                parts.append(promoted.to(device, dtype))
            return torch.cat(parts)

        ids = np.concatenate([old_hot_ids[keep_hot], cold_ids[~keep_cold]])
        order = torch.as_tensor(np.argsort(ids, kind="stable"))
        gate, up, down_t = (hot_rows(ffn.hot.gate, pg), hot_rows(ffn.hot.up, pu), hot_rows(ffn.hot.down_t, pd))
        dev_order = order.to(device)
        new_hot_rows = HotRows(None if gate is None else _hot_rows(gate[dev_order], device, dtype),
                               _hot_rows(up[dev_order], device, dtype), _hot_rows(down_t[dev_order], device, dtype),
                               torch.as_tensor(ids[order.numpy()], device=device))

        # Cold rows: those that stay plus the demoted ones copied back from the fast device.
        demote_pos = np.flatnonzero(~keep_hot)
        kept = ffn.cold.rows.select(torch.as_tensor(np.flatnonzero(keep_cold)))
        parts = [kept]
        if len(demote_pos):
            g, u, d = ffn.hot.fp32_rows()
            pos = torch.as_tensor(demote_pos)
            parts.append(cold_rows_from_dense(None if g is None else g[pos], u[pos], d[pos], self.cold_quant))
        cold_all = np.concatenate([cold_ids[keep_cold], old_hot_ids[demote_pos]])
        cold_order = torch.as_tensor(np.argsort(cold_all, kind="stable"))
        rows = _concat_rows(parts).select(cold_order) if len(parts) > 1 else kept
        ffn.hot = new_hot_rows
        ffn.cold = ColdRows(rows, torch.as_tensor(cold_all[cold_order.numpy()]))

    # ------------------------------------------------------------ accounting
    def memory(self) -> dict:
        """Bytes really allocated per tier (weights, predictors, KV cache, index maps)."""
        model, plan = self.model, self.plan

        def nb(*tensors):
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        head = nb(model.final_norm.weight, model.final_norm.bias) + model.head_nbytes
        tiers = {"fast_dense": 0, "fast_kv": 0, "fast_ffn": 0, "cpu_dense": nb(model.embed), "cpu_kv": 0,
                 "cpu_ffn": 0}
        tiers["fast_dense" if plan.head_on_fast else "cpu_dense"] += head
        for i, layer in enumerate(model.layers):
            tier = "fast" if plan.layer_on_fast[i] else "cpu"
            predictor = self.predictors.nbytes(i) if self.predictors is not None else 0
            tiers[f"{tier}_dense"] += layer.dense_nbytes + predictor
            tiers[f"{tier}_kv"] += nb(self.cache.k[i], self.cache.v[i])
            tiers["fast_ffn"] += layer.ffn.hot.nbytes
            tiers["cpu_ffn"] += layer.ffn.cold.nbytes
        vram = tiers["fast_dense"] + tiers["fast_kv"] + tiers["fast_ffn"]
        ram = tiers["cpu_dense"] + tiers["cpu_kv"] + tiers["cpu_ffn"]
        return {"vram_bytes": vram, "ram_bytes": ram, "device": str(self.fast), "tiers": tiers}


def _hot_rows(rows: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Hot rows for the fast tier; when the CPU stands in for it, on huge pages like the
    cold rows, since the same CPU kernels read them at random."""
    if device.type == "cpu":
        return host_memory.copy_of(rows, dtype)
    return rows.to(device, dtype).contiguous()


def cold_rows_from_dense(gate, up, down_t, quant: str):
    """Float rows [n, d] in the CPU kernels' storage for `quant` (int4, int8 or fp32)."""
    if quant == cpu_q4.QUANT:
        return cpu_q4.Q4FfnRows.from_dense(gate, up, down_t)
    return cpu_kernels.CpuFfnRows.from_dense(gate, up, down_t, quant=quant)


def _concat_rows(parts: list):
    if parts[0].quant == cpu_q4.QUANT:
        return cpu_q4.Q4FfnRows.concat(parts)
    def cat(name):
        tensors = [getattr(p, name) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return cpu_kernels.CpuFfnRows(cat("gate"), cat("up"), cat("down_t"), cat("gate_scale"), cat("up_scale"),
                                  cat("down_scale"), quant=parts[0].quant)


def problem_for_model(model_dir: Path, config: ModelConfig, ctx: int, fast: torch.device, cold_quant: str,
                      predictors: PredictorSet | None = None, storage: torch.dtype | None = None) -> PlacementProblem:
    """The placement problem of a model folder, from its config, predictors and statistics."""
    import_checkpoint_predictors(model_dir, config)  # those a checkpoint carries count too
    if predictors is None and PredictorSet.exists(model_dir):
        predictors = PredictorSet.load(model_dir, config.num_layers, config.hidden_size, config.intermediate_size)
    if ActivationStats.exists(model_dir):
        frequencies = [f.numpy() for f in ActivationStats.load(model_dir).frequencies()]
        if len(frequencies) != config.num_layers or any(len(f) != config.n_ff for f in frequencies):
            raise UserError(f"activation statistics of {model_dir} do not match the model; profile it again")
    else:  # no profile yet: every neuron alike, placement by neuron order
        frequencies = [np.ones(config.n_ff) for _ in range(config.num_layers)]
    ranks = predictors.ranks if predictors else [0] * config.num_layers
    storage = storage or WeightSource(model_dir).dtype()
    return placement_problem(config, ranks, frequencies, ctx, fast, storage, cold_quant)


def _prepared_source(model_dir: Path, config: ModelConfig, cold_quant: str):
    """(mapped prepared rows, None) when a current prepared file exists; else (None, a
    writer for one) for the int8/int4 formats; (None, None) when preparing is off or the
    model's folder cannot be written (a read-only install)."""
    from . import prepared

    if cold_quant not in prepared.FORMATS or not prepared.enabled() or prepared.is_bundled(model_dir):
        return None, None
    rows = prepared.PreparedRows.open_if_current(model_dir, cold_quant)
    if rows is not None:
        return rows, None
    try:
        writer = prepared.PreparedWriter(model_dir, cold_quant, prepared.checkpoint_key(model_dir, cold_quant),
                                         config.intermediate_size, config.hidden_size, config.gated,
                                         config.num_layers)
    except OSError as exc:
        log.warning("not preparing %s: %s", model_dir, exc)
        return None, None
    return None, writer


def build_sparse_engine(engine_cls, model_dir: Path, config: ModelConfig, tokenizer, mode: str, ctx: int,
                        vram_budget: int | None, ram_budget: int | None, device: str | None, progress,
                        cold_quant: str = "int8"):
    if cold_quant not in COLD_QUANTS:
        raise UserError(f"unknown CPU weight format {cold_quant!r}: choose int4, int8 or fp32")
    if config.is_moe:  # placed expert by expert, routed by the model's own router
        if cold_quant == "int4":  # the expert tiers keep CpuFfnRows (int8 or fp32) only so far
            raise UserError("mixture-of-experts models take --cpu-weights int8 or fp32; int4 experts are not built yet")
        from .moe_tiers import build_moe_engine

        return build_moe_engine(engine_cls, model_dir, config, tokenizer, mode, ctx, vram_budget, ram_budget,
                                device, progress, cold_quant)
    if config.mlp_bias:
        raise UserError("sparse modes do not support FFN biases yet; use --mode dense for this model")
    fast = pick_fast_device(device)
    default_vram, default_ram = default_budgets(fast, mode)
    vram = default_vram if vram_budget is None else vram_budget
    ram = default_ram if ram_budget is None else ram_budget
    predictors = None
    import_checkpoint_predictors(model_dir, config)  # TurboSparse: the checkpoint's own, once
    if mode != "oracle" or PredictorSet.exists(model_dir):
        predictors = PredictorSet.load(model_dir, config.num_layers, config.hidden_size, config.intermediate_size)
    storage = WeightSource(model_dir).dtype()
    problem = problem_for_model(model_dir, config, ctx, fast, cold_quant, predictors, storage)
    runtime = SparseRuntime(threading.RLock(), config, mode, fast, storage, predictors, problem, cold_quant)
    plan = runtime.solve(vram, ram)
    runtime.budgets = (vram, ram)
    runtime.plan = plan
    cpu = torch.device("cpu")
    layer_devices = [fast if on else cpu for on in plan.layer_on_fast]
    head_device = fast if plan.head_on_fast else cpu
    prepared_rows, writer = _prepared_source(model_dir, config, cold_quant)
    runtime.prepared_path = prepared_rows.path if prepared_rows is not None else None
    runtime.prepared_rows = prepared_rows

    def mapped(i: int) -> bool:  # this layer's FFN comes from the prepared file
        return prepared_rows is not None and len(plan.hot_ids[i]) == 0 and prepared_rows.has_layer(i)

    def build_ffn(i: int, dense):
        if dense is None:
            return runtime.cold_ffn(i, prepared_rows.layer_rows(i, config.hidden_size))
        all_rows = None
        if writer is not None:
            if progress:
                progress(i / config.num_layers, f"preparing layer {i + 1} of {config.num_layers} "
                                                f"({cold_quant} rows, first load only)")
            all_rows = cold_rows_from_dense(dense.gate, dense.up, dense.down_t, cold_quant)
            writer.add_layer(i, all_rows)
        return runtime.split_ffn(i, dense, plan.hot_ids[i], all_rows)

    try:
        model = load_transformer(
            model_dir, config, layer_devices, head_device, ctx, progress, ffn_builder=build_ffn,
            on_layer=lambda i, layer: runtime.convert_layer_dense(layer, plan.layer_on_fast[i]),
            read_ffn=lambda i: not mapped(i),
        )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        try:
            runtime.prepared_path = writer.finish()
        except OSError as exc:
            writer.abort()
            log.warning("could not write the prepared rows of %s: %s", model_dir, exc)
    for i, on_fast in enumerate(plan.layer_on_fast):
        runtime.place_predictor(i, on_fast)
    cache = engine_cls.make_cache(config, ctx, layer_devices, [compute_dtype(d, storage) for d in layer_devices])
    runtime.model, runtime.cache = model, cache
    model.lm_head = runtime._head_weights(plan.head_on_fast)
    return engine_cls(model_dir, config, tokenizer, model, cache, mode, ctx,
                      engine_cls.eos_from(model_dir, config, tokenizer), engine_cls.defaults_from(model_dir),
                      sparse=runtime)
