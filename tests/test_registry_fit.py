"""The fit estimator: parameter counts, the placement byte model, verdicts and suggestions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models_registry.catalogue import find_entry
from models_registry.fit import (
    VERDICT_DISK,
    VERDICT_FITS,
    VERDICT_HYBRID,
    VERDICT_NO,
    BytesModel,
    estimate_fit,
    gpu_bytes_for_everything,
    place_bytes,
    predictor_params_from_file,
    shape_from_config,
    suggest_budgets,
)
from engine.budget_policy import VRAM_RESERVE
from models_registry.hardware import GpuInfo, HardwareInfo

GiB = 1024**3
LLAMA2_7B = find_entry("relullama-7b").config


def tiny(**overrides):
    config = {"model_type": "llama", "hidden_act": "relu", "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "tie_word_embeddings": False}
    config.update(overrides)
    return config


@pytest.mark.parametrize("config, expected", [
    (LLAMA2_7B, 6_738_415_616),  # Llama 2 7B, as published
    (find_entry("relullama-70b").config, 68_976_648_192),  # Llama 2 70B (GQA)
    (find_entry("bamboo-base").config, 7_241_732_096),  # Mistral 7B shape
    ({"model_type": "falcon", "activation": "relu", "hidden_size": 4544, "num_hidden_layers": 32,
      "num_attention_heads": 71, "multi_query": True, "parallel_attn": True, "bias": False,
      "vocab_size": 65024}, 6_921_720_704),  # Falcon 7B
])
def test_parameter_counts_match_published_figures(config, expected):
    assert shape_from_config(config).total_params == expected


@pytest.mark.parametrize("kind, config", [
    ("llama", tiny()),
    ("llama", tiny(tie_word_embeddings=True, num_key_value_heads=4)),
    ("mistral", tiny(model_type="mistral")),
    ("falcon", {"model_type": "falcon", "activation": "relu", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_kv_heads": 2, "new_decoder_architecture": True,
                "bias": False, "vocab_size": 100}),
    ("falcon", {"model_type": "falcon", "activation": "relu", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 8, "multi_query": True, "parallel_attn": True, "bias": False,
                "vocab_size": 100}),
])
def test_parameter_counts_match_transformers_models(kind, config):
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "falcon": transformers.FalconConfig}[kind]
    hf_config = cls(**{k: v for k, v in config.items() if k not in ("model_type",)})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    real = sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once
    assert shape_from_config(config).total_params == real


def test_everything_on_cpu_follows_the_cpu_byte_rules(monkeypatch):
    monkeypatch.delenv("THERMOCLINE_KV_CACHE", raising=False)
    shape = shape_from_config(tiny())
    est = place_bytes(shape, ctx=32, vram_budget=0, ram_budget=1 << 40, predictor_rank=8)
    d, f, L, kvh, hd = 64, 160, 3, 2, 16
    embed_norms = (100 * 64 + 64 + L * 2 * 64) * 4  # fp32
    head = 100 * (64 + 4)  # untied head: int8 rows, an fp32 scale per row
    attention = L * (64 * 64 * 2 + 2 * 64 * kvh * hd + (64 + 2 * kvh * hd + 64) * 4)  # int8 q|k|v and o, row scales
    assert est.dense_cpu_bytes == embed_norms + head + attention
    fp32 = place_bytes(shape, ctx=32, vram_budget=0, ram_budget=1 << 40, predictor_rank=8,
                       bytes_model=BytesModel(cpu_weights="fp32"))
    assert fp32.dense_cpu_bytes == (embed_norms // 4 + 100 * 64 + L * (64 * 64 * 2 + 2 * 64 * kvh * hd)) * 4
    assert est.predictor_cpu_bytes == L * (8 * (d + f) + (8 + f) * 4)  # int8 rows of fc1 and fc2, fp32 scales
    assert fp32.predictor_cpu_bytes == L * 8 * (d + f) * 4
    assert est.kv_cpu_bytes == L * 2 * 32 * kvh * hd * 2  # the CPU cache stores fp16
    assert fp32.kv_cpu_bytes == est.kv_cpu_bytes  # the weights' format does not change it
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")  # the exact reference: twice the bytes
    exact = place_bytes(shape, ctx=32, vram_budget=0, ram_budget=1 << 40, predictor_rank=8)
    assert exact.kv_cpu_bytes == L * 2 * 32 * kvh * hd * 4
    assert exact.ram_bytes - est.ram_bytes == exact.kv_cpu_bytes // 2
    assert est.cold_ffn_bytes == L * f * (3 * (d + 4) + 8)  # int8 rows, fp32 scales, int64 ids
    assert est.vram_bytes == 0 and est.hot_neurons == 0 and est.verdict == VERDICT_HYBRID
    assert est.reason == "runs on the CPU alone: every layer in RAM"  # not "0% ... on the GPU"


def test_everything_on_gpu_follows_the_gpu_byte_rules():
    shape = shape_from_config(tiny(tie_word_embeddings=True))
    pred = [8 * (64 + 160)] * 3
    est = place_bytes(shape, ctx=32, vram_budget=1 << 40, ram_budget=1 << 40, predictor_params=pred)
    assert est.verdict == VERDICT_FITS and est.hot_neurons == 3 * 160 and est.gpu_layers == 3
    assert est.ram_bytes == 100 * 64 * 4  # the embeddings stay in RAM, in fp32
    head = 100 * 64 + 64  # a GPU copy of the tied head, and the final norm
    layers = 3 * (64 * 64 * 2 + 2 * 64 * 2 * 16 + 2 * 64 + pred[0])
    kv = 3 * 2 * 32 * 2 * 16
    assert est.vram_bytes == (head + layers + kv) * 2 + 3 * 160 * (3 * 64 * 2 + 8)
    assert gpu_bytes_for_everything(shape, 32, pred) == est.vram_bytes
    tiers = est.tier_bytes()
    assert sum(tiers[k] for k in ("fast_dense", "fast_kv", "fast_ffn")) == est.vram_bytes
    assert place_bytes(shape, ctx=32, vram_budget=1 << 40, ram_budget=0).verdict == VERDICT_NO


def test_hot_neurons_wait_for_every_layer_on_the_gpu():
    shape = shape_from_config(tiny())
    full = gpu_bytes_for_everything(shape, 32)
    all_dense = place_bytes(shape, ctx=32, vram_budget=full, ram_budget=1 << 40)
    dense_only = all_dense.vram_bytes - all_dense.hot_ffn_bytes
    short = place_bytes(shape, ctx=32, vram_budget=dense_only - 1, ram_budget=1 << 40)
    assert short.gpu_layers == 2 and short.hot_neurons == 0
    exact = place_bytes(shape, ctx=32, vram_budget=dense_only + 1000, ram_budget=1 << 40)
    assert exact.gpu_layers == 3 and exact.hot_neurons == 1000 // (3 * 64 * 2 + 8)


def test_more_vram_moves_bytes_off_the_cpu_and_never_exceeds_the_budget():
    shape = shape_from_config(LLAMA2_7B)
    previous = None
    for vram in [0, 1 * GiB, 2 * GiB, 4 * GiB, 6 * GiB, 8 * GiB, 12 * GiB, 16 * GiB]:
        est = place_bytes(shape, ctx=2048, vram_budget=vram, ram_budget=64 * GiB)
        assert est.vram_bytes <= vram
        if previous:
            # dense layers go first, so hot neurons may give way to a layer's attention
            assert est.ram_bytes <= previous.ram_bytes and est.gpu_layers >= previous.gpu_layers
        previous = est
    assert previous.verdict == VERDICT_FITS  # 16 GiB holds 7B in fp16 with a 2k cache


def test_verdict_does_not_fit_names_the_ram_needed():
    shape = shape_from_config(LLAMA2_7B)
    # 4 GiB holds 7B's resident parts and a neuron cache: the rest of the FFN runs from disk (#29)
    assert place_bytes(shape, ctx=2048, vram_budget=0, ram_budget=4 * GiB).verdict == VERDICT_DISK
    est = place_bytes(shape, ctx=2048, vram_budget=0, ram_budget=256 * 1024**2)  # below the resident parts
    assert est.verdict == VERDICT_NO and "RAM" in est.reason
    assert est.min_ram_bytes > 256 * 1024**2


def test_real_predictor_sizes_are_read_from_the_safetensors_header(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "thermocline" / "predictors.safetensors"
    path.parent.mkdir()
    tensors = {}
    for i, rank in enumerate([4, 8, 16]):
        tensors[f"layers.{i}.fc1.weight"] = np.zeros((rank, 64), np.float32)
        tensors[f"layers.{i}.fc2.weight"] = np.zeros((160, rank), np.float32)
    save_file(tensors, str(path), metadata={"thresholds": json.dumps([0.0] * 3), "source": "thermocline"})
    assert predictor_params_from_file(path) == [r * (64 + 160) for r in (4, 8, 16)]
    est = estimate_fit(tiny(), ctx=16, vram_budget=0, ram_budget=1 << 40, model_dir=tmp_path)
    assert est.predictor_cpu_bytes == sum(r * 224 + (r + 160) * 4 for r in (4, 8, 16))  # int8 + row scales


def _machine(vram_free, ram_available):
    gpus = [GpuInfo(0, "Test GPU", vram_free, vram_free, "555.0", "nvml")] if vram_free else []
    return HardwareInfo(ram_total=ram_available, ram_available=ram_available, cpu_model="cpu",
                        cpu_physical_cores=8, cpu_logical_cores=16, simd=["avx2"], gpus=gpus)


def test_a_swiglu_model_is_sized_dense_unless_cats_calibrated_it(tmp_path):
    """No predictor bytes and every neuron read for a SiLU model (it runs dense), until its folder
    has CATS thresholds (`profile --target-sparsity`): then it is sized as the sparse modes run it."""
    silu = tiny(hidden_act="silu")
    dense = estimate_fit(silu, ctx=16, vram_budget=0, ram_budget=1 << 40, model_dir=tmp_path)
    assert dense.dense and dense.predictor_cpu_bytes == dense.predictor_gpu_bytes == 0
    relu = estimate_fit(tiny(), ctx=16, vram_budget=0, ram_budget=1 << 40)
    assert not relu.dense and relu.predictor_cpu_bytes > 0
    (tmp_path / "thermocline").mkdir()
    (tmp_path / "thermocline" / "cats.json").write_text(json.dumps({"thresholds": [0.1] * 3, "target_sparsity": 0.5}))
    cats = estimate_fit(silu, ctx=16, vram_budget=0, ram_budget=1 << 40, model_dir=tmp_path)
    assert not cats.dense and cats.predictor_cpu_bytes == relu.predictor_cpu_bytes


def test_suggested_budgets_for_a_small_gpu_and_for_a_large_one():
    shape = shape_from_config(LLAMA2_7B)
    vram, ram = suggest_budgets(shape, 2048, vram_free=8 * GiB, ram_available=32 * GiB)
    assert vram == 8 * GiB - VRAM_RESERVE
    assert ram == place_bytes(shape, ctx=2048, vram_budget=vram, ram_budget=1 << 62).ram_bytes  # all of it
    est = estimate_fit(LLAMA2_7B, ctx=2048, hardware=_machine(8 * GiB, 32 * GiB))
    assert est.verdict == VERDICT_HYBRID and 0 < est.hot_fraction < 1
    assert (est.vram_budget, est.ram_budget) == (vram, ram)

    big = estimate_fit(LLAMA2_7B, ctx=2048, hardware=_machine(80 * GiB, 32 * GiB))
    assert big.verdict == VERDICT_FITS and big.suggested_ram_budget == 32000 * 4096 * 4  # embeddings
    assert big.suggested_vram_budget == gpu_bytes_for_everything(shape, 2048)


def test_no_gpu_and_too_little_ram_is_does_not_fit():
    est = estimate_fit(find_entry("relullama-70b").config, ctx=2048, hardware=_machine(0, 16 * GiB))
    assert est.verdict == VERDICT_NO and est.suggested_vram_budget == 0


@pytest.mark.parametrize("config", [
    LLAMA2_7B,
    find_entry("relullama-70b").config,
    find_entry("bamboo-base").config,
    find_entry("relufalcon-40b").config,
    tiny(tie_word_embeddings=True),
    {"model_type": "falcon", "activation": "relu", "hidden_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 8, "multi_query": True, "parallel_attn": True, "bias": True, "vocab_size": 100},
])
def test_estimate_matches_the_engine_placement_solver(config):
    """Same bytes per tier as engine.placement.solve over engine.hotcold.sparse_solve.placement_problem."""
    import torch

    from engine.arch import parse_config
    from engine.hotcold import placement, sparse_solve

    engine_config = parse_config(config)
    shape = shape_from_config(config)
    ranks = [16 + 8 * (i % 3) for i in range(shape.n_layers)]  # uneven ranks, as trained predictors have
    freqs = [np.ones(shape.n_ff) for _ in range(shape.n_layers)]
    problem = sparse_solve.placement_problem(engine_config, ranks, freqs, 512, torch.device("cuda:0"),
                                             torch.float16, "int8")
    full = gpu_bytes_for_everything(shape, 512, [r * (shape.d + shape.n_ff) for r in ranks])
    for vram in (0, full // 7, full // 2, full - 12345, full):
        ours = place_bytes(shape, ctx=512, vram_budget=vram, ram_budget=64 * GiB,
                           predictor_params=[r * (shape.d + shape.n_ff) for r in ranks])
        theirs = placement.solve(problem, vram, 64 * GiB)
        assert ours.tier_bytes() == theirs.tier_bytes, vram
        assert (ours.vram_bytes, ours.ram_bytes) == (theirs.vram_bytes, theirs.ram_bytes)
        assert ours.verdict == theirs.verdict


def test_int4_cpu_weights_with_a_cuda_gpu_count_hot_rows_at_4_bits():
    """`models fit --cpu-weights int4` on a CUDA machine: the engine keeps hot rows as the CPU
    tier's Q4_0 blocks (hot_q4), 18 bytes per 32 weights, so the estimate counts them so too;
    a CPU stand-in fast tier, or int8 CPU weights, keeps the fast tier's dtype."""
    from engine.hotcold.placement import hot_row_format

    d, f, L = 64, 160, 3
    machine = _machine(8 * GiB, 32 * GiB)  # an 8 GiB GPU by numbers: the whole tiny model fits
    est = estimate_fit(tiny(), ctx=32, hardware=machine, bytes_model=BytesModel(cpu_weights="int4"))
    assert est.verdict == VERDICT_FITS and est.hot_neurons == L * f
    assert est.hot_ffn_bytes == L * f * (3 * (d // 32 * 18) + 8)  # gate, up, down rows + the int64 id
    fp16 = estimate_fit(tiny(), ctx=32, hardware=machine, bytes_model=BytesModel(cpu_weights="int8"))
    assert fp16.hot_ffn_bytes == L * f * (3 * d * 2 + 8)
    stand_in = estimate_fit(tiny(), ctx=32, hardware=machine,
                            bytes_model=BytesModel(gpu_weight_bytes=4, cpu_weights="int4", fast_device="cpu"))
    assert stand_in.hot_ffn_bytes == L * f * (3 * d * 4 + 8)
    assert [hot_row_format(dev, w) for dev, w in (("cuda:0", "int4"), ("cuda", "int8"), ("cpu", "int4"))] == [
        "int4", None, None]
    assert hot_row_format("cuda", "int4", moe=True) is None


def test_speeds_in_words_never_read_as_an_exponent():
    from engine.units import format_rate

    # "runs from disk at about 2.7e+04 words a second" was the verdict's wording
    assert [format_rate(x) for x in (0.94, 1.0, 9.96, 12.4, 123.4, 27_350.0)] == ["0.94", "1", "10", "12", "120", "27,000"]


@pytest.mark.parametrize("model_id", ["turbosparse-mixtral", "smallthinker-21b-a3b-instruct"])
def test_the_catalogues_mixtures_get_a_disk_verdict_on_16_gb(model_id):
    """TurboSparse-Mixtral (47B) and SmallThinker-21B at int8 exceed 16 GB: their experts'
    cold rows run from disk behind a cache, with a disk read and a speed per token (#29)."""
    entry = find_entry(model_id)
    shape = shape_from_config(entry.config)
    share = 1.0 - entry.sparsity
    est = place_bytes(shape, ctx=2048, vram_budget=0, ram_budget=16 * GiB,
                      bytes_model=BytesModel(cpu_weights="int8"), active_share=share)
    assert est.verdict == VERDICT_DISK and est.ram_bytes <= 16 * GiB
    assert est.disk_bytes > 0 and 0 < est.disk_read_per_token and 0 < est.words_per_s
    assert est.min_ram_bytes < 16 * GiB
    everything = place_bytes(shape, ctx=2048, vram_budget=0, ram_budget=1 << 62,
                             bytes_model=BytesModel(cpu_weights="int8"), active_share=share)
    assert everything.ram_bytes > 16 * GiB and everything.verdict != VERDICT_DISK
