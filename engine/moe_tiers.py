"""A mixture of experts placed by budget: hot experts on the fast device, cold experts on
the CPU, computed only when the router chooses them.

Placement (engine.placement with `ModelBytes.for_experts`): the unit is a whole expert,
ranked by how often profiling saw the router choose it (`thermocline profile` counts
expert use through the FFN observer). The solver reserves the dense parts first, then
fills the fast device with the most-chosen experts across all layers; every other expert
stays on the CPU tier (int8 rows with a scale each, or fp32).

Decode (one token): the router ran before attention (engine.model), so the layer knows
its k experts before attention starts. Each chosen expert is computed where it lives, by
the CPU kernels (cold; and hot when the CPU stands in for the fast device) or by torch on
the GPU. Inside a chosen expert the kernels compute the gate rows first and read the up
and down rows of the neurons whose relu(gate) is not 0 only: the second level of sparsity,
exact. Experts not chosen are never read.

Prefill and scoring (many tokens): each chosen expert once for the tokens that chose it,
with dense matmuls (int8 experts dequantized one at a time).

Re-placement (budget sliders): `set_budgets` re-solves and `_move_neurons` moves only the
experts whose tier changes, at the next token boundary during a generation.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UserError
from .kernels import cpu as cpu_kernels
from .loader import compute_dtype, load_transformer
from .moe import DenseMoe, Routing, experts_by_token, reglu
from .placement import COLD_INT8, INDEX_BYTES
from .quantized import Int8Matrix
from .sparse import SparseParts, SparseRuntime, default_budgets, pick_fast_device, problem_for_model
from .weights import WeightSource


@dataclass
class MoeCounters:
    """Per generation, over decoded tokens: neurons of all experts (considered), neurons
    whose up and down rows were read (fired inside a chosen expert), of those on the fast
    tier; experts chosen, of those on the fast tier; bytes of expert rows read."""
    considered: int = 0
    computed: int = 0
    computed_hot: int = 0
    experts_chosen: int = 0
    experts_hot: int = 0
    expert_bytes: int = 0

    def fractions(self) -> tuple[float, float]:
        """(share of all expert neurons computed, share of chosen experts served by the fast tier)."""
        return (float(self.computed) / self.considered if self.considered else 0.0,
                self.experts_hot / self.experts_chosen if self.experts_chosen else 0.0)


class _ExpertTier:
    """What both tiers share: `rows` maps an expert id to its stored rows."""

    rows: dict

    def __contains__(self, e: int) -> bool:
        return e in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> np.ndarray:
        return np.array(sorted(self.rows), dtype=np.int64)


class HotExperts(_ExpertTier):
    """Experts on the fast device: gate, up, down_t [n, d] each in its compute dtype. With
    the CPU standing in for it, fp32 rows the CPU kernels read (second level included)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cpu_rows: dict[int, cpu_kernels.CpuFfnRows] = {}

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32

    def add(self, e: int, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> None:
        if self.on_cpu:
            rows = cpu_kernels.CpuFfnRows.from_dense(gate, up, down_t, quant="fp32")
            self.cpu_rows[e] = rows
            self.rows[e] = (rows.gate, rows.up, rows.down_t)
        else:
            self.rows[e] = tuple(t.to(self.device, self.dtype).contiguous() for t in (gate, up, down_t))

    def pop(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.cpu_rows.pop(e, None)
        return tuple(t.to("cpu", torch.float32) for t in self.rows.pop(e))

    @property
    def nbytes(self) -> int:
        """Rows plus the 8-byte id the placement counts per expert."""
        return sum(t.numel() * t.element_size() for rows in self.rows.values() for t in rows) \
            + INDEX_BYTES * len(self.rows)

    def fp32(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rows[e]


class ColdExperts(_ExpertTier):
    """Experts on the CPU tier, in the CPU kernels' storage (int8 rows + scales, or fp32)."""

    def __init__(self, quant: str):
        self.quant = quant
        self.rows: dict[int, cpu_kernels.CpuFfnRows] = {}

    def add(self, e: int, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> None:
        self.rows[e] = cpu_kernels.CpuFfnRows.from_dense(gate, up, down_t, quant=self.quant)

    def pop(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.rows.pop(e)
        g, u, d = rows.dequantized()
        return g.clone(), u.clone(), d.clone()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values()) + INDEX_BYTES * len(self.rows)


# Up to this many tokens per expert, a prefill computes the expert with the CPU kernel
# (rows read once, quiet neurons skipped); more, with a dense matmul over its rows.
_KERNEL_TOKENS = 8


def _row_bytes(rows: cpu_kernels.CpuFfnRows) -> int:
    """Bytes of one neuron's row in one matrix (with its scale for int8)."""
    return rows.dim * rows.up.element_size() + (4 if rows.quant == COLD_INT8 else 0)


class TieredMoe:
    """One layer's experts split between the fast tier and the CPU tier."""

    def __init__(self, layer: int, num_experts: int, n_ff: int, hot: HotExperts, cold: ColdExperts, runtime):
        self.layer, self.num_experts, self.n_ff = layer, num_experts, n_ff
        self.hot, self.cold, self.runtime = hot, cold, runtime

    @property
    def nbytes(self) -> int:
        return self.hot.nbytes + self.cold.nbytes

    def before_attention(self, routing: Routing) -> None:
        """Called by the model as soon as the router has chosen, before attention runs.
        Every expert is in memory today, so there is nothing to wait for. Experts beyond
        RAM (read from disk, a later step) start loading here: the chosen cold experts
        are `[e for e in routing.experts[0].tolist() if e in self.cold]`, and attention
        gives their reads the time of one attention block."""

    # ------------------------------------------------------------------ decode
    def __call__(self, x: torch.Tensor, routing: Routing, layer: int, observer=None) -> torch.Tensor:
        if x.shape[0] > 1 or observer is not None:
            return self._batched(x, routing, observer)
        counters = self.runtime.counters
        experts = routing.experts[0].tolist()
        weights = routing.weights[0].to("cpu", torch.float32).tolist()
        y_gpu, gpu_fired = None, 0
        x_cpu = x[0].to("cpu", torch.float32)
        y_cpu = torch.zeros(x.shape[-1], dtype=torch.float32)
        # GPU experts first: their kernels are queued, then the CPU computes the others.
        for e, w in zip(experts, weights):
            if e in self.hot and not self.hot.on_cpu:
                gate, up, down_t = self.hot.rows[e]
                xe = x[0].to(gate.dtype)
                act = F.relu(gate @ xe) * (up @ xe)
                y = (act @ down_t) * w
                y_gpu = y if y_gpu is None else y_gpu + y
                gpu_fired = gpu_fired + (act != 0).sum()  # no host sync
                counters.expert_bytes += 3 * gate.numel() * gate.element_size()
        acts = torch.empty(self.n_ff, dtype=torch.float32)
        cpu_fired = cpu_hot_fired = 0
        for e, w in zip(experts, weights):
            if e in self.hot and not self.hot.on_cpu:
                continue
            rows = self.hot.cpu_rows[e] if e in self.hot else self.cold.rows[e]
            y_cpu += cpu_kernels.sparse_ffn(x_cpu, rows, None, "relu", 0.0, out_acts=acts) * w
            n = int(torch.count_nonzero(acts))
            cpu_fired += n
            cpu_hot_fired += n if e in self.hot else 0
            # every gate row; up and down rows of the neurons that fired only
            counters.expert_bytes += (self.n_ff + 2 * n) * _row_bytes(rows)
        counters.considered += self.num_experts * self.n_ff
        counters.computed = counters.computed + gpu_fired + cpu_fired
        counters.computed_hot = counters.computed_hot + gpu_fired + cpu_hot_fired
        counters.experts_chosen += len(experts)
        counters.experts_hot += sum(1 for e in experts if e in self.hot)
        if y_gpu is None:
            return y_cpu.to(x.device, x.dtype)[None]
        return (y_gpu.float() + y_cpu.to(y_gpu.device)).to(x.dtype)[None]

    # ------------------------------------------------------------- many tokens
    def _expert_rows(self, e: int, device: torch.device, dtype: torch.dtype):
        if e in self.hot:
            return tuple(t.to(device, dtype) for t in self.hot.rows[e])
        return tuple(t.to(device, dtype) for t in self.cold.rows[e].dequantized())

    def _batched(self, x: torch.Tensor, routing: Routing, observer) -> torch.Tensor:
        if observer is not None:
            observer(self.layer, routing.inputs, routing.scattered(self.num_experts))
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e, tokens, weights in experts_by_token(routing):
            if e in self.hot and not self.hot.on_cpu:
                device, dtype = self.hot.device, self.hot.dtype
            else:
                device, dtype = torch.device("cpu"), torch.float32
            xs = x[tokens.to(x.device)].to(device, dtype)
            if device.type == "cpu" and len(tokens) <= _KERNEL_TOKENS:
                # few tokens chose this expert: the CPU kernel reads each row once for all of
                # them (and skips quiet neurons' rows), no dequantized copy of the expert
                rows = self.hot.cpu_rows[e] if e in self.hot else self.cold.rows[e]
                y = cpu_kernels.sparse_ffn_batch(xs.contiguous(), rows, None, "relu")
            else:
                y = reglu(xs, *self._expert_rows(e, device, dtype)).float()
            out.index_add_(0, tokens.to(x.device), y.to(x.device) * weights.to(x.device)[:, None])
        return out.to(x.dtype)


class MoeRuntime(SparseRuntime):
    """SparseRuntime with experts as the placed unit; the router replaces the predictors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counters = MoeCounters()

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

    def split_experts(self, layer: int, dense: DenseMoe, hot_ids: np.ndarray) -> TieredMoe:
        """Split a freshly loaded fp32 CPU layer of experts into the two tiers."""
        hot = HotExperts(*self._where(True))
        cold = ColdExperts(self.cpu_weights)
        hot_set = set(int(e) for e in hot_ids)
        for e in range(dense.num_experts):
            (hot if e in hot_set else cold).add(e, *dense.expert(e))
        return TieredMoe(layer, dense.num_experts, dense.n_ff, hot, cold, self)

    def _head_weights(self, on_fast: bool):
        """A tied head on an int8 CPU tier is an int8 copy of the embeddings (counted by the
        placement, ModelBytes.int8_head_copy): it is most of a token's bytes otherwise."""
        if not on_fast and self.config.tie_word_embeddings and self.cpu_weights == COLD_INT8:
            return Int8Matrix.quantize(self.model.embed)
        return super()._head_weights(on_fast)

    def convert_layer_dense(self, layer, on_fast: bool) -> None:
        super().convert_layer_dense(layer, on_fast)
        layer.router = self._tier_matrix(layer.router, on_fast)

    def _move_neurons(self, ffn: TieredMoe, new_hot: np.ndarray) -> None:
        """Promote and demote only the experts whose tier changes."""
        new = set(int(e) for e in new_hot)
        for e in [e for e in ffn.hot.rows if e not in new]:
            ffn.cold.add(e, *ffn.hot.pop(e))
        for e in sorted(new - set(ffn.hot.rows)):
            ffn.hot.add(e, *ffn.cold.pop(e))


def load_moe(model_dir, config, mode: str, ctx: int, vram_budget: int | None, ram_budget: int | None,
             device: str | None, progress, cpu_weights: str = "int8") -> SparseParts:
    """`engine.sparse.load_sparse` for a mixture of experts: the parts `Engine.load` assembles."""
    fast = pick_fast_device(device)
    default_vram, default_ram = default_budgets(fast, mode)
    vram = default_vram if vram_budget is None else vram_budget
    ram = default_ram if ram_budget is None else ram_budget
    storage = WeightSource(model_dir).dtype()
    problem = problem_for_model(model_dir, config, ctx, fast, cpu_weights, None, storage)
    runtime = MoeRuntime(threading.RLock(), config, mode, fast, storage, None, problem, cpu_weights)
    plan = runtime.solve(vram, ram)
    runtime.budgets = (vram, ram)
    runtime.plan = plan
    cpu = torch.device("cpu")
    layer_devices = [fast if on else cpu for on in plan.layer_on_fast]
    head_device = fast if plan.head_on_fast else cpu
    model = load_transformer(
        model_dir, config, layer_devices, head_device, ctx, progress,
        ffn_builder=lambda i, dense: runtime.split_experts(i, dense, plan.hot_ids[i]),
        on_layer=lambda i, layer: runtime.convert_layer_dense(layer, plan.layer_on_fast[i]),
    )
    runtime.model = model
    model.lm_head = runtime._head_weights(plan.head_on_fast)
    return SparseParts(model, runtime, layer_devices, [compute_dtype(d, storage) for d in layer_devices])
