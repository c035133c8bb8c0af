"""The engine with a real GPU as the fast device (skipped where torch sees no CUDA).

Run on a lent GPU machine by bench/gpu.sh. 16-bit weights on the GPU: tolerances are those
of fp16 arithmetic, and tokens are compared over a short horizon.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
RAM = 1 << 30


def vram_for(engine, hot_fraction):
    problem = engine.sparse.problem
    dense = problem.head_fast + sum(c.dense_fast + c.kv_fast for c in problem.layers)
    return dense + int(hot_fraction * sum(len(f) for f in problem.frequencies)) * problem.neuron_fast


@pytest.mark.parametrize("family", ["llama", "mistral", "falcon_new"])
def test_dense_on_cuda_matches_the_cpu(tiny_models, family):
    cpu = Engine.load(tiny_models[family]).score(PROMPT)
    gpu = Engine.load(tiny_models[family], device="cuda").score(PROMPT)
    assert (gpu.cpu() - cpu).abs().max().item() < 2e-2


@pytest.mark.parametrize("family", ["llama", "mistral", "falcon_new"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_hybrid_oracle_on_cuda_matches_dense(tiny_models, family, fraction):
    dense = Engine.load(tiny_models[family], device="cuda")
    probe = Engine.load(tiny_models[family], mode="oracle", device="cuda", vram_budget=0, ram_budget=RAM)
    engine = Engine.load(tiny_models[family], mode="oracle", device="cuda", vram_budget=vram_for(probe, fraction),
                         ram_budget=RAM, cpu_weights="fp32")
    assert engine.sparse.plan.head_on_fast
    ref = dense.score(PROMPT).cpu()
    engine.cache.reset(0)
    steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])
    assert (steps.cpu() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("cpu_weights", ["fp32", "int8"])  # int8: layers move between int8 rows and fp16
def test_budget_moves_layers_between_gpu_and_cpu_mid_generation(llama_dir, cpu_weights):
    engine = Engine.load(llama_dir, mode="oracle", device="cuda", vram_budget=0, ram_budget=RAM,
                         cpu_weights=cpu_weights)
    engine.eos_ids = set()
    full = vram_for(engine, 1.0)
    devices = []
    for event in engine.stream(PROMPT, SamplingParams(max_new_tokens=12, temperature=0)):
        devices.append(engine.model.layers[0].device.type)
        if event.index == 2:
            engine.set_budgets(vram=full)
        if event.index == 7:
            engine.set_budgets(vram=0)
    assert engine.last_stats.new_tokens == 12
    assert "cuda" in devices and devices[-1] == "cpu"
    assert torch.cuda.memory_allocated() < full  # what moved back was freed
