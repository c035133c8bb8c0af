"""The 4-bit CPU tier (--cpu-weights int4): cold FFN rows, attention and untied head as Q4_0
rows (predictors as int8 rows), decoded by the 4-bit kernels, against the fp32 model."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import Engine, SamplingParams
from engine.kernels import cpu_q4
from engine.kernels.q4_rows import Q4FfnRows
from engine.kernels.quantized import Int8Matrix, Q4Matrix

from test_sparse import PROMPT, RAM, random_predictors, vram_for


@pytest.mark.parametrize("family", ["llama", "falcon_new"])
def test_int4_cpu_tier_stays_close_and_moves_between_tiers(tiny_models, family):
    model = tiny_models[family]
    dense = Engine.load(model).score(PROMPT)
    engine = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    layers = engine.model.layers
    assert all(isinstance(layer.qkv, Q4Matrix) and isinstance(layer.out, Q4Matrix) for layer in layers)
    assert all(isinstance(layer.ffn.cold.rows, Q4FfnRows) for layer in layers)
    assert isinstance(engine.model.lm_head, Q4Matrix) != engine.config.tie_word_embeddings
    before = engine.score(PROMPT, "oracle")
    # 4-bit weights of random tiny models: the logits move (int8 stays within 0.05), but
    # far less than they spread; the demo's perplexity is the quality figure (eval)
    assert (before - dense).abs().max().item() < 0.5
    assert torch.nn.functional.cosine_similarity(before, dense, dim=-1).min().item() > 0.98
    # one token at a time (the 4-bit gathered-row and matvec kernels) == many (dequantized
    # torch) with fp32 activations; with int8 activations (AVX2 hosts) within their rounding
    def steps():
        return torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])

    q8_steps = steps()
    assert (q8_steps - before).abs().max().item() < 0.05
    assert torch.nn.functional.cosine_similarity(q8_steps, before, dim=-1).min().item() > 0.999
    with pytest.MonkeyPatch.context() as m:  # the rest compares exactly: fp32 activations
        m.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
        before = engine.score(PROMPT, "oracle")
        assert (steps() - before).abs().max().item() <= 1e-4
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
        # half the neurons and every dense part to the fast tier (the CPU here) and back
        engine.set_budgets(vram=vram_for(engine, 0.5))
        assert not any(isinstance(layer.qkv, Q4Matrix) for layer in layers)
        assert (engine.score(PROMPT, "oracle") - before).abs().max().item() <= 1e-4
        engine.set_budgets(vram=0)
        assert all(isinstance(layer.qkv, Q4Matrix) for layer in layers)
        assert (engine.score(PROMPT, "oracle") - before).abs().max().item() <= 1e-4
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes


def test_int4_cpu_tier_runs_int8_predictors(tmp_path, llama_dir):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = Engine.load(model).config
    random_predictors(config).save(model)
    int4 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    int8 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int8")
    fp32 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    assert all(isinstance(w, Int8Matrix) for w in int4.sparse.predictors.fc1 + int4.sparse.predictors.fc2)
    x = torch.randn(len(PROMPT), config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in range(config.num_layers):
        same = int4.sparse.predictors.predict(layer, x) == fp32.sparse.predictors.predict(layer, x)
        assert same.float().mean() > 0.9
    assert int4.memory()["tiers"] == int4.sparse.plan.tier_bytes
    assert int4.memory()["ram_bytes"] < int8.memory()["ram_bytes"] < fp32.memory()["ram_bytes"]
    int4.eos_ids = set()
    out = int4.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))
    assert len(out.token_ids) == 8
    active, hot = int4.sparse.counters.fractions()
    assert 0.0 < active < 1.0 and hot == 0.0
    # a sparse prefill computes, per token, what decoding that token alone computes
    int4.reset()
    batched = int4.score(PROMPT, "sparse")
    steps = torch.cat([int4.model.forward(torch.tensor([t]), i, int4.cache) for i, t in enumerate(PROMPT)])
    assert (steps - batched).abs().max().item() <= 1e-4


def test_predictor_on_the_int4_tier_selects_what_its_original_selects():
    """Issue #30: an exact predictor (bench.vs_llamacpp's: fires ~10% at threshold 0) placed on
    the 4-bit tier selects at most 1.15x the neurons its fp32 original selects, keeping >= 95%
    of them. Its own 4-bit rows would not: at these shapes they keep ~88% (the logits lose
    their margin around the threshold), so the tier places it as int8 rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.vs_llamacpp import Shape, make_weights
    from engine.loading.predictors import PredictorSet
    from engine.kernels.quantized import quantize_matrix

    tensors, fc1s, fc2s = make_weights(Shape(512, 2048, 4, 512), 1, 64, 0.1, 0)
    emb = tensors["model.embed_tokens.weight"].float()[300:500]
    x = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()  # the layer's normed inputs at the first layer
    original = PredictorSet([fc1s[0]], [fc2s[0]], [0.0])
    wanted = original.predict(0, x)
    assert 0.05 < wanted.float().mean() < 0.15

    def figures(predictors):
        got = predictors.predict(0, x)
        return float(got.sum() / wanted.sum()), float((got & wanted).sum() / wanted.sum())

    placed = PredictorSet([fc1s[0].clone()], [fc2s[0].clone()], [0.0])
    placed.to(0, torch.device("cpu"), torch.float32, quant="int4")
    ratio, recall = figures(placed)
    assert ratio <= 1.15 and recall >= 0.95
    own_q4 = PredictorSet([quantize_matrix(fc1s[0], "int4")], [quantize_matrix(fc2s[0], "int4")], [0.0])
    assert figures(own_q4)[1] < 0.95  # what the int4 tier placed before
    # a file's own 4-bit predictors (PowerInfer's GGUF) keep their bytes on the 4-bit tier
    own_q4.to(0, torch.device("cpu"), torch.float32, quant="int4")
    assert isinstance(own_q4.fc1[0], Q4Matrix) and isinstance(own_q4.fc2[0], Q4Matrix)
