"""SmallThinker's experts placed by budget: hot experts on the fast tier (the CPU stands in
for the GPU here), cold experts on the CPU tier computed only when chosen, and inside a
chosen expert only the neurons whose relu(gate) fired."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import smallthinker_factory as sf
from engine import Engine, SamplingParams
from engine.activation_stats import ActivationStats
from engine.profiling import ProfileSettings, profile

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8, 250, 4, 42, 61, 90]
BIG = 1 << 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sf.smallthinker(tmp_path_factory.mktemp("st") / "m", seed=1, rope_layout=[1, 0, 1, 1],
                           window_layout=[0, 1, 0, 1], window=5)


def dense_part(engine) -> int:
    """VRAM that holds the head and every layer's dense part and KV cache, no expert."""
    plan = engine.sparse.solve(BIG, BIG)
    return plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"]


def expert_bytes(engine) -> int:
    return engine.sparse.problem.neuron_fast


@pytest.fixture(scope="module")
def dense(model):
    return Engine.load(model)


@pytest.mark.parametrize("experts_on_fast", [None, 0, 11, 32])  # None: not even the dense parts
def test_every_split_computes_the_dense_logits(model, dense, experts_on_fast, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    vram = 0 if experts_on_fast is None else dense_part(probe) + experts_on_fast * expert_bytes(probe)
    engine = Engine.load(model, mode="hybrid", vram_budget=vram, ram_budget=BIG, cpu_weights="fp32")
    tiers = engine.sparse.plan.summary()["experts_per_tier"]
    assert tiers == {"fast": experts_on_fast or 0, "cpu": 32 - (experts_on_fast or 0)}
    expected = dense.score(PROMPT)
    assert (engine.score(PROMPT, "hybrid") - expected).abs().max().item() <= 1e-4
    # decode, token by token, through both tiers' kernels
    dense.eos_ids = engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=10, temperature=0)
    assert engine.generate(PROMPT, params).token_ids == dense.generate(PROMPT, params).token_ids


def test_allocated_bytes_are_the_planned_bytes(model):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + 7 * expert_bytes(probe),
                         ram_budget=BIG)  # int8 CPU tier
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
    assert sum(len(layer.ffn.hot) for layer in engine.model.layers) == 7


def test_profile_counts_expert_use_and_the_solver_places_the_most_used(model, tmp_path, one_torch_thread):
    import shutil

    from model_factory import WORDS

    model = shutil.copytree(model, tmp_path / "m")  # the profile is written beside the model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS * 4))
    engine = Engine.load(model)
    result = profile(engine, [corpus], ProfileSettings(max_tokens=120, window=40))
    stats = ActivationStats.load(model)
    k = engine.config.experts_per_token
    for counts in stats.counts:  # every token chose k experts in every layer
        assert counts.shape == (8,) and counts.sum().item() == k * result.tokens
    freq = stats.frequencies()
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + 5 * expert_bytes(probe),
                         ram_budget=BIG)
    hot = [(i, e) for i, layer in enumerate(engine.model.layers) for e in layer.ffn.hot.ids.tolist()]
    assert len(hot) == 5
    chosen = min(float(freq[i][e]) for i, e in hot)
    left = max(float(freq[i][e]) for i, layer in enumerate(engine.model.layers) for e in layer.ffn.cold.ids.tolist())
    assert chosen >= left  # the five most chosen experts of the model are on the fast tier
    assert engine.sparse.plan.hot_hit_fraction > 5 / 32  # better than experts picked blindly


def test_budget_changes_move_experts_live_and_keep_the_conversation(model, dense, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    base, one = dense_part(probe), expert_bytes(probe)
    engine = Engine.load(model, mode="hybrid", vram_budget=base + 4 * one, ram_budget=BIG, cpu_weights="fp32")
    dense.eos_ids = engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    expected = dense.generate(PROMPT, params).token_ids
    assert engine.generate(PROMPT, params).token_ids == expected
    for experts in (20, 2, 32, 0):
        report = engine.set_budgets(base + experts * one, None)
        assert report.applied
        assert sum(len(layer.ffn.hot) for layer in engine.model.layers) == experts
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
        assert engine.generate(PROMPT, params).token_ids == expected


def test_decode_reads_only_chosen_experts_and_their_fired_neurons(model, one_torch_thread):
    """Poison (NaN) every expert a decode step does not choose, and inside the chosen ones
    the up and down rows of every neuron whose relu(gate) is 0: the step's logits stay
    exactly as they were, so none of those rows was read."""
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + 12 * expert_bytes(probe),
                         ram_budget=BIG, cpu_weights="fp32")
    layers = engine.model.layers
    seen = {}
    for i, layer in enumerate(layers):  # record what each layer's experts receive
        ffn = layer.ffn
        original = type(ffn).__call__

        def spy(x, routing, index, observer=None, _ffn=ffn, _original=original):
            seen[index] = (x.clone(), routing.experts.clone())
            return _original(_ffn, x, routing, index, observer)

        layer.ffn = _Spy(ffn, spy)
    cache = engine.cache
    engine.model.forward(torch.tensor(PROMPT), 0, cache)
    step = len(PROMPT)
    clean = engine.model.forward(torch.tensor([11]), step, cache)
    poisoned_rows = 0
    for i, layer in enumerate(layers):
        x, experts = seen[i]
        chosen = set(experts[0].tolist())
        ffn = layer.ffn.inner
        for e in range(ffn.num_experts):
            tier = ffn.hot if e in ffn.hot else ffn.cold
            rows = tier.cpu_rows[e] if tier is ffn.hot else tier.rows[e]
            if e not in chosen:
                for t in (rows.gate, rows.up, rows.down_t):
                    t.fill_(float("nan"))
                continue
            quiet = torch.relu(rows.gate @ x[0]) == 0
            rows.up[quiet] = float("nan")
            rows.down_t[quiet] = float("nan")
            poisoned_rows += int(quiet.sum())
    assert poisoned_rows > 0
    again = engine.model.forward(torch.tensor([11]), step, cache)
    assert torch.isfinite(again).all()
    assert torch.equal(again, clean)


class _Spy:
    """An FFN wrapper that calls `spy` in place of the FFN (and forwards the rest)."""

    def __init__(self, inner, spy):
        self.inner, self._spy = inner, spy

    def __call__(self, *args, **kwargs):
        return self._spy(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_counters_report_expert_hits_and_fired_neurons(model, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + 16 * expert_bytes(probe),
                         ram_budget=BIG)
    engine.eos_ids = set()
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))
    c = engine.sparse.counters
    assert c.experts_chosen == 7 * 4 * 2  # 7 decode steps (the first token comes from the prefill)
    assert result.stats.hot_hit_fraction == c.experts_hot / c.experts_chosen
    assert 0 < result.stats.ffn_active_fraction < 2 / 8  # below the chosen experts' share: ReGLU zeros
    hot = {(i, e) for i, layer in enumerate(engine.model.layers) for e in layer.ffn.hot.ids.tolist()}
    assert len(hot) == 16


def test_sparse_mode_keeps_every_expert_on_the_cpu_and_int8_stays_close(model, dense):
    engine = Engine.load(model, mode="sparse", ram_budget=BIG)
    assert engine.sparse.plan.summary()["experts_per_tier"] == {"fast": 0, "cpu": 32}
    assert engine.memory()["vram_bytes"] == 0
    expected = dense.score(PROMPT)
    got = engine.score(PROMPT, "sparse")
    # int8 rows may flip a close routing choice on random weights: compare in direction
    cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cos.min() > 0.9 and cos.mean() > 0.99


def test_place_cli_reports_experts_per_tier(model, capsys):
    from app.cli import main

    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    vram = dense_part(probe) + 9 * expert_bytes(probe)
    assert main(["place", "--model", str(model), "--vram-budget", str(vram), "--ram-budget", "1GiB",
                 "--device", "cpu", "--ctx", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unit"] == "experts" and out["experts_per_tier"] == {"fast": 9, "cpu": 23}
    assert sum(layer["hot_experts"] for layer in out["layers"]) == 9
    assert np.isclose(out["tier_bytes"]["fast_ffn"], 9 * expert_bytes(probe))
    assert main(["place", "--model", str(model), "--vram-budget", str(vram), "--ram-budget", "1GiB",
                 "--device", "cpu", "--ctx", "512"]) == 0
    assert "experts" in capsys.readouterr().out


def test_train_predictors_explains_a_mixture_needs_none(model):
    from engine.errors import UserError
    from engine.predictor_training import train_predictors

    with pytest.raises(UserError, match="mixture of experts"):
        train_predictors(model)


def test_eval_of_a_mixture_scores_sparse_as_dense_and_counts_experts(model, tmp_path, one_torch_thread):
    """No predictors: the router's choice is the sparse set; with fp32 CPU rows the sparse
    and oracle perplexities equal the dense one, and sparsity is 1 - k/E per layer."""
    from model_factory import WORDS

    from engine.evaluation import EvalSettings, evaluate

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(" ".join(WORDS[::-1] * 3))
    engine = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights="fp32", ctx=64)
    report = evaluate(engine, [heldout], EvalSettings(max_tokens=80, window=32))
    assert report["predictor_source"] == "router"
    assert report["ppl_sparse"] == pytest.approx(report["ppl_dense"], rel=1e-5)
    assert report["ppl_oracle"] == pytest.approx(report["ppl_dense"], rel=1e-5)
    assert report["sparsity"] == pytest.approx(1 - 2 / 8) and report["recall"] == 1.0
