"""A mixture's disk tier (PowerInfer-2, issue #29): the cold neurons of its experts stay in the
MoE prepared file (engine.loading.prepared_moe), read as bundles (engine.hotcold.neuron_bundles:
gate | up | down_t of neuron j of expert e, unit e * n + j), and the neuron cache
(engine.hotcold.neuron_cache) holds those a token needs most, by expert and by neuron inside an
expert: its groups are the (layer, expert) pairs, seeded by how often a token needs each unit
(placement's need_frequencies: an expert's every neuron when the router picks it often; where
the experts carry predictors, the neurons that fire). The experts the router rarely picks stay
on disk.

`DiskExperts` is a layer's cold tier (ColdExperts' interface, no rows in RAM). Per token,
TieredMoe asks it for each chosen expert's rows (`resident`): the expert's positions it
computes (every cold neuron; with a predictor, those it predicts) are made resident, the
missing ones read into free or evicted slots, and the kernel gets `SlotRows`, the pool's rows
with a slot per position: the same kernel over the same positions in the same order as over
the expert's rows in RAM, so the same bits. One expert is resident at a time (the working
set): the next expert's misses may evict the last one's rows once it is computed. The reads
happen here, before the kernel runs, never inside it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from engine.hotcold.neuron_cache import NeuronCache, SlotRows, open_reader
from engine.model.moe import ExpertPredictors


class _NeuronIds(Mapping):
    """Expert e's cold neuron ids (sorted, in the expert) from the cache's units (e * n + j):
    made on use, so a disk layer keeps no second copy of its ids."""

    def __init__(self, tier: "DiskExperts"):
        self.tier = tier

    def __getitem__(self, e: int) -> torch.Tensor:
        return torch.from_numpy(self.tier.neurons_of(e))

    def __iter__(self):
        return iter(self.tier.group_of)

    def __len__(self) -> int:
        return len(self.tier.group_of)


class DiskExperts:
    """One layer's cold experts on disk behind the shared neuron cache (see the module's docstring)."""

    quant: str
    stack = None  # no stacked rows in RAM (the fused MoE decode takes only a ColdExperts' stack)

    def __init__(self, cache: NeuronCache, layer: int, n: int, group_of: dict[int, int], quant: str):
        self.cache, self.layer, self.n, self.quant = cache, layer, n, quant
        self.group_of = group_of  # expert -> the cache's group of its cold neurons
        self.rows: dict = {}  # nothing held here: `resident` hands the kernel the cache's rows
        self.neuron_ids = _NeuronIds(self)

    def __contains__(self, e: int) -> bool:
        return e in self.group_of

    def __len__(self) -> int:
        return len(self.group_of)

    @property
    def ids(self) -> np.ndarray:
        return np.array(sorted(self.group_of), dtype=np.int64)

    def neurons_of(self, e: int) -> np.ndarray:
        return self.cache.cold_ids[self.group_of[e]] - e * self.n

    def neurons(self, e: int) -> int:
        return len(self.cache.cold_ids[self.group_of[e]]) if e in self.group_of else 0

    def unit_ids(self, n: int) -> np.ndarray:
        parts = [self.cache.cold_ids[self.group_of[e]] for e in sorted(self.group_of)]
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return 0  # the cache's bytes (slots, maps, buffers) are counted once, by the runtime

    def resident(self, e: int, pred_logits: torch.Tensor | None = None) -> SlotRows:
        """Expert e's cold rows for one kernel call, the positions it computes made resident
        first: all of them, or with the expert's predictor logits (fp32 [n], or [t, n] for
        the tokens of a prompt) those any token predicts."""
        cache, g = self.cache, self.group_of[e]
        neurons = self.neurons_of(e)
        if pred_logits is None:
            positions = np.arange(len(neurons))
        else:
            logits = pred_logits.detach().to("cpu", torch.float32).numpy().reshape(-1, self.n)
            positions = np.flatnonzero((logits[:, neurons] >= ExpertPredictors.THRESHOLD).any(axis=0))
        if not cache.ensure(g, positions):
            raise RuntimeError("an expert larger than the neuron cache's working set")
        return SlotRows(cache, cache.slot_index(g), neurons)

    def pop(self, e: int):
        raise RuntimeError("a layer whose cold experts are on disk is not re-split (the runtime refuses the move)")


def attach(runtime, model, experts_file, plan) -> None:
    """Every layer's cold experts onto disk: the neuron cache over (layer, expert) groups,
    seeded by how often each unit is needed; each layer's cold tier becomes a DiskExperts."""
    from dataclasses import replace

    from engine.hotcold.placement import cold_frequencies
    from engine.hotcold.sparse import cache_capacity

    n = runtime.config.intermediate_size
    need = cold_frequencies(runtime.problem, plan.hot_ids, need=True)  # per layer, cold units in order
    groups, group_layer, seeds, tiers = [], [], [], []
    for i, layer in enumerate(model.layers):
        cold = layer.ffn.cold
        group_of, at = {}, 0
        for e in sorted(cold.neuron_ids):
            ids = e * n + cold.neuron_ids[e].numpy().astype(np.int64)
            group_of[e] = len(groups)
            groups.append(ids)
            group_layer.append(i)
            seeds.append(need[i][at:at + len(ids)])
            at += len(ids)
        tiers.append(group_of)
    cache = NeuronCache(runtime.cpu_weights, open_reader(experts_file, len(model.layers)), groups,
                        cache_capacity(plan), runtime.config.hidden_size, group_layer, working=n)
    runtime.neuron_cache = cache
    runtime.problem = replace(runtime.problem, cached=True)  # from now on the cold rows are the cache's slots
    cache.seed(seeds)
    for layer, group_of in zip(model.layers, tiers):
        layer.ffn.cold = DiskExperts(cache, layer.ffn.layer, n, group_of, runtime.cpu_weights)
        layer.fused = None  # a fused decode's views of the rows the layer had
