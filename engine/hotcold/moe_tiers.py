"""A mixture of experts placed by budget: the most-used experts, and the hot neurons of
others, on the fast device; the rest on the CPU, computed only when the router chooses it.

Placement (engine.placement with `ModelBytes.for_experts`): the unit is one neuron of one
expert (its gate, up and down rows), ranked by `engine.model.moe.placement_frequencies`: the
CPU rows a token would read while it stays cold, from the profile's expert use and the
firing of each expert's neurons (`thermocline profile`). The solver reserves the dense
parts first, then fills the fast device with the top units across all layers, so often
chosen experts go whole and the next ones split: their hot neurons on the fast device,
the rest on the CPU tier (int8 rows with a scale each, 4-bit Q4_0 rows, or fp32).

Decode (one token): the router ran before attention (engine.model), so the layer knows
its k experts before attention starts (`before_attention`: a worker thread reads the
chosen cold experts' gate rows ahead, where that pays; see ColdPrefetcher). Each part of
a chosen expert is computed where it lives, by the CPU kernels (cold; and hot when the
CPU stands in for the fast device) or by torch on the GPU; ReGLU sums over neurons, so
the parts add up to the expert exactly. Inside a chosen expert the kernels compute the
gate rows first and read the up and down rows of the neurons whose relu(gate) is not 0
only: the second level of sparsity, exact. Experts not chosen are never read.

Prefill and scoring (many tokens): each chosen expert once for the tokens that chose it,
with dense matmuls (int8 / 4-bit experts dequantized one at a time).

Re-placement (budget sliders): `set_budgets` re-solves and `_move_neurons` re-splits only
the experts whose hot neurons change, at the next token boundary during a generation.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import BudgetError, UserError
from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_q4, numba_pool, q4_format, q4_rows
from engine.loading.loader import compute_dtype, load_transformer
from engine.cpu_formats import predictor_cpu_format
from engine.model.expert_stack import FORMATS as STACK_FORMATS, ExpertStack
from engine.model.moe import DenseMoe, ExpertPredictors, Routing, experts_by_token, reglu
from engine.hotcold.placement import COLD_INT4, COLD_INT8, INDEX_BYTES
from engine.kernels.quantized import QuantMatrix, matrix_nbytes, quantize_matrix
from engine.hotcold.sparse import SparseParts, SparseRuntime, _map_embeddings, _prepared_dense, _write_prepared_dense
from engine.hotcold.sparse_moves import cold_rows_from_dense
from engine.hotcold.neuron_cache import SlotRows
from engine.hotcold.sparse_solve import default_budgets, pick_fast_device, problem_for_model
from engine.loading.weights import WeightSource

log = logging.getLogger(__name__)


@dataclass
class MoeCounters:
    """Per generation, over decoded tokens: neurons of all experts (considered), neurons
    whose up and down rows were read (fired inside a chosen expert), of those on the fast
    tier; experts chosen, and how many of them the fast tier served (an expert split
    between the tiers counts its share of neurons there); bytes of expert rows read."""
    considered: int = 0
    computed: int = 0
    computed_hot: int = 0
    experts_chosen: int = 0
    experts_hot: float = 0.0
    expert_bytes: int = 0
    prefetched_bytes: int = 0  # cold gate rows read ahead, while attention ran
    prefetch_wait_s: float = 0.0  # time the experts waited for those reads (0: fully overlapped)

    def fractions(self) -> tuple[float, float]:
        """(share of all expert neurons computed, share of chosen experts served by the fast tier)."""
        return (float(self.computed) / self.considered if self.considered else 0.0,
                self.experts_hot / self.experts_chosen if self.experts_chosen else 0.0)


class _ExpertTier:
    """What both tiers share: `rows` maps an expert id to its rows held here (all of the
    expert's neurons, or some: `neuron_ids` maps it to their sorted ids in the expert).
    `epoch` is a new object at every change of them (the fused decode's prepared call
    holds the rows' addresses: it is rebuilt when the epoch it was built at is gone)."""

    rows: dict
    neuron_ids: dict
    epoch: object = None

    def _changed(self) -> None:
        self.epoch = object()

    def __contains__(self, e: int) -> bool:
        return e in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> np.ndarray:
        """Experts with neurons here."""
        return np.array(sorted(self.rows), dtype=np.int64)

    def neurons(self, e: int) -> int:
        return len(self.neuron_ids[e]) if e in self.neuron_ids else 0

    def unit_ids(self, n: int) -> np.ndarray:
        """The placement's units held here (neuron j of expert e is e * n + j), sorted."""
        parts = [e * n + self.neuron_ids[e].numpy() for e in sorted(self.neuron_ids)]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)


class HotExperts(_ExpertTier):
    """Experts' neurons on the fast device: gate, up, down_t [k, d] each in its compute
    dtype. With the CPU standing in for it, fp32 rows the CPU kernels read (second level
    included)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cpu_rows: dict[int, cpu_kernels.CpuFfnRows] = {}
        self.neuron_ids: dict[int, torch.Tensor] = {}

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32

    def add(self, e: int, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> None:
        self._changed()
        self.neuron_ids[e] = ids
        if self.on_cpu:
            rows = cpu_kernels.CpuFfnRows.from_dense(gate, up, down_t, quant="fp32")
            self.cpu_rows[e] = rows
            self.rows[e] = (rows.gate, rows.up, rows.down_t)
        else:
            self.rows[e] = tuple(t.to(self.device, self.dtype).contiguous() for t in (gate, up, down_t))

    def pop(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(neuron ids, gate, up, down_t fp32 on the CPU) of expert e's rows here, removed."""
        self._changed()
        self.cpu_rows.pop(e, None)
        return (self.neuron_ids.pop(e), *(t.to("cpu", torch.float32) for t in self.rows.pop(e)))

    @property
    def nbytes(self) -> int:
        """Rows plus the 8-byte id the placement counts per neuron."""
        return sum(t.numel() * t.element_size() for rows in self.rows.values() for t in rows) \
            + INDEX_BYTES * sum(len(ids) for ids in self.neuron_ids.values())


class ColdExperts(_ExpertTier):
    """Experts' neurons on the CPU tier, in the CPU kernels' storage: int8 rows + scales,
    4-bit rows (ggml's Q4_0 blocks, engine.kernels.cpu_q4), or fp32.

    `stack` (engine.model.expert_stack.ExpertStack, int8/int4 tiers): the layer's experts
    stacked [E, n, d] per matrix where every expert of the layer is cold and whole, and
    `rows[e]` are views of `stack` (a mapped MoE prepared file, or the first load's
    quantized stack until it is written); None otherwise (a split layer, or after a
    re-placement took an expert out)."""

    def __init__(self, quant: str):
        self.quant = quant
        self.rows: dict[int, cpu_kernels.CpuFfnRows | q4_rows.Q4FfnRows] = {}
        self.neuron_ids: dict[int, torch.Tensor] = {}
        self.stack: ExpertStack | None = None

    def add(self, e: int, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> None:
        self.add_rows(e, ids, cold_rows_from_dense(gate, up, down_t, self.quant))

    def add_rows(self, e: int, ids: torch.Tensor, rows) -> None:
        """Rows already in the CPU format (a stack's expert, or a selection of its rows)."""
        self._changed()
        self.neuron_ids[e] = ids
        self.rows[e] = rows

    def take_stack(self, stack: ExpertStack) -> None:
        """Every expert of the layer, whole, as views of `stack`."""
        n = stack.n_ff
        for e in range(stack.num_experts):
            self.add_rows(e, torch.arange(n), stack.expert(e))
        self.stack = stack

    def resident(self, e: int, pred_logits: torch.Tensor | None = None):
        """Expert e's rows for the kernel (held here; the disk tier's reads them first)."""
        return self.rows[e]

    def pop(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        self._changed()
        self.stack = None  # it no longer describes this tier
        rows = self.rows.pop(e)
        g, u, d = rows.dequantized()
        return self.neuron_ids.pop(e), g.clone(), u.clone(), d.clone()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values()) \
            + INDEX_BYTES * sum(len(ids) for ids in self.neuron_ids.values())


def split_expert(e: int, hot_ids: np.ndarray, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor,
                 hot: HotExperts, cold: ColdExperts) -> None:
    """Expert e's fp32 rows [n, d] into the tiers: neurons `hot_ids` (sorted) on the fast
    tier, the rest on the CPU tier."""
    n = gate.shape[0]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.as_tensor(hot_ids, dtype=torch.long)] = True
    for tier, pick in ((hot, mask), (cold, ~mask)):
        ids = torch.nonzero(pick).flatten()
        if len(ids) == n:
            tier.add(e, ids, gate, up, down_t)
        elif len(ids):
            tier.add(e, ids, gate[ids], up[ids], down_t[ids])


def split_stacked(e_count: int, n: int, hot_units: np.ndarray, dense: DenseMoe, stack: ExpertStack,
                  hot: HotExperts, cold: ColdExperts) -> None:
    """A layer's experts into the tiers, the cold rows from `stack` (the layer already in
    the CPU format, rows quantized one by one, so a selection of them is what quantizing
    those neurons alone gives): with no hot unit the cold tier takes the stack itself
    (views); else the fast tier takes the fp32 rows of its neurons from `dense` and the
    cold tier copies of the rest of the stack's."""
    if len(hot_units) == 0:
        cold.take_stack(stack)
        return
    for e in range(e_count):
        ids = hot_units[(hot_units >= e * n) & (hot_units < (e + 1) * n)] - e * n
        mask = torch.zeros(n, dtype=torch.bool)
        mask[torch.as_tensor(ids, dtype=torch.long)] = True
        hot_ids, cold_ids = torch.nonzero(mask).flatten(), torch.nonzero(~mask).flatten()
        if len(hot_ids):
            gate, up, down_t = dense.expert(e)
            whole = len(hot_ids) == n
            hot.add(e, hot_ids, *((gate, up, down_t) if whole else (gate[hot_ids], up[hot_ids], down_t[hot_ids])))
        if len(cold_ids):
            cold.add_rows(e, cold_ids, stack.expert(e).select(cold_ids))


class ColdPrefetcher:
    """One daemon thread that reads rows ahead of the kernels: `start` hands it the chosen
    cold experts before attention, `wait` (before the experts run) returns once it is
    done. The reads are numpy reductions, which release the GIL, so they run beside
    attention's torch ops. Worth it where attention leaves a core idle (a GPU computing
    it, or spare cores); on a CPU busy with attention it competes (bench.moe_vs_llamacpp
    measures both). Its thread lives as long as the engine: `close` (Engine.close, or the
    runtime turning prefetching off) ends it."""

    THREAD_NAME = "moe-prefetch"

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._bytes = 0
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end after the batch in hand (if any); returns at once."""
        self._jobs.put(None)

    def close(self, timeout: float = 5.0) -> None:
        """End the thread once the batch in hand (if any) is read; idempotent."""
        if self._thread.is_alive():
            self.stop()
            self._thread.join(timeout)

    def start(self, rows: list) -> None:
        self._idle.wait()  # one batch at a time (a step's layers run in order)
        self._idle.clear()
        self._jobs.put(rows)

    def wait(self, counters: MoeCounters) -> None:
        if not self._idle.is_set():
            t = time.perf_counter()
            self._idle.wait()
            counters.prefetch_wait_s += time.perf_counter() - t
        counters.prefetched_bytes += self._bytes
        self._bytes = 0

    def _run(self) -> None:
        while True:
            rows = self._jobs.get()
            if rows is None:  # close()
                return
            try:
                for r in rows:
                    self._bytes += _read_through(r.gate)
            finally:
                self._idle.set()


def _read_through(t: torch.Tensor) -> int:
    """Read every byte of a CPU tensor (into the caches); returns the bytes read."""
    a = t.numpy().reshape(-1).view(np.uint8)
    if a.size % 8 == 0:
        a = a.view(np.uint64)
    np.bitwise_xor.reduce(a)
    return t.numel() * t.element_size()


# Up to this many tokens per expert, a prefill computes the expert with the CPU kernel
# (rows read once, quiet neurons skipped); more, with a dense matmul over its dequantized rows.
# 4-bit rows go token by token (no many-token 4-bit row kernel) up to _Q4_TOKENS. 8 layers of
# SmallThinker-4B shapes (32 experts of 768, 4 chosen), TTFT of 16 / 128 / 250-token prompts at
# 8 (the old bound) against no bound: int4 218 -> 107, 1469 -> 634, 2450 -> 1261 ms; int8 191 ->
# 125, 1223 -> 841, 2383 -> 1777 ms (1656 at 128). The dequantized copy lost every time.
_KERNEL_TOKENS = 128
_Q4_TOKENS = 256


def row_bytes(rows) -> int:
    """Bytes of one neuron's row in one matrix (with its scale for int8; whole 18-byte
    blocks for 4-bit rows)."""
    if rows.quant == COLD_INT4:
        return q4_format.row_bytes(rows.dim)
    return rows.dim * rows.up.element_size() + (4 if rows.quant == COLD_INT8 else 0)


def _sparse_ffn(x: torch.Tensor, rows, out_acts: torch.Tensor | None = None, activation: str = "relu",
                pred_logits: torch.Tensor | None = None, row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on one token with the CPU kernel of its row format (relu on the gate:
    the up and down rows of a neuron whose gate is 0 are not read). With `pred_logits`
    (the expert's predictor, fp32 [n]; `row_ids` the expert's neurons these rows hold, None
    for all of them) only the predicted neurons' rows are read at all. `rows` may be the
    disk tier's SlotRows (engine.hotcold.moe_disk): the same kernel over the cache's slots."""
    if isinstance(rows, SlotRows):
        acts = torch.empty(rows.n_neurons, dtype=torch.float32) if out_acts is None else out_acts
        return rows.ffn(x, acts, activation, pred_logits, ExpertPredictors.THRESHOLD)
    q4 = rows.quant == COLD_INT4
    if pred_logits is None:
        kernel = cpu_q4.sparse_ffn if q4 else cpu_kernels.sparse_ffn
        return kernel(x, rows, None, activation, 0.0, out_acts=out_acts)
    kernel = cpu_q4.sparse_ffn_predicted if q4 else cpu_kernels.sparse_ffn_predicted
    return kernel(x, rows, pred_logits, ExpertPredictors.THRESHOLD, activation, 0.0, out_acts=out_acts,
                  row_ids=row_ids)


class TieredMoe:
    """One layer's experts split between the fast tier and the CPU tier; `activation` relu
    (ReGLU) or drelu; `predictors` (ExpertPredictors, TurboSparse-Mixtral) in the layer's
    tier, or None: then every neuron of a chosen expert is considered."""

    def __init__(self, layer: int, num_experts: int, n_ff: int, hot: HotExperts, cold: ColdExperts, runtime,
                 activation: str = "relu", predictors: ExpertPredictors | None = None):
        self.layer, self.num_experts, self.n_ff = layer, num_experts, n_ff
        self.hot, self.cold, self.runtime = hot, cold, runtime
        self.activation, self.predictors = activation, predictors

    @property
    def nbytes(self) -> int:
        return self.hot.nbytes + self.cold.nbytes

    @property
    def predictor_nbytes(self) -> int:
        """The experts' predictors: a dense part of the layer, in its tier."""
        return self.predictors.nbytes if self.predictors is not None else 0

    def _predicting(self) -> bool:
        """Whether the predictors choose the neurons now (not in the oracle mode, which
        computes the true active set)."""
        runtime = self.runtime
        return self.predictors is not None and (runtime.scoring_mode or runtime.mode) != "oracle"

    def _row_ids(self, tier: _ExpertTier, e: int) -> torch.Tensor | None:
        """Expert e's neuron ids the tier's rows hold, or None when it holds all of them."""
        ids = tier.neuron_ids[e]
        return None if len(ids) == self.n_ff else ids

    def before_attention(self, routing: Routing) -> None:
        """Called by the model as soon as the router has chosen, before attention runs.
        In a decode step, when the runtime prefetches, a worker thread starts reading the
        chosen cold experts' gate rows (the rows a chosen expert reads whatever fires)
        into the CPU's caches while attention runs. The experts' input is the
        post-attention state, so no expert arithmetic can start before attention; the
        reads can."""
        prefetcher = self.runtime.prefetcher
        if prefetcher is None or routing.experts.shape[0] != 1:
            return
        rows = [self.cold.rows[e] for e in routing.experts[0].tolist() if e in self.cold.rows]  # none on disk
        if rows:
            prefetcher.start(rows)

    # ------------------------------------------------------------------ decode
    def __call__(self, x: torch.Tensor, routing: Routing, layer: int, observer=None) -> torch.Tensor:
        if x.shape[0] > 1 or observer is not None:
            return self._batched(x, routing, observer)
        counters = self.runtime.counters
        experts = routing.experts[0].tolist()
        weights = routing.weights[0].to("cpu", torch.float32).tolist()
        hot, cold = self.hot, self.cold
        y_gpu, gpu_fired = None, 0
        x_cpu = x[0].to("cpu", torch.float32)
        y_cpu = torch.zeros(x.shape[-1], dtype=torch.float32)
        # the chosen experts' predictor logits, fp32 [n] each, on the layer's device
        logits = {e: self.predictors.logits(e, x)[0] for e in experts} if self._predicting() else {}
        if logits:
            counters.expert_bytes += sum(matrix_nbytes(m[e]) for e in experts
                                         for m in (self.predictors.fc1, self.predictors.fc2))
        # GPU parts first: their kernels are queued, then the CPU computes the rest.
        for e, w in zip(experts, weights):
            if e in hot and not hot.on_cpu:
                gate, up, down_t = hot.rows[e]
                xe = x[0].to(gate.dtype)
                up_x = up @ xe
                act = F.relu(gate @ xe) * (F.relu(up_x) if self.activation == "drelu" else up_x)
                if e in logits:
                    chosen = logits[e].to(act.device)[hot.neuron_ids[e].to(act.device)] >= ExpertPredictors.THRESHOLD
                    act = act * chosen.to(act.dtype)
                y = (act @ down_t) * w
                y_gpu = y if y_gpu is None else y_gpu + y
                gpu_fired = gpu_fired + (act != 0).sum()  # no host sync
                counters.expert_bytes += 3 * gate.numel() * gate.element_size()
        cpu_fired = cpu_hot_fired = 0
        if self.runtime.prefetcher is not None:  # reads started before attention end first
            self.runtime.prefetcher.wait(counters)
        for e, w in zip(experts, weights):
            parts = [(cold.resident(e, logits.get(e)), False)] if e in cold else []
            if e in hot and hot.on_cpu:
                parts.append((hot.cpu_rows[e], True))
            for rows, is_hot in parts:
                acts = torch.empty(rows.n_neurons, dtype=torch.float32)
                ids = self._row_ids(hot if is_hot else cold, e)
                pred = logits[e].to("cpu") if e in logits else None
                y_cpu += _sparse_ffn(x_cpu, rows, acts, self.activation, pred, ids) * w
                fired = int(torch.count_nonzero(acts))
                cpu_fired += fired
                cpu_hot_fired += fired if is_hot else 0
                # the gate rows of every (predicted) neuron; up and down rows of those that fired only
                selected = rows.n_neurons if pred is None else int(
                    torch.count_nonzero((pred if ids is None else pred[ids]) >= ExpertPredictors.THRESHOLD))
                counters.expert_bytes += (selected + 2 * fired) * row_bytes(rows)
        counters.considered += self.num_experts * self.n_ff
        counters.computed = counters.computed + gpu_fired + cpu_fired
        counters.computed_hot = counters.computed_hot + gpu_fired + cpu_hot_fired
        counters.experts_chosen += len(experts)
        counters.experts_hot += sum(hot.neurons(e) for e in experts) / self.n_ff
        if y_gpu is None:
            return y_cpu.to(x.device, x.dtype)[None]
        return (y_gpu.float() + y_cpu.to(y_gpu.device)).to(x.dtype)[None]

    def count_fused(self, experts: list[int], stats: np.ndarray, row_bytes: tuple[int, int]) -> None:
        """The counters of one decode step the fused call computed (engine.runtime.fused_decode),
        as `__call__` counts its own: `stats` int64 [k, 2 tiers (cold, hot), (rows selected, fired)],
        `row_bytes` one neuron's row in one matrix per tier."""
        counters = self.runtime.counters
        if self._predicting():
            counters.expert_bytes += sum(matrix_nbytes(m[e]) for e in experts
                                         for m in (self.predictors.fc1, self.predictors.fc2))
        fired = int(stats[:, :, 1].sum())
        counters.expert_bytes += int(sum((stats[:, t, 0] + 2 * stats[:, t, 1]).sum() * row_bytes[t] for t in (0, 1)))
        counters.considered += self.num_experts * self.n_ff
        counters.computed = counters.computed + fired
        counters.computed_hot = counters.computed_hot + int(stats[:, 1, 1].sum())
        counters.experts_chosen += len(experts)
        counters.experts_hot += sum(self.hot.neurons(e) for e in experts) / self.n_ff

    # ------------------------------------------------------------- many tokens
    def _part(self, xs: torch.Tensor, e: int, on_hot: bool, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Expert e's neurons in one tier on tokens xs [t, d] -> fp32 [t, d] on xs' device.
        The expert sums over neurons, so the tiers' parts add up to the whole expert.
        `logits` fp32 [t, n]: the expert's predictor's, which choose the neurons."""
        tier = self.hot if on_hot else self.cold
        ids = self._row_ids(tier, e)
        part_logits = None if logits is None else (logits if ids is None else logits[:, ids.to(logits.device)])
        mask = None if part_logits is None else part_logits >= ExpertPredictors.THRESHOLD
        if on_hot and not self.hot.on_cpu:
            gate, up, down_t = self.hot.rows[e]
            return reglu(xs.to(gate.device, gate.dtype), gate, up, down_t, self.activation,
                         None if mask is None else mask.to(gate.device)).float().to(xs.device)
        rows = self.hot.cpu_rows[e] if on_hot else self.cold.resident(e, logits)
        xc = xs.to("cpu", torch.float32)
        on_disk = isinstance(rows, SlotRows)  # the cache's slots: the decode's kernel, token by token
        if on_disk or (rows.quant == COLD_INT4 and len(xs) <= _Q4_TOKENS) or (
                len(xs) <= _KERNEL_TOKENS and logits is not None):
            # no batched 4-bit or predicted kernel: token by token (4-bit rows in one call)
            y = None if on_disk or rows.quant != COLD_INT4 else cpu_q4.sparse_ffn_each(
                xc, rows, self.activation, None if logits is None else logits.to("cpu"), ExpertPredictors.THRESHOLD,
                ids)
            if y is None:
                y = torch.stack([_sparse_ffn(xc[t], rows, None, self.activation,
                                             None if logits is None else logits[t].to("cpu"), ids)
                                 for t in range(xc.shape[0])])
        elif len(xs) <= _KERNEL_TOKENS:
            # few tokens chose this expert: the CPU kernel reads each row once for all of
            # them (and skips quiet neurons' rows), no dequantized copy of the expert
            y = cpu_kernels.sparse_ffn_batch(xc.contiguous(), rows, None, self.activation)
        else:
            y = reglu(xc, *rows.dequantized(), self.activation, None if mask is None else mask.to("cpu"))
        return y.to(xs.device)

    def _batched(self, x: torch.Tensor, routing: Routing, observer) -> torch.Tensor:
        if observer is not None:
            observer(self.layer, routing.inputs, routing.scattered(self.num_experts))
        elif self.runtime.prompt_kernel is not None:  # the engine's compiled call, where it reads these experts
            y = self.runtime.prompt_kernel(self, x, routing)
            if y is not None:
                return y.to(x.dtype)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        predicting = self._predicting()
        for e, tokens, weights in experts_by_token(routing):
            # an expert chosen by few tokens is a small piece of work: on one thread (_one_thread)
            with _one_thread() if len(tokens) <= _KERNEL_TOKENS else contextlib.nullcontext():
                xs = x[tokens.to(x.device)]
                logits = self.predictors.logits(e, xs) if predicting else None
                y = sum(self._part(xs, e, on_hot, logits) for on_hot, tier in ((True, self.hot), (False, self.cold))
                        if e in tier)
                out.index_add_(0, tokens.to(x.device), y * weights.to(x.device)[:, None])
        return out.to(x.dtype)


@contextlib.contextmanager
def _one_thread():
    """torch and the numba kernels on one thread for one expert of a many-token MoE step that
    few tokens chose (a prompt of 16 tokens gives about 2 per expert): pieces too small to
    split, which split across two threads wait for the other thread's turn on a busy host.
    8 layers of SmallThinker-4B shapes, a 16-token prompt, in one process, alternating: int4
    at load 8-10, TTFT 3.4-23 s on two threads, 1.0-1.6 s with the whole MoE step on one;
    int8 at load 5 with the pieces of up to _KERNEL_TOKENS tokens on one (this), 1.2-1.8 s
    against 1.1-3.8 s: the same median, a shorter tail. Experts that many tokens chose
    (dense matmuls, which threads do speed up) keep every thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with numba_pool.running_threads(1):
            yield
    finally:
        torch.set_num_threads(before)


class MoeRuntime(SparseRuntime):
    """SparseRuntime with experts as the placed unit; the router replaces the predictors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counters = MoeCounters()
        self.prepared_experts = None  # engine.loading.prepared_moe.PreparedExperts: mapped or written at load
        self.prefetcher: ColdPrefetcher | None = None
        # A prompt's experts in one compiled call: (TieredMoe, x [T, d], routing) -> fp32 [T, d] or
        # None; set by the engine (engine.runtime.fused_decode.moe_prompt)
        self.prompt_kernel = None
        self._prefetch_finalizer: weakref.finalize | None = None
        # Read the chosen cold experts ahead while attention runs: by default where a GPU
        # computes attention (the CPU idles then); THERMOCLINE_MOE_PREFETCH=1/0 forces it.
        forced = os.environ.get("THERMOCLINE_MOE_PREFETCH")
        self.set_prefetch(self.fast.type == "cuda" if forced is None else forced == "1")

    def set_prefetch(self, on: bool) -> None:
        if on:
            if self.prefetcher is None:
                self.prefetcher = ColdPrefetcher()
                # An engine dropped without close() still ends the thread when collected; one
                # finalizer per prefetcher, detached when it is turned off.
                self._prefetch_finalizer = weakref.finalize(self, self.prefetcher.stop)
        elif self.prefetcher is not None:
            if self._prefetch_finalizer is not None:
                self._prefetch_finalizer.detach()
                self._prefetch_finalizer = None
            self.prefetcher.close()
            self.prefetcher = None

    def close(self) -> None:
        """Stop the prefetch thread (the engine is closing)."""
        self.set_prefetch(False)
        super().close()

    def reads_from_disk(self) -> bool:
        """Whether this load can keep its experts' cold rows on disk: int8/int4 experts with a
        MoE prepared file (once loaded, one it mapped or wrote)."""
        from engine.loading import prepared

        return (self.model_dir is not None and self.cpu_weights in prepared.FORMATS and prepared.enabled()
                and not prepared.is_bundled(self.model_dir)
                and (self.model is None or self.prepared_experts is not None))

    def to_disk(self, plan) -> None:
        """Cold experts onto the disk tier (at load, or a slider move below them between
        tokens): the neuron cache over (layer, expert) groups (engine.hotcold.moe_disk)."""
        from engine.hotcold import moe_disk

        from engine.hotcold.sparse import _drop_file_pages
        from engine.loading.prepared_moe import PreparedExperts

        if self.prepared_experts is None:
            raise BudgetError("the experts' prepared file could not be written: this RAM budget needs it; "
                              "raise the RAM budget to hold every expert")
        path = self.prepared_experts.path
        self.prepared_experts = PreparedExperts(path)  # a fresh map: the old one goes with the cold tiers' views
        moe_disk.attach(self, self.model, self.prepared_experts, plan)
        gc.collect()
        _drop_file_pages(path)  # the pages an in-RAM run read through the old map (charged to a cgroup)

    def begin_generation(self) -> None:
        self.counters = MoeCounters()
        self.at_token_boundary()

    @contextlib.contextmanager
    def scoring(self, mode: str):
        if mode not in ("sparse", "hybrid", "oracle"):
            raise UserError(f"unknown scoring mode {mode}")
        self.scoring_mode = mode  # the router is exact: every mode computes the same experts
        try:
            yield
        finally:
            self.scoring_mode = None

    def split_experts(self, layer: int, dense: DenseMoe, hot_units: np.ndarray,
                      stack: ExpertStack | None = None) -> TieredMoe:
        """Split a freshly loaded fp32 CPU layer of experts into the two tiers: the
        placement's units `hot_units` (neuron j of expert e is e * n + j) on the fast tier.
        `stack`: the layer's experts already in the CPU format (int8/int4 tiers), which the
        cold rows come from (see split_stacked)."""
        hot = HotExperts(*self._where(True))
        cold = ColdExperts(self.cpu_weights)
        n = dense.n_ff
        hot_units = np.asarray(hot_units, dtype=np.int64)
        if stack is not None:
            split_stacked(dense.num_experts, n, hot_units, dense, stack, hot, cold)
        else:
            for e in range(dense.num_experts):
                ids = hot_units[(hot_units >= e * n) & (hot_units < (e + 1) * n)] - e * n
                split_expert(e, ids, *dense.expert(e), hot, cold)
        predictors = None
        if dense.predictors is not None:
            predictors = self.place_expert_predictors(dense.predictors, self.plan.layer_on_fast[layer])
        return TieredMoe(layer, dense.num_experts, n, hot, cold, self, dense.activation, predictors)

    def mapped_experts(self, layer: int, stack: ExpertStack, predictors: ExpertPredictors | None) -> TieredMoe:
        """A layer whose experts all sit on the CPU tier, from the MoE prepared file: the
        cold experts are views of the mapped stack, the predictors (in the CPU tier's format
        already) views of the map; nothing is converted."""
        hot = HotExperts(*self._where(True))
        cold = ColdExperts(self.cpu_weights)
        cold.take_stack(stack)
        return TieredMoe(layer, stack.num_experts, stack.n_ff, hot, cold, self, self.config.activation, predictors)

    def place_expert_predictors(self, predictors: ExpertPredictors, on_fast: bool) -> ExpertPredictors:
        """A layer's expert predictors in its tier's storage: the fast tier's dtype, or on
        the CPU tier fp32, or int8 rows on an int8 or int4 tier (predictor_cpu_format)."""
        if not on_fast and self.cpu_weights != "fp32":
            fmt = predictor_cpu_format(self.cpu_weights)
            return predictors.placed(lambda w: quantize_matrix(w, fmt))
        device, dtype = self._where(on_fast)
        return predictors.placed(lambda w: w.to_dense(device, dtype) if isinstance(w, QuantMatrix) else w.to(device, dtype))

    def place_predictor(self, i: int, on_fast: bool) -> None:
        """Layer i's predictors follow it between the tiers (the experts' own, if any)."""
        super().place_predictor(i, on_fast)
        ffn = self.model.layers[i].ffn if self.model is not None else None
        if isinstance(ffn, TieredMoe) and ffn.predictors is not None:
            ffn.predictors = self.place_expert_predictors(ffn.predictors, on_fast)

    def _head_weights(self, on_fast: bool):
        """A tied head on an int8 or 4-bit CPU tier is a copy of the embeddings in that format
        (counted by the placement, ModelBytes.int8_head_copy): it is most of a token's bytes
        otherwise."""
        if not on_fast and self.config.tie_word_embeddings and self.cpu_weights in (COLD_INT8, COLD_INT4):
            head = self.model.lm_head
            if isinstance(head, QuantMatrix):  # the copy already (mapped from the dense prepared file)
                return quantize_matrix(head, self.cpu_weights)
            return quantize_matrix(self.model.embed, self.cpu_weights)
        return super()._head_weights(on_fast)

    def convert_layer_dense(self, layer, on_fast: bool) -> None:
        super().convert_layer_dense(layer, on_fast)
        layer.router = self._tier_matrix(layer.router, on_fast)

    def _move_neurons(self, ffn: TieredMoe, new_hot: np.ndarray) -> None:
        """Re-split only the experts whose hot neurons change: the expert's rows are put
        back together from both tiers (fp32) and split again."""
        n, d = ffn.n_ff, self.config.hidden_size
        new_hot = np.asarray(new_hot, dtype=np.int64)
        for e in range(ffn.num_experts):
            ids = new_hot[(new_hot >= e * n) & (new_hot < (e + 1) * n)] - e * n
            old = ffn.hot.neuron_ids[e].numpy() if e in ffn.hot else np.empty(0, dtype=np.int64)
            if np.array_equal(ids, old):
                continue
            whole = [torch.empty(n, d, dtype=torch.float32) for _ in range(3)]
            for tier in (ffn.hot, ffn.cold):
                if e in tier:
                    rows_ids, *parts = tier.pop(e)
                    for dst, src in zip(whole, parts):
                        dst[rows_ids] = src
            split_expert(e, ids, *whole, ffn.hot, ffn.cold)


def load_moe(model_dir, config, mode: str, ctx: int, vram_budget: int | None, ram_budget: int | None,
             device: str | None, progress, cpu_weights: str = "int8") -> SparseParts:
    """`engine.hotcold.sparse.load_sparse` for a mixture of experts: the parts `Engine.load`
    assembles. With an int8/int4 CPU tier the first load writes the experts in that format
    (engine.loading.prepared_moe) and the rest of the CPU tier (the dense prepared file);
    later loads map both: a layer whose experts all sit on the CPU reads nothing from the
    checkpoint, converts nothing, and its cold experts are views of the map."""
    fast = pick_fast_device(device)
    default_vram, default_ram = default_budgets(fast, mode)
    vram = default_vram if vram_budget is None else vram_budget
    ram = default_ram if ram_budget is None else ram_budget
    storage = WeightSource(model_dir).dtype()
    problem = problem_for_model(model_dir, config, ctx, fast, cpu_weights, None, storage)
    runtime = MoeRuntime(threading.RLock(), config, mode, fast, storage, None, problem, cpu_weights)
    runtime.model_dir = Path(model_dir)
    plan = runtime.solve(vram, ram)
    runtime.budgets = (vram, ram)
    runtime.plan = plan
    cpu = torch.device("cpu")
    layer_devices = [fast if on else cpu for on in plan.layer_on_fast]
    head_device = fast if plan.head_on_fast else cpu
    dense_file = _prepared_dense(model_dir, cpu_weights)
    ranks = _predictor_ranks(model_dir, config)
    experts_file, writer = _prepared_experts(model_dir, config, cpu_weights, ranks)
    runtime.prepared_experts = experts_file

    def mapped(i: int) -> bool:
        # this layer's experts come from the MoE prepared file: all of them cold, and their
        # predictors (if any) in the CPU tier (on the fast tier they keep the checkpoint's precision)
        return experts_file is not None and len(plan.hot_ids[i]) == 0 and not (plan.layer_on_fast[i] and ranks)

    def build_ffn(i: int, dense: DenseMoe | None) -> TieredMoe:
        if dense is None:
            return runtime.mapped_experts(i, experts_file.stack(i, config.hidden_size), experts_file.predictors(i))
        if cpu_weights not in STACK_FORMATS:
            return runtime.split_experts(i, dense, plan.hot_ids[i])
        if writer is not None and progress:
            progress(i / config.num_layers, f"preparing layer {i + 1} of {config.num_layers} "
                                            f"({cpu_weights} experts, first load only)")
        stack = ExpertStack.quantize(dense.gate, dense.up, dense.down_t, cpu_weights)
        ffn = runtime.split_experts(i, dense, plan.hot_ids[i], stack)
        if writer is not None:
            predictors = ffn.predictors if ffn.predictors is not None and not plan.layer_on_fast[i] else (
                None if dense.predictors is None else runtime.place_expert_predictors(dense.predictors, False))
            writer.add_layer(i, stack, predictors)
        return ffn

    try:
        model = load_transformer(
            model_dir, config, layer_devices, head_device, ctx, progress, ffn_builder=build_ffn,
            on_layer=lambda i, layer: runtime.convert_layer_dense(layer, plan.layer_on_fast[i]),
            read_ffn=lambda i: not mapped(i), prepared=dense_file,
            from_prepared=lambda i: not plan.layer_on_fast[i], globals_from_prepared=not plan.head_on_fast,
        )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    runtime.model = model
    model.lm_head = runtime._head_weights(plan.head_on_fast)
    if writer is not None:
        try:
            runtime.prepared_experts = _take_written(writer.finish(), model, config)
        except (OSError, RuntimeError, ValueError) as exc:
            writer.abort()
            log.warning("could not write the prepared experts of %s: %s", model_dir, exc)
    runtime.prepared_dense = dense_file
    if dense_file is None and runtime.prepared_experts is not None:
        _write_prepared_dense(model_dir, cpu_weights, runtime, progress)
    if plan.disk_neurons:  # the experts' cold rows beyond the cache stay in the file (engine.hotcold.moe_disk)
        runtime.to_disk(plan)
    if plan.embed_on_disk:
        _map_embeddings(runtime, Path(model_dir), cpu_weights)
    return SparseParts(model, runtime, layer_devices, [compute_dtype(d, storage) for d in layer_devices])


def _prepared_experts(model_dir, config, cpu_weights: str, ranks: list[int] | None):
    """(the mapped MoE prepared file, None) when a current one exists; else (None, a writer
    for one) for the int8/int4 formats; (None, None) when preparing is off or the folder
    cannot be written."""
    from engine.loading import prepared, prepared_moe

    if cpu_weights not in prepared.FORMATS or not prepared.enabled() or prepared.is_bundled(model_dir):
        return None, None
    experts = prepared_moe.PreparedExperts.open_if_current(model_dir, cpu_weights, config, ranks)
    if experts is not None:
        return experts, None
    try:
        return None, prepared_moe.MoeWriter(model_dir, cpu_weights, config, ranks)
    except OSError as exc:
        log.warning("not preparing the experts of %s: %s", model_dir, exc)
        return None, None


def _predictor_ranks(model_dir, config) -> list[int] | None:
    """Each layer's expert predictor rank from the checkpoint's shapes (TurboSparse-Mixtral),
    or None where the experts carry none."""
    from engine.arch import arch_module

    ranks = getattr(arch_module(config.arch), "predictor_ranks", None)
    return ranks(WeightSource(model_dir), config) if ranks is not None else None


def _take_written(path, model, config):
    """The file just written, mapped; layers whose cold tier is a whole stack take its views
    in place of the load's own quantized copy (freed), so a first load ends with the layout
    of every later one."""
    from engine.loading import prepared_moe

    experts = prepared_moe.PreparedExperts(path)
    for i, layer in enumerate(model.layers):
        cold = layer.ffn.cold
        if cold.stack is None:
            continue
        cold.take_stack(experts.stack(i, config.hidden_size))
        if layer.ffn.predictors is not None and not isinstance(layer.ffn.predictors.fc1[0], torch.Tensor):
            layer.ffn.predictors = experts.predictors(i)
    return experts
