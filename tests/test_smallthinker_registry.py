"""SmallThinker in the model registry: catalogue rows, detection, fit estimates that count
experts as the engine places them."""

from __future__ import annotations

import pytest

import smallthinker_factory as sf
from engine import Engine
from engine.arch import parse_config
from engine.hotcold.placement import ModelBytes
from models_registry.arch import detect_architecture
from models_registry.catalogue import get_entry
from models_registry.fit import VERDICT_DISK, VERDICT_HYBRID, VERDICT_NO, estimate_fit, placement_bytes, shape_from_config

GiB = 1024**3
IDS = ("smallthinker-4b-a0.6b-instruct", "smallthinker-21b-a3b-instruct")


def test_catalogue_rows_name_both_publishers():
    small, large = get_entry(IDS[0]), get_entry(IDS[1])
    assert small.repo == "PowerInfer/SmallThinker-4BA0.6B-Instruct"
    assert get_entry("Tiiny/SmallThinker-4BA0.6B-Instruct") is small
    assert get_entry("Tiiny/SmallThinker-21BA3B-Instruct") is large
    for entry in (small, large):
        assert entry.license == "Apache-2.0" and entry.architecture == "smallthinker"
        assert entry.predictor.source == "router"
        assert {"config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(entry.files)
    assert small.context_length == 32768 and large.context_length == 16384


def test_the_4b_row_is_the_real_config():
    real = sf.real_config()
    for key, value in get_entry(IDS[0]).config.items():
        assert real[key] == value, key


@pytest.mark.parametrize("model_id, params", [(IDS[0], 4.0e9), (IDS[1], 21.1e9)])
def test_sizes_come_from_the_config(model_id, params):
    entry = get_entry(model_id)
    shape = shape_from_config(entry.config, detect_architecture(entry.config))
    assert entry.size_bytes == 2 * shape.total_params  # bf16
    assert abs(shape.total_params - params) / params < 0.02


def test_registry_and_engine_count_the_same_bytes():
    """The fit estimate before download places the same units as the engine after it."""
    real = sf.real_config()
    shape = shape_from_config(real, detect_architecture(real))
    assert placement_bytes(shape) == ModelBytes.from_config(parse_config(real))


def test_the_4b_fits_8_gb_of_ram_and_the_21b_runs_from_disk():
    small = estimate_fit(get_entry(IDS[0]).config, ctx=4096, vram_budget=0, ram_budget=8 * GiB)
    assert small.verdict == VERDICT_HYBRID and small.ram_bytes < 6 * GiB
    assert small.hot_neurons == 0 and small.cold_neurons == 32 * 32 * 768  # experts' neurons, all on the CPU
    # The 21B does not fit in 8 GB; since the disk tier covers mixtures (#29) its rarely needed
    # experts' rows stay in the prepared file, and below its resident parts it is refused.
    large = estimate_fit(get_entry(IDS[1]).config, ctx=4096, vram_budget=0, ram_budget=8 * GiB)
    assert large.verdict == VERDICT_DISK and large.disk_bytes > 0 and large.disk_read_per_token > 0
    assert large.ram_bytes <= 8 * GiB
    floor = estimate_fit(get_entry(IDS[1]).config, ctx=4096, vram_budget=0, ram_budget=large.min_ram_bytes // 2)
    assert floor.verdict == VERDICT_NO


def test_fit_estimate_matches_the_engine_allocation(tmp_path):
    path = sf.smallthinker(tmp_path / "m")
    cfg = sf.tiny_config()
    probe = Engine.load(path, mode="hybrid", vram_budget=0, ram_budget=GiB)
    plan = probe.sparse.solve(1 << 40, 1 << 40)
    vram = plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"] + 5 * probe.sparse.problem.neuron_fast
    engine = Engine.load(path, mode="hybrid", vram_budget=vram, ram_budget=GiB)
    from models_registry.fit import BytesModel

    est = estimate_fit(cfg, ctx=engine.ctx, vram_budget=vram, ram_budget=GiB,
                       bytes_model=BytesModel(gpu_weight_bytes=4, gpu_kv_bytes=2))  # the CPU stand-in: fp32, its cache fp16
    assert est.tier_bytes() == engine.memory()["tiers"]
    assert est.hot_neurons == 5
