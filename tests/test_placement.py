"""The placement solver: budgets respected, monotone, deterministic, numeric layer order."""

from __future__ import annotations

import numpy as np
import torch

from engine.hotcold.activation_stats import ActivationStats
from engine.arch import parse_config
from engine.hotcold.neuron_bundles import buffer_bytes, bundle_size
from engine.hotcold.placement import INDEX_BYTES, SLOT_META_BYTES, decode_speed, min_cache_neurons, solve
from engine.hotcold.sparse_solve import placement_problem

CONFIG = parse_config({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "hidden_act": "relu",
})


def problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    freqs = [rng.pareto(1.2, CONFIG.intermediate_size) for _ in range(CONFIG.num_layers)]
    return placement_problem(CONFIG, [64] * CONFIG.num_layers, freqs, 512, torch.device("cuda:0"),
                             torch.float16, "int8")


def test_budgets_are_respected_and_accounted():
    p = problem()
    everything = solve(p, 1 << 40, 1 << 40)
    for vram in np.linspace(0, everything.vram_bytes * 1.1, 40).astype(int):
        plan = solve(p, int(vram), 1 << 40)
        assert plan.vram_bytes <= vram
        assert plan.vram_bytes == sum(v for k, v in plan.tier_bytes.items() if k.startswith("fast"))
        assert plan.ram_bytes == sum(v for k, v in plan.tier_bytes.items() if k.startswith("cpu"))
        hot = sum(len(ids) for ids in plan.hot_ids)
        assert plan.tier_bytes["fast_ffn"] == hot * p.neuron_fast


def test_monotone_in_the_vram_budget():
    p = problem()
    top = solve(p, 1 << 40, 1 << 40).vram_bytes
    previous = None
    for vram in np.linspace(0, top, 60).astype(int):
        plan = solve(p, int(vram), 1 << 40)
        if previous is not None:
            assert plan.vram_bytes >= previous.vram_bytes
            assert plan.ram_bytes <= previous.ram_bytes
            assert plan.hot_hit_fraction >= previous.hot_hit_fraction
            for old, new in zip(previous.hot_ids, plan.hot_ids):
                assert set(old) <= set(new)  # growing never demotes a neuron
        previous = plan
    assert previous.hot_hit_fraction == 1.0 and previous.verdict == "fits"


def test_hot_set_is_the_most_frequent_neurons():
    p = problem()
    dense = p.head_fast + sum(c.dense_fast + c.kv_fast for c in p.layers)
    plan = solve(p, dense + 500 * p.neuron_fast, 1 << 40)
    flat = np.concatenate(p.frequencies)
    chosen = np.concatenate([ids + i * CONFIG.intermediate_size for i, ids in enumerate(plan.hot_ids)])
    assert len(chosen) == 500
    assert flat[chosen].min() >= np.sort(flat)[-500]
    assert plan.hot_hit_fraction == flat[chosen].sum() / flat.sum()


def test_deterministic_with_ties():
    p = problem()
    tied = [np.ones_like(f) for f in p.frequencies]
    p = type(p)(**{**p.__dict__, "frequencies": tied})
    dense = p.head_fast + sum(c.dense_fast + c.kv_fast for c in p.layers)
    plans = [solve(p, dense + 777 * p.neuron_fast, 1 << 40) for _ in range(3)]
    for a, b in zip(plans, plans[1:]):
        assert all(np.array_equal(x, y) for x, y in zip(a.hot_ids, b.hot_ids))
    assert plans[0].hot_ids[0].tolist() == list(range(688)) and plans[0].hot_ids[1].tolist() == list(range(89))


def test_ram_budget_below_the_cpu_part_does_not_fit_without_a_disk_tier():
    p = problem()
    p = type(p)(**{**p.__dict__, "disk_tier": False})
    need = solve(p, 0, 1 << 40).ram_bytes
    assert not solve(p, 0, need - 1).fits
    assert solve(p, 0, need).fits
    assert solve(p, 0, need - 1).min_ram_bytes == need


def test_disk_tier_below_the_cpu_part():
    """Below the CPU side's bytes the cold rows beyond a neuron cache stay on disk, down to the
    resident parts plus the working set; the cache is seeded with the most frequent neurons."""
    p = problem()
    assert p.disk_tier  # int8 rows of a dense FFN
    full = solve(p, 0, 1 << 40)
    assert full.resident_ram_bytes == full.ram_bytes - full.tier_bytes["cpu_ffn"] and not full.embed_on_disk
    assert p.embed_disk  # an untied head: below the placed size the embeddings go to disk first (a row a token)
    resident = full.resident_ram_bytes - p.embed_cpu
    slot = p.neuron_cpu - INDEX_BYTES + SLOT_META_BYTES
    assert p.read_buffers == buffer_bytes(bundle_size(slot - SLOT_META_BYTES), 688) > 0  # the reader's buffers count with the cache
    maps = (6 * 688 + 688) * INDEX_BYTES + p.read_buffers  # slot maps, and a layer's padded predictor ids
    least = resident + maps + min_cache_neurons(p) * slot
    assert solve(p, 0, least).verdict == "runs from disk"
    below = solve(p, 0, least - 1)
    assert not below.fits and below.min_ram_bytes == least
    reads = []
    for share in (0.9, 0.5, 0.1):  # of the room between the least and every cold row in RAM
        budget = least + int(share * (resident + full.tier_bytes["cpu_ffn"] - least))
        plan = solve(p, 0, budget)
        assert plan.fits and plan.ram_bytes <= budget
        assert plan.cache_neurons + plan.disk_neurons == 6 * 688
        assert plan.ram_bytes == resident + maps + plan.cache_neurons * slot and plan.embed_on_disk
        assert plan.resident_ram_bytes == resident and plan.disk_bytes >= p.embed_cpu
        reads.append(plan.disk_read_per_token)
        # the cache holds the most frequent cold neurons: its expected hit share beats its size share
        assert plan.expected_cache_hit >= plan.cache_neurons / (6 * 688)
    assert reads[0] < reads[1] < reads[2]
    assert decode_speed(solve(p, 0, least), 20e9, 2e9) < decode_speed(full, 20e9, 2e9)


def test_statistics_load_in_numeric_layer_order(tmp_path):
    counts = [torch.full((4,), float(i)) for i in range(12)]
    ActivationStats(counts, tokens=10).save(tmp_path)
    loaded = ActivationStats.load(tmp_path)
    assert [int(c[0]) for c in loaded.counts] == list(range(12))  # layer 10 is not second


def test_a_mixture_runs_from_disk_by_expert_and_by_neuron():
    """A mixture's disk tier: below its CPU side the experts the router rarely picks stay on
    disk and the cache holds the often chosen ones, down to the resident parts, one expert's
    slots and the reader's buffers; with the experts' predictors the cache keeps the neurons
    that fire, inside every expert."""
    config = parse_config({
        "model_type": "smallthinker", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 500, "tie_word_embeddings": True,
        "moe_num_primary_experts": 8, "moe_num_active_primary_experts": 2, "moe_ffn_hidden_size": 512,
    })  # 3.5 MB of 4-bit expert rows: more than the reader's buffers
    E, n = 8, 512
    chosen = np.array([0.9, 0.6, 0.3, 0.1, 0.05, 0.03, 0.01, 0.01])  # a router's skew, per expert
    fires = np.random.default_rng(0).random((E, n)) * chosen[:, None]
    rank = [((chosen[:, None] + 2 * fires) / 3).reshape(-1)] * 2
    for need, by_expert in (([np.repeat(chosen, n)] * 2, True), ([fires.reshape(-1)] * 2, False)):
        p = placement_problem(config, [0, 0], rank, 64, torch.device("cpu"), torch.float32, "int4", need)
        assert p.disk_tier and p.embed_disk  # a tied head gets its own 4-bit copy: the embeddings may go to disk
        full = solve(p, 0, 1 << 40)
        slot = p.neuron_cpu - INDEX_BYTES + SLOT_META_BYTES
        least = full.resident_ram_bytes - p.embed_cpu + (2 * E * n + n) * INDEX_BYTES + p.read_buffers + n * slot
        assert min_cache_neurons(p) == n and solve(p, 0, least).verdict == "runs from disk"
        assert not solve(p, 0, least - 1).fits and solve(p, 0, least - 1).min_ram_bytes == least
        plan = solve(p, 0, least + 3 * n * slot)  # four experts' worth of slots
        assert plan.fits and plan.cache_neurons == 4 * n and plan.disk_neurons == 2 * E * n - 4 * n
        cached = np.sort(np.concatenate(need))[::-1][:4 * n].sum()
        assert np.isclose(plan.expected_cache_hit, cached / sum(f.sum() for f in need))
        assert np.isclose(plan.disk_read_per_token - p.embed_row,
                          (sum(f.sum() for f in need) - cached) * (p.neuron_cpu - INDEX_BYTES))
        if by_expert:  # the two most chosen experts of each layer, whole, and nothing of the rest
            assert np.sort(np.concatenate(need))[::-1][4 * n - 1] == chosen[1]
