"""The sparse hybrid FFN: oracle exactness for every split, live re-placement, predictors."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

import model_factory as mf
from engine import BudgetError, Engine, SamplingParams
from engine.hotcold.activation_stats import ActivationStats
from engine.loading.predictors import PredictorSet
from engine.loading.predictor_import import import_powerinfer_predictors
from engine.kernels.quantized import Int8Matrix

FAMILIES = ["llama", "mistral", "falcon_mq", "falcon_new"]
PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
RAM = 1 << 30


def vram_for(engine: Engine, hot_fraction: float) -> int:
    """A VRAM budget that holds every dense part and `hot_fraction` of all neurons."""
    problem = engine.sparse.problem
    dense = problem.head_fast + sum(c.dense_fast + c.kv_fast for c in problem.layers)
    neurons = sum(len(f) for f in problem.frequencies)
    return dense + int(hot_fraction * neurons) * problem.neuron_fast


@pytest.fixture(scope="module")
def dense_refs(tiny_models):
    refs = {}
    for family in FAMILIES:
        engine = Engine.load(tiny_models[family])
        engine.eos_ids = set()
        logits = engine.score(PROMPT)
        tokens = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0)).token_ids
        refs[family] = (logits, tokens)
    return refs


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_equals_dense_for_every_split(tiny_models, dense_refs, family):
    ref_logits, ref_tokens = dense_refs[family]
    probe = Engine.load(tiny_models[family], mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="fp32")
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        engine = Engine.load(tiny_models[family], mode="oracle", vram_budget=vram_for(probe, fraction),
                             ram_budget=RAM, cpu_weights="fp32")
        hot = sum(len(layer.ffn.hot) for layer in engine.model.layers)
        total = engine.config.num_layers * engine.config.intermediate_size
        assert hot == int(fraction * total)
        assert (engine.score(PROMPT, "oracle") - ref_logits).abs().max().item() <= 1e-4
        engine.eos_ids = set()
        tokens = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0)).token_ids
        assert tokens == ref_tokens
        # decode (one token at a time through both tiers) too, not only the batched path
        engine.cache.reset(0)
        steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])
        assert (steps - ref_logits).abs().max().item() <= 1e-4


def test_replacement_during_generation_changes_no_token(llama_dir, dense_refs):
    _, ref_tokens = dense_refs["llama"]
    engine = Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="fp32")
    engine.eos_ids = set()
    plan = {2: 0.6, 6: 0.1, 9: 1.0, 12: 0.0}
    reports, hot_counts = [], []
    tokens = []
    for event in engine.stream(PROMPT, SamplingParams(max_new_tokens=16, temperature=0)):
        tokens.append(event.token_id)
        hot_counts.append(sum(len(layer.ffn.hot) for layer in engine.model.layers))
        if event.index in plan:  # from another thread, as the app's sliders do
            budget = vram_for(engine, plan[event.index]) if plan[event.index] else 0
            worker = threading.Thread(target=lambda b=budget: reports.append(engine.set_budgets(vram=b)))
            worker.start()
            worker.join()
    assert tokens == ref_tokens
    assert [r.applied for r in reports] == [False] * 4  # queued: applied at the next token boundary
    assert hot_counts[3] > 0 and hot_counts[7] < hot_counts[3] and hot_counts[10] == 2 * 160 and hot_counts[13] == 0


def test_replacement_moves_only_changed_rows_and_keeps_the_conversation(llama_dir):
    engine = Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="fp32")
    engine.set_budgets(vram=vram_for(engine, 0.5))
    layer = engine.model.layers[0]
    before_hot = set(layer.ffn.hot.ids.tolist())
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    first = engine.generate(PROMPT, params)
    cache_ptrs = [t.data_ptr() for t in engine.cache.k]
    report = engine.set_budgets(vram=vram_for(engine, 0.75))
    assert report.applied and report.allocated["fast_ffn"] == report.tier_bytes["fast_ffn"]
    assert before_hot <= set(layer.ffn.hot.ids.tolist())  # grown: old hot rows stay hot
    assert [t.data_ptr() for t in engine.cache.k] == cache_ptrs  # same device: the cache is untouched
    follow = engine.generate(PROMPT + first.token_ids + [3], params)
    # no re-prefill: all but the last answer token (never fed back) come from the cache
    assert engine.last_stats.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    fresh = Engine.load(llama_dir)
    fresh.eos_ids = set()
    assert fresh.generate(PROMPT + first.token_ids + [3], params).token_ids == follow.token_ids


def test_allocated_bytes_equal_the_plan_and_honour_budgets(llama_dir):
    for fraction in (0.0, 0.3, 1.0):
        probe = Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=RAM)
        budget = vram_for(probe, fraction)
        engine = Engine.load(llama_dir, mode="oracle", vram_budget=budget, ram_budget=RAM)
        memory = engine.memory()
        assert memory["tiers"] == engine.sparse.plan.tier_bytes
        assert memory["vram_bytes"] <= budget and memory["ram_bytes"] <= RAM


def test_too_small_ram_budget_says_the_minimum(llama_dir):
    with pytest.raises(BudgetError, match="at least"):
        Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=1000)
    engine = Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=RAM)
    with pytest.raises(BudgetError):
        engine.set_budgets(vram=0, ram=1000)
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=2)).stats.new_tokens >= 0  # still usable


def random_predictors(config, rank=16, seed=0, threshold=0.0) -> PredictorSet:
    g = torch.Generator().manual_seed(seed)
    return PredictorSet([torch.randn(rank, config.hidden_size, generator=g) for _ in range(config.num_layers)],
                        [torch.randn(config.intermediate_size, rank, generator=g) for _ in range(config.num_layers)],
                        [threshold] * config.num_layers)


def test_sparse_mode_computes_the_predicted_neurons(tmp_path, llama_dir):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    dense = Engine.load(model)
    everything = random_predictors(dense.config, threshold=-1e9)  # predicts every neuron: equals dense
    everything.save(model)
    engine = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    assert (engine.score(PROMPT, "sparse") - dense.score(PROMPT)).abs().max().item() <= 1e-4
    random_predictors(dense.config).save(model)
    engine = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    batched = engine.score(PROMPT, "sparse")
    assert (batched - dense.score(PROMPT)).abs().max().item() > 1e-3  # skipping neurons shows
    engine.cache.reset(0)
    steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])
    assert (steps - batched).abs().max().item() <= 1e-4  # decode computes exactly the predicted sets
    active, hot = engine.sparse.counters.fractions()
    assert 0.2 < active < 0.8 and hot == 0.0  # sparse mode: everything on the CPU


def test_int8_cold_rows_stay_close_to_dense(llama_dir):
    dense = Engine.load(llama_dir).score(PROMPT)
    int8 = Engine.load(llama_dir, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int8")
    assert (int8.score(PROMPT, "oracle") - dense).abs().max().item() < 0.05


@pytest.mark.parametrize("family", ["llama", "falcon_new"])
def test_int8_cpu_tier_holds_attention_and_head_as_int8_rows(tiny_models, dense_refs, family):
    """With int8 CPU weights the CPU tier's attention and (untied) head are int8 rows; the
    logits stay close to the fp32 model's, and a layer promoted to the fast tier and
    demoted again computes what it computed before."""
    model = tiny_models[family]
    engine = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int8")
    layers = engine.model.layers
    assert all(isinstance(layer.qkv, Int8Matrix) and isinstance(layer.out, Int8Matrix) for layer in layers)
    assert isinstance(engine.model.lm_head, Int8Matrix) != engine.config.tie_word_embeddings
    before = engine.score(PROMPT, "oracle")
    assert (before - dense_refs[family][0]).abs().max().item() < 0.05
    steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])
    assert (steps - before).abs().max().item() <= 1e-4  # one token (int8 kernel) = many (torch)
    engine.set_budgets(vram=vram_for(engine, 0.0))  # every dense part on the fast tier (the CPU here)
    assert not any(isinstance(layer.qkv, Int8Matrix) for layer in layers)
    assert (engine.score(PROMPT, "oracle") - before).abs().max().item() <= 1e-4
    engine.set_budgets(vram=0)
    assert all(isinstance(layer.qkv, Int8Matrix) for layer in layers)
    assert (engine.score(PROMPT, "oracle") - before).abs().max().item() <= 1e-5
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes


def test_int8_cpu_tier_runs_int8_predictors(tmp_path, llama_dir):
    """Predictors of CPU-tier layers are int8 rows too; they pick nearly the same neurons
    as the fp32 ones, and the bytes held are the plan's."""
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = Engine.load(model).config
    random_predictors(config).save(model)
    int8 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int8")
    fp32 = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    assert all(isinstance(w, Int8Matrix) for w in int8.sparse.predictors.fc1 + int8.sparse.predictors.fc2)
    assert not any(isinstance(w, Int8Matrix) for w in fp32.sparse.predictors.fc1)
    x = torch.randn(len(PROMPT), config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in range(config.num_layers):
        same = int8.sparse.predictors.predict(layer, x) == fp32.sparse.predictors.predict(layer, x)
        assert same.float().mean() > 0.97
    assert int8.memory()["tiers"] == int8.sparse.plan.tier_bytes
    assert int8.memory()["ram_bytes"] < fp32.memory()["ram_bytes"]


def test_powerinfer_predictor_import_orders_layers_by_number(tmp_path):
    model = mf.llama_relu(tmp_path / "m", layers=12, hidden=32, heads=4, kv_heads=2, ff=48)
    src = tmp_path / "powerinfer"
    src.mkdir()
    for n in range(12):
        torch.save({"fc1.weight": torch.full((8, 32), float(n)), "fc2.weight": torch.randn(48, 8)},
                   src / f"model_{n}.pt")
    (src / "config.json").write_text(json.dumps({"sparse_threshold": 0.25}))
    import_powerinfer_predictors(src, model)
    loaded = PredictorSet.load(model, 12, 32, 48)
    assert [int(w[0, 0]) for w in loaded.fc1] == list(range(12))  # layer 10 after layer 9, not after 1
    assert loaded.thresholds == [0.25] * 12 and loaded.source == "powerinfer"


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_powerinfer_import_refuses_pickled_objects(tmp_path, capsys):
    src = tmp_path / "p"
    src.mkdir()
    torch.save({"fc1.weight": torch.zeros(2, 2), "x": _RunsCodeWhenUnpickled()}, src / "model_0.pt")
    from engine import ModelFormatError

    with pytest.raises(ModelFormatError, match="safely"):
        import_powerinfer_predictors(src, tmp_path / "m")
    assert "must never run" not in capsys.readouterr().out


def test_statistics_drive_the_hot_set(tmp_path, llama_dir):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    counts = [torch.zeros(160, dtype=torch.float64) for _ in range(2)]
    counts[1][100:120] = 50  # twenty busy neurons in layer 1
    ActivationStats(counts, tokens=100).save(model)
    probe = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM)
    engine = Engine.load(model, mode="oracle", vram_budget=vram_for(probe, 20 / 320), ram_budget=RAM)
    assert engine.model.layers[1].ffn.hot.ids.tolist() == list(range(100, 120))
    assert engine.sparse.plan.hot_hit_fraction == pytest.approx(1.0)
