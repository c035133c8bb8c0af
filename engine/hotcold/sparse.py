"""The sparse engine: placement applied to a loaded model, and live re-placement.

`load_sparse` loads a model for the `sparse`, `hybrid` and `oracle` modes: dense parts go
where the placement puts them, each layer's FFN is split into hot rows (fast device) and cold
rows (CPU), and `Engine.load` assembles the engine from the parts it returns.
`SparseRuntime.set_budgets` re-solves and moves only the rows and tensors that change tier;
during a generation the move happens at the next token boundary, and the KV cache (the
conversation) is kept. The runtime's jobs live in sparse_tokens, sparse_solve, sparse_moves
and sparse_memory.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

import numpy as np
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import BudgetError, UserError
from engine.hotcold.hybrid_ffn import ColdIds, FfnCounters
from engine.hotcold.hot_q4 import hot_weights
from engine.kernels import host_memory
from engine.loading.loader import compute_dtype, load_transformer
from engine.model.transformer import Transformer
from engine.hotcold.placement import Placement, PlacementProblem
from engine.loading.predictors import PredictorSet
from engine.loading.predictor_import import import_checkpoint_predictors
from engine.hotcold.sparse_memory import MemoryAccounting
from engine.hotcold.sparse_moves import TierMoves, cold_rows_from_dense
from engine.hotcold.sparse_solve import Solving, default_budgets, pick_fast_device, problem_for_model
from engine.hotcold.sparse_tokens import TokenHooks
from engine.loading.weights import WeightSource
from engine.loading import prepared
from engine.loading.sidecar import sidecar_dir

COLD_QUANTS = ("int4", "int8", "fp32")
log = logging.getLogger(__name__)


@dataclass
class SparseParts:
    """What a sparse load hands `Engine.load`: the model, its runtime, and where each layer's
    KV cache lives (device and dtype). The runtime gets the cache once it is made."""
    model: Transformer
    runtime: "SparseRuntime"
    layer_devices: list[torch.device]
    layer_dtypes: list[torch.dtype]


class SparseRuntime(TokenHooks, Solving, TierMoves, MemoryAccounting):
    """The hot/cold split of one loaded model, by job: per-token hooks (sparse_tokens),
    solving (sparse_solve), moving tensors (sparse_moves), memory accounting (sparse_memory)."""

    def __init__(self, engine_lock: threading.RLock, config: ModelConfig, mode: str, fast: torch.device,
                 storage: torch.dtype, predictors: PredictorSet | None, problem: PlacementProblem,
                 cpu_weights: str):
        self.lock = engine_lock
        self.config, self.mode, self.fast, self.storage = config, mode, fast, storage
        self.predictors = predictors
        self.thresholds = list(predictors.thresholds) if predictors else [0.0] * config.num_layers
        self.problem, self.cpu_weights = problem, cpu_weights
        self.counters = FfnCounters()
        self.scoring_mode: str | None = None
        self.plan: Placement | None = None
        self.model: Transformer | None = None
        self.cache = None
        self._pending: Placement | None = None
        self._pending_lock = threading.Lock()
        self.override_masks = None  # benchmarks: callable(layer) -> bool mask [n_ff] replacing the threshold, one call per token
        self.prepared_path: Path | None = None  # the prepared rows file read or written at load
        self.prepared_rows = None  # engine.loading.prepared.PreparedRows when this load mapped one
        # the hot tier's rows: 4-bit (engine.hotcold.hot_q4) or None (the fast tier's dtype)
        self.hot_weights = None if config.is_moe else hot_weights(fast, cpu_weights)

        self.model_dir: Path | None = None
        self.neuron_cache = None  # engine.hotcold.neuron_cache.NeuronCache: cold rows on disk
        self.embed_mapped = False  # the embeddings are a view of the prepared dense file (the disk tier)
        self._disk_mark = (0, 0, 0)  # the cache's hits, misses and bytes read when the generation began

    def close(self) -> None:
        """Release what outlives a dropped engine (Engine.close): threads of subclasses, the
        disk tier's reader."""
        if self.neuron_cache is not None:
            self.neuron_cache.close()

    def reads_from_disk(self) -> bool:
        from engine.loading import prepared

        # once loaded, only where the load has a prepared file to read rows from
        return (self.model_dir is not None and not self.config.is_moe and self.cpu_weights in prepared.FORMATS
                and prepared.enabled() and not prepared.is_bundled(self.model_dir)
                and (self.model is None or self.prepared_path is not None))

    def solve(self, vram: int, ram: int) -> Placement:
        plan = super().solve(vram, ram)
        cache, old = self.neuron_cache, self.plan
        if cache is not None and old is not None and (
                plan.head_on_fast != old.head_on_fast or plan.layer_on_fast != old.layer_on_fast
                or any(not np.array_equal(a, b) for a, b in zip(plan.hot_ids, old.hot_ids))):
            raise BudgetError("this model reads its cold rows from disk: a VRAM budget that moves neurons or "
                              "layers needs a reload")
        return plan

    def apply(self, plan: Placement) -> None:
        if plan.embed_on_disk and not self.embed_mapped and self.model_dir is not None:
            _map_embeddings(self, self.model_dir, self.cpu_weights)  # a lookup table: swapped between tokens
        if self.neuron_cache is None:
            super().apply(plan)
            if plan.disk_neurons:  # a load with every cold row in RAM, moved below them: onto the disk tier
                self.to_disk(plan)
            return
        self.neuron_cache.resize(cache_capacity(plan))  # between tokens: the only change a disk load allows
        self.plan = plan

    def to_disk(self, plan: Placement) -> None:
        """Cold rows in RAM handed to a neuron cache (seeded from the bundles, written from the
        prepared file the first time) and the prepared file: between tokens, as a load below
        the cold rows would have placed them. The rows in RAM (or the prepared file's pages
        they were mapped from) go."""
        from engine.loading import prepared

        had_map = self.prepared_rows is not None
        self.prepared_rows = prepared.PreparedRows(self.prepared_path)  # a fresh map: the old one goes with its rows
        _attach_disk_tier(self, self.model, self.prepared_rows, plan)
        if had_map:  # the rows the in-RAM load read through its map: out of the page cache (charged to a cgroup)
            gc.collect()
            _drop_file_pages(self.prepared_path)

    def begin_generation(self) -> None:
        super().begin_generation()
        if self.neuron_cache is not None:
            c = self.neuron_cache
            self._disk_mark = (c.hits, c.misses, c.reader.bytes_read)

    def disk_fractions(self, tokens: int) -> tuple[float, float]:
        """(cache hit share, disk bytes read per token) of this generation."""
        c = self.neuron_cache
        if c is None:
            return 1.0, 0.0
        hits, misses, read = c.hits - self._disk_mark[0], c.misses - self._disk_mark[1], \
            c.reader.bytes_read - self._disk_mark[2]
        return (hits / (hits + misses) if hits + misses else 1.0), read / max(tokens, 1)


def cache_capacity(plan: Placement) -> int:
    """The neuron cache's slots under a plan: its cache share (every cold neuron when the
    budget holds them all: a disk load keeps its cache, counted as its slots)."""
    if plan.cache_neurons:
        return plan.cache_neurons
    return plan.total_units - sum(len(ids) for ids in plan.hot_ids)


def _attach_disk_tier(runtime: "SparseRuntime", model: Transformer, prepared_rows, plan: Placement) -> None:
    """Cold rows from the prepared file through a neuron cache seeded by the frequencies."""
    from engine.hotcold.neuron_cache import DiskFfn, NeuronCache, open_reader
    from engine.hotcold.placement import cold_frequencies

    cold_ids = [layer.ffn.cold.ids.numpy() for layer in model.layers]
    cache = NeuronCache(prepared_rows.fmt, open_reader(prepared_rows, len(model.layers)), cold_ids,
                        cache_capacity(plan), runtime.config.hidden_size)
    runtime.neuron_cache = cache
    runtime.problem = replace(runtime.problem, cached=True)  # from now on the cold rows are the cache's slots
    cache.seed(cold_frequencies(runtime.problem, plan.hot_ids))
    ffns = [DiskFfn(layer.ffn, cache) for layer in model.layers]
    for layer, ffn, nxt in zip(model.layers, ffns, ffns[1:] + [None]):
        layer.ffn, ffn.next = ffn, nxt
        layer.fused = None  # the fused decode's views of the rows this layer had (rebuilt at the next token)



def _drop_file_pages(path: Path) -> None:
    """A file's pages no mapping holds, dropped from the page cache (where the OS can)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _map_embeddings(runtime: "SparseRuntime", model_dir: Path, cpu_weights: str) -> None:
    """The embeddings as a view of the prepared dense file (a token reads its row from the
    page cache or the disk), where the disk tier keeps them there; `embed_mapped` says it
    worked (else they stay in RAM and are counted there)."""
    model = runtime.model
    dense = runtime.prepared_dense or prepared.PreparedDense.open_if_current(model_dir, cpu_weights)
    if dense is None or not dense.has("embed"):
        return
    if not dense.holds(model.embed):
        embed = dense.matrix("embed", tuple(model.embed.shape))
        if not isinstance(embed, torch.Tensor) or embed.dtype != model.embed.dtype:
            return
        model.embed = embed
    runtime.prepared_dense = dense
    runtime.embed_mapped = True


def _prepared_source(model_dir: Path, config: ModelConfig, cpu_weights: str):
    """(mapped prepared rows, None) when a current prepared file exists; else (None, a
    writer for one) for the int8/int4 formats; (None, None) when preparing is off or the
    model's folder cannot be written (a read-only install)."""
    if cpu_weights not in prepared.FORMATS or not prepared.enabled() or prepared.is_bundled(model_dir):
        return None, None
    rows = prepared.PreparedRows.open_if_current(model_dir, cpu_weights)
    if rows is not None:
        return rows, None
    try:
        writer = prepared.PreparedWriter(model_dir, cpu_weights, prepared.checkpoint_key(model_dir, cpu_weights),
                                         config.intermediate_size, config.hidden_size, config.gated,
                                         config.num_layers)
    except OSError as exc:
        log.warning("not preparing %s: %s", model_dir, exc)
        return None, None
    return None, writer


_MAPPED = "prepared"  # PredictorSet.source of predictors mapped from a prepared file


def _prepared_dense(model_dir: Path, cpu_weights: str):
    """The current prepared dense file (engine.loading.prepared.PreparedDense), or None."""
    if cpu_weights not in prepared.FORMATS or not prepared.enabled() or prepared.is_bundled(model_dir):
        return None
    return prepared.PreparedDense.open_if_current(model_dir, cpu_weights)


def _mapped_predictors(dense_file, model_dir: Path, config: ModelConfig) -> PredictorSet | None:
    """The predictors in the CPU format from the prepared file (their thresholds from the
    predictors file's header), or None when it does not hold them."""
    if dense_file is None or not PredictorSet.exists(model_dir) or not dense_file.has_predictors(config.num_layers):
        return None
    import json

    from safetensors import safe_open

    with safe_open(str(sidecar_dir(model_dir) / "predictors.safetensors"), framework="pt") as handle:
        metadata = handle.metadata() or {}
    thresholds = [float(t) for t in json.loads(metadata.get("thresholds", "[]"))]
    fc1, fc2 = [], []
    for i in range(config.num_layers):
        rank = dense_file.rows(f"predictors.{i}.fc1")
        fc1.append(dense_file.matrix(f"predictors.{i}.fc1", (rank, config.hidden_size), resident=True))
        fc2.append(dense_file.matrix(f"predictors.{i}.fc2", (config.intermediate_size, rank), resident=True))
    if len(thresholds) != config.num_layers:
        thresholds = [thresholds[0] if thresholds else 0.0] * config.num_layers
    predictors = PredictorSet(fc1, fc2, thresholds, _MAPPED)
    predictors.extra = json.loads(metadata.get("extra", "{}"))
    return predictors


def _write_prepared_dense(model_dir: Path, cpu_weights: str, runtime, progress) -> bool:
    """Write the dense prepared file from the model just loaded (its CPU layers, globals
    when the head is on the CPU, predictors); whether it did (a failure only logs)."""
    plan = runtime.plan
    cpu_layers = [i for i, on in enumerate(plan.layer_on_fast) if not on]
    if progress:
        progress(1.0, "writing the prepared layout (first load only)")
    try:
        tensors = prepared.dense_tensors(runtime.model, runtime.predictors, cpu_layers, not plan.head_on_fast)
        prepared.write_tensors(prepared.dense_path(model_dir, cpu_weights), tensors,
                               {"key": prepared.dense_key(model_dir, cpu_weights), "format": cpu_weights})
    except (OSError, ValueError) as exc:
        log.warning("could not write the prepared layout of %s: %s", model_dir, exc)
        return False
    return True


def load_sparse(model_dir: Path, config: ModelConfig, mode: str, ctx: int, vram_budget: int | None,
                ram_budget: int | None, device: str | None, progress, cpu_weights: str = "int8") -> SparseParts:
    """The model of a sparse/hybrid/oracle load with its runtime; `Engine.load` assembles the
    engine (its KV cache goes where `SparseParts.layer_devices` say, then to the runtime).

    A first load that converted every layer on the CPU and wrote both prepared files then maps
    them, as every later load does, and lets its converted copies go: the same rows and bytes,
    but in the page cache, where an unread page costs nothing and the kernel may drop a clean
    one. 8 layers of 7B shapes, int4: 1.8-2.0 GB of anonymous memory kept after the first
    load before, 0.2 GB after (as a later load's), the mapping taking 0.1 s."""
    parts, wrote_all = _load_sparse_once(model_dir, config, mode, ctx, vram_budget, ram_budget, device, progress,
                                         cpu_weights)
    if not wrote_all:
        return parts
    try:
        mapped, _ = _load_sparse_once(model_dir, config, mode, ctx, vram_budget, ram_budget, device, None,
                                      cpu_weights)
    except (KeyError, ValueError, OSError) as exc:  # the file just written does not map: keep the copies
        log.warning("could not map the prepared layout just written for %s: %s", model_dir, exc)
        return parts
    if mapped.runtime.prepared_rows is None or mapped.runtime.prepared_dense is None:
        return parts  # it did not map (the files were replaced meanwhile): keep what this load converted
    parts.runtime.model = None  # the one cycle (model -> layers' FFN contexts -> runtime -> model)
    del parts  # so reference counting frees the copies now: a collection would hold the GIL (a GUI stall)
    host_memory.return_free_heap()
    return mapped


def _load_sparse_once(model_dir: Path, config: ModelConfig, mode: str, ctx: int, vram_budget: int | None,
                      ram_budget: int | None, device: str | None, progress, cpu_weights: str) -> tuple[SparseParts, bool]:
    """`load_sparse`'s load, and whether it wrote both prepared files for a placement all on
    the CPU with its rows in RAM (a load of the files would then map everything)."""
    if cpu_weights not in COLD_QUANTS:
        raise UserError(f"unknown CPU weight format {cpu_weights!r}: choose int4, int8 or fp32")
    if config.mlp_bias:
        raise UserError("sparse modes do not support FFN biases yet; use --mode dense for this model")
    fast = pick_fast_device(device)
    default_vram, default_ram = default_budgets(fast, mode)
    vram = default_vram if vram_budget is None else vram_budget
    ram = default_ram if ram_budget is None else ram_budget
    predictors = None
    import_checkpoint_predictors(model_dir, config)  # TurboSparse: the checkpoint's own, once
    dense_file = _prepared_dense(model_dir, cpu_weights)
    if mode != "oracle" or PredictorSet.exists(model_dir):
        predictors = _mapped_predictors(dense_file, model_dir, config) or PredictorSet.load(
            model_dir, config.num_layers, config.hidden_size, config.intermediate_size)
    storage = WeightSource(model_dir).dtype()
    problem = problem_for_model(model_dir, config, ctx, fast, cpu_weights, predictors, storage)
    runtime = SparseRuntime(threading.RLock(), config, mode, fast, storage, predictors, problem, cpu_weights)
    runtime.model_dir = Path(model_dir)
    plan = runtime.solve(vram, ram)
    on_disk = plan.disk_neurons > 0  # cold rows stay in the prepared file (engine.hotcold.neuron_cache)
    if predictors is not None and predictors.source == _MAPPED and any(plan.layer_on_fast):
        # the fast tier takes the predictors at the checkpoint's precision, not the CPU format's
        predictors = PredictorSet.load(model_dir, config.num_layers, config.hidden_size, config.intermediate_size)
        runtime.predictors = predictors
    runtime.budgets = (vram, ram)
    runtime.plan = plan
    cpu = torch.device("cpu")
    layer_devices = [fast if on else cpu for on in plan.layer_on_fast]
    head_device = fast if plan.head_on_fast else cpu
    prepared_rows, writer = _prepared_source(model_dir, config, cpu_weights)
    runtime.prepared_path = prepared_rows.path if prepared_rows is not None else None
    runtime.prepared_rows = prepared_rows

    def mapped(i: int) -> bool:  # this layer's FFN comes from the prepared file
        return prepared_rows is not None and len(plan.hot_ids[i]) == 0 and prepared_rows.has_layer(i)

    def build_ffn(i: int, dense):
        if dense is None:  # mapped rows: on_disk reads none of them (the cache reads by position)
            return runtime.cold_ffn(i, prepared_rows.layer_rows(i, config.hidden_size))
        ffn = _build_ffn(i, dense)
        if on_disk:  # keep the hot rows and the cold ids; this layer's rows are in the file
            ffn.cold = ColdIds(ffn.cold.ids)
        return ffn

    def _build_ffn(i: int, dense):
        # a checkpoint's own Q4_0 rows (int4 tier, engine.model.q4_ffn): taken as they are
        all_rows = getattr(dense, "q4_rows", None)
        if writer is not None:
            if progress:
                progress(i / config.num_layers, f"preparing layer {i + 1} of {config.num_layers} "
                                                f"({cpu_weights} rows, first load only)")
            if all_rows is None:
                all_rows = cold_rows_from_dense(dense.gate, dense.up, dense.down_t, cpu_weights)
            writer.add_layer(i, all_rows)
        return runtime.split_ffn(i, dense, plan.hot_ids[i], all_rows)

    try:
        model = load_transformer(
            model_dir, config, layer_devices, head_device, ctx, progress, ffn_builder=build_ffn,
            on_layer=lambda i, layer: runtime.convert_layer_dense(layer, plan.layer_on_fast[i]),
            read_ffn=lambda i: not mapped(i), prepared=dense_file,
            from_prepared=lambda i: not plan.layer_on_fast[i], globals_from_prepared=not plan.head_on_fast,
            q4_layers=(lambda i: not plan.layer_on_fast[i]) if cpu_weights == "int4" else None,
            q4_head=cpu_weights == "int4" and not plan.head_on_fast,
        )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        try:
            runtime.prepared_path = writer.finish()
        except (OSError, RuntimeError) as exc:
            writer.abort()
            log.warning("could not write the prepared rows of %s: %s", model_dir, exc)
    for i, on_fast in enumerate(plan.layer_on_fast):
        runtime.place_predictor(i, on_fast)
    runtime.model = model
    if on_disk:
        if prepared_rows is None:
            from engine.loading import prepared

            prepared_rows = runtime.prepared_rows = prepared.PreparedRows(runtime.prepared_path)
        _attach_disk_tier(runtime, model, prepared_rows, plan)
    model.lm_head = runtime._head_weights(plan.head_on_fast)
    runtime.prepared_dense = dense_file
    wrote_dense = False
    if dense_file is None and (writer is not None or prepared_rows is not None):
        wrote_dense = _write_prepared_dense(model_dir, cpu_weights, runtime, progress)
    if plan.embed_on_disk:
        _map_embeddings(runtime, model_dir, cpu_weights)
    all_on_cpu = not any(plan.layer_on_fast) and not plan.head_on_fast and not any(len(h) for h in plan.hot_ids)
    wrote_all = (writer is not None and runtime.prepared_path is not None and wrote_dense and all_on_cpu
                 and not on_disk)
    return SparseParts(model, runtime, layer_devices, [compute_dtype(d, storage) for d in layer_devices]), wrote_all
