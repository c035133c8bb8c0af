"""The registry's fit estimate against the bytes the engine really allocates (within 5%)."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import Engine
from models_registry.fit import BytesModel, estimate_fit

from test_sparse import random_predictors, vram_for

RAM = 1 << 30


@pytest.mark.parametrize("family", ["llama", "falcon_new"])
@pytest.mark.parametrize("hot_fraction", [0.0, 0.4, 1.0])
def test_fit_estimate_matches_engine_allocations(tmp_path, tiny_models, family, hot_fraction):
    model = tmp_path / "m"
    shutil.copytree(tiny_models[family], model)
    config = json.loads((model / "config.json").read_text())
    cfg = Engine.load(model).config
    random_predictors(cfg, rank=12).save(model)
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=RAM)
    vram = vram_for(probe, hot_fraction)
    engine = Engine.load(model, mode="hybrid", vram_budget=vram, ram_budget=RAM, ctx=2048)
    real = engine.memory()
    # The CPU stands in for the GPU here, so the fast tier holds fp32 (4 bytes, not 2).
    estimate = estimate_fit(config, ctx=2048, vram_budget=vram, ram_budget=RAM, model_dir=model,
                            bytes_model=BytesModel(gpu_weight_bytes=4, gpu_kv_bytes=4))
    assert estimate.vram_bytes == pytest.approx(real["vram_bytes"], rel=0.05)
    assert estimate.ram_bytes == pytest.approx(real["ram_bytes"], rel=0.05)
    for tier, size in estimate.tier_bytes().items():
        assert size == pytest.approx(real["tiers"][tier], rel=0.05, abs=64), tier
    assert real["vram_bytes"] <= vram


@pytest.mark.parametrize("cpu_weights", ["int4", "fp32"])
def test_fit_estimate_counts_the_cpu_weight_format(tmp_path, tiny_models, cpu_weights):
    """4-bit and fp32 CPU tiers: the estimate is what the engine allocates (4-bit exactly)."""
    model = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    cfg = Engine.load(model).config
    random_predictors(cfg, rank=12).save(model)
    engine = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=RAM, ctx=256, cpu_weights=cpu_weights)
    real = engine.memory()
    estimate = estimate_fit(config, ctx=256, vram_budget=0, ram_budget=RAM, model_dir=model,
                            bytes_model=BytesModel(gpu_weight_bytes=4, gpu_kv_bytes=4, cpu_weights=cpu_weights))
    for tier, size in estimate.tier_bytes().items():
        assert size == pytest.approx(real["tiers"][tier], rel=0.02, abs=64), tier
