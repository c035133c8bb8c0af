"""The 4-bit CPU tier (--cpu-weights int4): cold FFN rows, attention, untied head and
predictors as Q4_0 rows, decoded by the 4-bit kernels, against the fp32 model."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import Engine, SamplingParams
from engine.kernels import cpu_q4
from engine.kernels.cpu_q4 import Q4FfnRows
from engine.kernels.quantized import Q4Matrix

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


def test_int4_cpu_tier_runs_4bit_predictors(tmp_path, llama_dir):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = Engine.load(model).config
    random_predictors(config).save(model)
    int4 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")
    int8 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int8")
    fp32 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    assert all(isinstance(w, Q4Matrix) for w in int4.sparse.predictors.fc1 + int4.sparse.predictors.fc2)
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
