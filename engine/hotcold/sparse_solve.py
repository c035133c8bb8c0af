"""The sparse runtime's placement: the problem of a model folder, the default budgets, the
solve under budgets (with the error that names the minimum), and the report the budget panel
shows. `Solving` is a mixin of `engine.hotcold.sparse.SparseRuntime` (reads mode, fast, problem,
budgets, lock; calls `apply` and `memory`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from engine.hotcold.activation_stats import ActivationStats
from engine.arch import arch_module
from engine.config import ModelConfig
from engine.errors import BudgetError, UserError
from engine.loading.loader import compute_dtype
from engine.hotcold.placement import ModelBytes, Placement, PlacementProblem, build_problem, solve
from engine.loading.predictors import PredictorSet
from engine.loading.predictor_import import import_checkpoint_predictors
from engine.units import format_size
from engine.loading.weights import WeightSource
from engine.model.kv_cache import kv_storage_dtype
from engine.validation import resolve_device
from engine.budget_policy import usable_ram, usable_vram
from engine.hotcold.hot_q4 import hot_weights
from engine.model.moe import need_frequencies, placement_frequencies


def pick_fast_device(device: str | None) -> torch.device:
    if device:
        return resolve_device(device)
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def default_budgets(fast: torch.device, mode: str) -> tuple[int, int]:
    """`engine.budget_policy` on this machine now: VRAM 0 without a GPU (the CPU stand-in
    starts empty) and in the sparse mode; RAM what the policy leaves of what is available."""
    import psutil

    vram = 0
    if mode != "sparse" and fast.type == "cuda":
        free, _ = torch.cuda.mem_get_info(fast)
        vram = usable_vram(free)
    return vram, usable_ram(psutil.virtual_memory().available)


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
    # the disk tier (engine.hotcold.neuron_cache): the expected reads a token makes from disk,
    # the share of the cold neurons it computes that the RAM cache serves, the speed those
    # reads allow, and the least RAM budget that runs at this VRAM budget
    disk_read_per_token: float = 0.0
    expected_cache_hit: float = 1.0
    disk_words_per_second: float | None = None
    min_ram_bytes: int = 0

    @classmethod
    def from_placement(cls, plan: Placement, applied: bool, allocated: dict | None,
                       least_ram: int = 0) -> "PlacementReport":
        from engine.hotcold.placement import words_per_second

        on_disk = plan.verdict == "runs from disk"
        return cls(plan.hot_fraction_per_layer, dict(plan.tier_bytes), plan.vram_bytes, plan.ram_bytes,
                   plan.hot_hit_fraction, plan.verdict, plan.solve_s, plan.device, applied, allocated,
                   plan.disk_read_per_token, plan.expected_cache_hit,
                   words_per_second(plan) if on_disk else None, least_ram)


def placement_problem(config: ModelConfig, predictor_ranks: list[int], frequencies: list[np.ndarray],
                      ctx: int, fast: torch.device, storage: torch.dtype, cpu_weights: str,
                      need_frequencies: list[np.ndarray] | None = None) -> PlacementProblem:
    """The engine's placement problem: the fast tier holds its compute dtype, each KV cache
    the dtype `KVCache` stores it in (fp16 for an fp32 CPU layer unless THERMOCLINE_KV_CACHE=fp32)."""
    fast_dtype = compute_dtype(fast, storage)
    fast_bytes = torch.finfo(fast_dtype).bits // 8
    fast_kv_bytes = torch.finfo(kv_storage_dtype(fast, fast_dtype)).bits // 8
    cpu_kv_bytes = torch.finfo(kv_storage_dtype(torch.device("cpu"), torch.float32)).bits // 8
    # a mixture's predictors are its experts' own: one of each rank per expert
    params = [rank * (config.hidden_size + config.intermediate_size) * max(config.num_experts, 1)
              for rank in predictor_ranks]
    hot = None if config.is_moe else hot_weights(fast, cpu_weights)  # 4-bit hot rows count their bytes
    return build_problem(ModelBytes.from_config(config), params, frequencies, ctx, fast_bytes, fast_kv_bytes,
                         cpu_weights, str(fast), hot_weights=hot, cpu_kv_bytes=cpu_kv_bytes,
                         need_frequencies=need_frequencies)


def problem_for_model(model_dir: Path, config: ModelConfig, ctx: int, fast: torch.device, cpu_weights: str,
                      predictors: PredictorSet | None = None, storage: torch.dtype | None = None) -> PlacementProblem:
    """The placement problem of a model folder, from its config, predictors and statistics."""
    import_checkpoint_predictors(model_dir, config)  # those a checkpoint carries count too
    if predictors is None and PredictorSet.exists(model_dir):
        predictors = PredictorSet.load(model_dir, config.num_layers, config.hidden_size, config.intermediate_size)
    need = None
    if config.is_moe:  # the neurons of the experts, ranked by expert use and firing (engine.moe)

        stats = ActivationStats.load(model_dir) if ActivationStats.exists(model_dir) else None
        try:
            frequencies = placement_frequencies(stats, config.num_experts, config.intermediate_size,
                                                config.num_layers)
        except ValueError:
            raise UserError(f"activation statistics of {model_dir} do not match the model; profile it again") from None
    elif ActivationStats.exists(model_dir):
        frequencies = [f.numpy() for f in ActivationStats.load(model_dir).frequencies()]
        if len(frequencies) != config.num_layers or any(len(f) != config.n_ff for f in frequencies):
            raise UserError(f"activation statistics of {model_dir} do not match the model; profile it again")
    else:  # no profile yet: every neuron alike, placement by neuron order
        frequencies = [np.ones(config.n_ff) for _ in range(config.num_layers)]
    ranks = predictors.ranks if predictors else [0] * config.num_layers
    if config.is_moe:  # the experts' own predictors (TurboSparse-Mixtral), ranks from the checkpoint's shapes
        expert_ranks = getattr(arch_module(config.arch), "predictor_ranks", None)
        ranks = (expert_ranks and expert_ranks(WeightSource(model_dir), config)) or [0] * config.num_layers
        need = need_frequencies(stats, config.num_experts, config.intermediate_size, config.num_layers,
                                any(ranks))  # checked against the model with the frequencies above
    storage = storage or WeightSource(model_dir).dtype()
    return placement_problem(config, ranks, frequencies, ctx, fast, storage, cpu_weights, need)


class Solving:
    budgets: tuple[int, int]
    lock: threading.RLock

    def solve(self, vram: int, ram: int) -> Placement:
        if self.mode == "sparse":
            vram = 0
        if self.fast.type == "cuda" and vram > 0:
            total = torch.cuda.get_device_properties(self.fast).total_memory
            if vram > total:
                raise BudgetError(f"VRAM budget {format_size(vram)} exceeds the GPU's {format_size(total)}")
        plan = solve(self.problem, vram, ram)
        if (plan.disk_neurons or plan.embed_on_disk) and not self.reads_from_disk():
            plan = solve(replace(self.problem, disk_tier=False), vram, ram)
        if not plan.fits:
            best = solve(self.problem, 1 << 62, 1 << 62)
            what = ("its resident parts (attention, predictors, norms, KV cache, head) and the smallest neuron "
                    "cache, the rest read from disk," if plan.resident_ram_bytes < plan.min_ram_bytes < plan.ram_bytes
                    else "the CPU side")
            raise BudgetError(
                f"RAM budget {format_size(ram)} is too small: at a VRAM budget of {format_size(vram)} "
                f"{what} needs {format_size(plan.min_ram_bytes)}; raise the RAM budget to at least that"
                + (f" (or give {format_size(best.vram_bytes)} of VRAM, which lowers it to "
                   f"{format_size(best.ram_bytes)})" if self.mode != "sparse" and self.fast.type == "cuda" else "")
            )
        return plan

    def reads_from_disk(self) -> bool:
        """Whether this load can keep cold rows on disk (a prepared file of its rows)."""
        return False

    def set_budgets(self, vram: int | None, ram: int | None) -> PlacementReport:
        vram = self.budgets[0] if vram is None else int(vram)
        ram = self.budgets[1] if ram is None else int(ram)
        plan = self.solve(vram, ram)
        self.budgets = (vram, ram)
        least = self.least_ram(vram)
        if self.lock.acquire(blocking=False):
            try:
                self.apply(plan)
                return PlacementReport.from_placement(plan, True, self.memory()["tiers"], least)
            finally:
                self.lock.release()
        with self._pending_lock:  # a generation holds the engine: move at its next token
            self._pending = plan
        return PlacementReport.from_placement(plan, False, None, least)

    def least_ram(self, vram: int) -> int:
        """The least RAM budget that runs at this VRAM budget: the resident parts and the disk
        tier's working set where this load can read rows from disk, else every CPU byte."""
        problem = self.problem if self.reads_from_disk() else replace(self.problem, disk_tier=False)
        return solve(problem, 0 if self.mode == "sparse" else vram, 0).min_ram_bytes

    def report(self) -> PlacementReport:
        return PlacementReport.from_placement(self.plan, True, self.memory()["tiers"],
                                              self.least_ram(self.budgets[0]))
