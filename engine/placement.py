"""Neuron placement: which tensors live on the fast device under a VRAM and a RAM budget.

The solver first reserves the dense parts (output head, then each layer's attention,
norms, predictor and KV cache) on the fast device while they fit. Once every dense part
is there, the rest of the VRAM budget goes to FFN neurons, chosen across all layers by
activation frequency: every neuron costs the same bytes, so taking the most frequent
ones maximises the expected share of activated neurons served by the fast device. That
is a top-k over all neurons (argpartition, linear time), so it runs while a slider
moves. Everything not on the fast device must fit the RAM budget, or the answer is
"does not fit" with the minimum RAM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


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

    def summary(self) -> dict:
        return {
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
        }


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
    fits = ram <= ram_budget
    if not fits:
        verdict = "does not fit"
    elif cold_count == 0 and all(layer_on_fast) and head_on_fast:
        verdict = "fits"
    else:
        verdict = "fits with cold neurons on CPU"
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
        min_ram_bytes=ram,  # at this VRAM budget; more VRAM lowers it
        solve_s=time.perf_counter() - start,
        device=problem.fast_device,
        hot_fraction_per_layer=[len(ids) / max(len(f), 1) for ids, f in zip(hot_ids, problem.frequencies)],
    )
