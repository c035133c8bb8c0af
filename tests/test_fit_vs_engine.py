"""The registry's fit estimate against the bytes the engine really allocates (within 5%)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

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
    # The CPU stands in for the GPU here, so the fast tier holds fp32 (4 bytes, not 2), its
    # KV cache fp16 as every CPU layer's.
    estimate = estimate_fit(config, ctx=2048, vram_budget=vram, ram_budget=RAM, model_dir=model,
                            bytes_model=BytesModel(gpu_weight_bytes=4, gpu_kv_bytes=2))
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
                            bytes_model=BytesModel(gpu_weight_bytes=4, gpu_kv_bytes=2, cpu_weights=cpu_weights))
    for tier, size in estimate.tier_bytes().items():
        assert size == pytest.approx(real["tiers"][tier], rel=0.02, abs=64), tier


@pytest.mark.parametrize("kv, kv_bytes", [("", 2), ("fp32", 4)])  # "": the default, fp16
def test_the_kv_cache_is_counted_in_the_dtype_it_is_stored_in(tmp_path, tiny_models, monkeypatch, kv, kv_bytes):
    """The planner, the fit estimate, the context check and both modes' allocations agree on
    the CPU cache's bytes: fp16 by default, fp32 under THERMOCLINE_KV_CACHE=fp32."""
    from engine.validation import kv_bytes_per_token

    monkeypatch.setenv("THERMOCLINE_KV_CACHE", kv)
    model = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    dense = Engine.load(model, ctx=256)
    cfg = dense.config
    per_position = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes
    assert dense.cache.nbytes == 256 * per_position
    assert {t.dtype for t in dense.cache.k} == {torch.float16 if kv_bytes == 2 else torch.float32}
    assert kv_bytes_per_token(cfg, "cpu") == per_position + 2 * cfg.head_dim * 4 + 8  # + RoPE row, slot
    random_predictors(cfg, rank=12).save(model)
    engine = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=RAM, ctx=256)
    assert engine.memory()["tiers"]["cpu_kv"] == 256 * per_position
    estimate = estimate_fit(config, ctx=256, vram_budget=0, ram_budget=RAM, model_dir=model)
    assert estimate.kv_cpu_bytes == 256 * per_position
