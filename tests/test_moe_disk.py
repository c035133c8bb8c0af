"""A mixture's disk tier (engine.hotcold.moe_disk, issue #29): below its experts' rows a RAM
budget keeps the cold experts in the MoE prepared file behind a neuron cache by expert and by
neuron inside an expert, and decodes the same bits as with every expert in RAM. SmallThinker
(every neuron of a chosen expert read) and TurboSparse-Mixtral (the experts' predictors pick
the neurons), from the published configs, at int4 and int8."""

from __future__ import annotations

import shutil

import pytest
import torch

import smallthinker_factory as sf
import turbosparse_mixtral_factory as tf
from engine import Engine, SamplingParams
from engine.hotcold.activation_stats import ActivationStats
from engine.hotcold.moe_disk import DiskExperts
from engine.hotcold.placement import solve
from engine.loading.prepared_moe import moe_path
from engine.hotcold.neuron_bundles import bundles_path

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8]
BIG = 1 << 40
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
# experts of 256 neurons of d 256 in 2 layers: 3.5 MB of 4-bit rows, more than the reader's buffers
SIZES = {"smallthinker": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=16, active=2, ff=256),
         "turbosparse-mixtral": dict(layers=2, hidden=256, heads=4, kv_heads=2, experts=16, active=2, ff=256)}


def _build(family: str, out):
    if family == "smallthinker":
        return sf.save_model(out, sf.tiny_config(**SIZES["smallthinker"]), seed=1)
    return tf.save_model(out, tf.tiny_config(**SIZES["turbosparse-mixtral"]), seed=1)


@pytest.fixture(scope="module", params=["smallthinker", "turbosparse-mixtral"])
def family_model(request, tmp_path_factory):
    return request.param, _build(request.param, tmp_path_factory.mktemp(request.param) / "m")


def _with_stats(tmp_path, source):
    """A copy of the model with a profile: a router that favours a few experts (which the
    cache keeps) and neurons that fire at a power law inside them."""
    model = tmp_path / "m"
    shutil.copytree(source, model)
    config = Engine.load(model).config
    g = torch.Generator().manual_seed(2)
    E, n = config.num_experts, config.intermediate_size
    chosen = [torch.linspace(1, 0.02, E, dtype=torch.float64) ** 2 * 100 for _ in range(config.num_layers)]
    fired = [(torch.rand(E, n, generator=g, dtype=torch.float64) ** 4) * c[:, None] for c in chosen]
    ActivationStats(chosen, tokens=100, expert_neurons=fired).save(model)
    return model


def _step_logits(engine, ids: list[int]) -> list[torch.Tensor]:
    """Logits of each token fed alone (the decode path), from an empty cache."""
    engine.wait_kernels()
    engine.reset()
    engine.sparse.begin_generation()
    return [engine.model.forward(torch.tensor([t]), pos, engine.cache)[-1].clone() for pos, t in enumerate(ids)]


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_cold_experts_on_disk_decode_the_same_bits_as_in_ram(tmp_path, family_model, fmt, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", "0")  # the same kernels: a disk layer is never fused
    family, source = family_model
    model = _with_stats(tmp_path, source)
    in_ram = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights=fmt)  # writes the prepared files
    in_ram.eos_ids = set()
    ids = PROMPT + in_ram.generate(PROMPT, GREEDY).token_ids
    reference = _step_logits(in_ram, ids)
    least = solve(in_ram.sparse.problem, 0, 0).min_ram_bytes  # resident parts, one expert's slots, buffers
    budget = int(least + 0.3 * (in_ram.sparse.plan.ram_bytes - least))
    in_ram.close()
    disk = Engine.load(model, mode="sparse", ram_budget=budget, cpu_weights=fmt)
    disk.eos_ids = set()
    plan, cache = disk.sparse.plan, disk.sparse.neuron_cache
    assert plan.verdict == "runs from disk" and cache is not None and plan.disk_neurons > 0
    assert all(isinstance(layer.ffn.cold, DiskExperts) for layer in disk.model.layers)
    assert bundles_path(moe_path(model, fmt)).is_file()  # the experts' bundles, written from the MoE file
    # seeded by expert: the most chosen expert cached whole, the rarest on disk; where the experts
    # carry predictors, by neuron inside them: the neurons that fire most of each
    first = disk.model.layers[0].ffn.cold

    def cached(e):
        return float((cache.slot_of[first.group_of[e]] >= 0).mean())

    if family == "smallthinker":
        assert cached(0) == 1.0 and cached(15) == 0.0
    else:
        assert 0.0 < cached(0) < 1.0 and cached(15) < cached(0)
    got = _step_logits(disk, ids)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    assert cache.misses > 0 and cache.reader.bytes_read > 0
    assert disk.memory()["ram_bytes"] <= budget
    assert cache.nbytes == disk.memory()["tiers"]["cpu_ffn"]
    result = disk.generate(PROMPT, GREEDY)
    assert result.token_ids == ids[len(PROMPT):]
    assert 0.0 < result.stats.cache_hit_fraction < 1.0 and result.stats.disk_read_bytes_per_token > 0
    disk.close()


def test_a_slider_move_takes_the_experts_to_disk_and_back(tmp_path, monkeypatch):
    """An in-RAM SmallThinker moved below its experts' rows: a cache by expert takes them,
    the same bits, within the budget; moved back up, it holds them all."""
    monkeypatch.setenv("THERMOCLINE_FUSED_DECODE", "0")
    model = _with_stats(tmp_path, _build("smallthinker", tmp_path / "source"))
    Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights="int4").close()  # writes the prepared files
    engine = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights="int4")
    ids = PROMPT + [4, 6, 8]
    reference = _step_logits(engine, ids)
    least = solve(engine.sparse.problem, 0, 0).min_ram_bytes
    low = int(least + 0.2 * (engine.sparse.plan.ram_bytes - least))
    report = engine.set_budgets(ram=low)
    assert report.applied and report.verdict == "runs from disk" and engine.sparse.neuron_cache is not None
    assert engine.memory()["ram_bytes"] <= low
    assert all(torch.equal(a, b) for a, b in zip(reference, _step_logits(engine, ids)))
    report = engine.set_budgets(ram=BIG)
    assert report.applied and report.verdict != "runs from disk"
    assert all(torch.equal(a, b) for a, b in zip(reference, _step_logits(engine, ids)))
    engine.close()
