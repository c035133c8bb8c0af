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
from engine.hotcold.activation_stats import ActivationStats
from engine.calibration.profiling import ProfileSettings, profile

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8, 250, 4, 42, 61, 90]
BIG = 1 << 40
# Logits compared across tiers within fp32's reordering bound: the fp32 KV cache, so both sides
# keep the same K/V bits (fp16 rounding flips where fp32 noise sits on a rounding boundary).
pytestmark = pytest.mark.usefixtures("exact_kv_cache")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sf.smallthinker(tmp_path_factory.mktemp("st") / "m", seed=1, rope_layout=[1, 0, 1, 1],
                           window_layout=[0, 1, 0, 1], window=5)


def dense_part(engine) -> int:
    """VRAM that holds the head and every layer's dense part and KV cache, no expert."""
    plan = engine.sparse.solve(BIG, BIG)
    return plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"]


def expert_bytes(engine) -> int:
    """VRAM of one whole expert (the placement's unit is one neuron of one expert)."""
    problem = engine.sparse.problem
    return problem.neuron_fast * problem.expert_size


@pytest.fixture(scope="module")
def dense(model):
    return Engine.load(model)


@pytest.mark.parametrize("experts_on_fast", [None, 0, 11, 32])  # None: not even the dense parts
def test_every_split_computes_the_dense_logits(model, dense, experts_on_fast, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    vram = 0 if experts_on_fast is None else dense_part(probe) + experts_on_fast * expert_bytes(probe)
    engine = Engine.load(model, mode="hybrid", vram_budget=vram, ram_budget=BIG, cpu_weights="fp32")
    tiers = engine.sparse.plan.summary()["experts_per_tier"]
    assert tiers == {"fast": experts_on_fast or 0, "split": 0, "cpu": 32 - (experts_on_fast or 0)}
    expected = dense.score(PROMPT)
    # the same sums in other orders (gathered experts' shapes pick other GEMM blockings)
    bound = sf.Reference(model).reorder_bound(PROMPT)
    assert (engine.score(PROMPT, "hybrid") - expected).abs().max().item() <= bound
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


def test_profile_counts_expert_use_and_neuron_firing_and_the_solver_places_the_hottest(model, tmp_path,
                                                                                       one_torch_thread):
    import shutil

    from model_factory import WORDS

    from engine.model.moe import placement_frequencies

    model = shutil.copytree(model, tmp_path / "m")  # the profile is written beside the model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS * 4))
    engine = Engine.load(model)
    result = profile(engine, [corpus], ProfileSettings(max_tokens=120, window=40))
    stats = ActivationStats.load(model)
    k, n = engine.config.experts_per_token, engine.config.intermediate_size
    for counts, fired in zip(stats.counts, stats.expert_neurons):
        assert counts.shape == (8,) and counts.sum().item() == k * result.tokens  # every token chose k
        assert fired.shape == (8, n)
        assert (fired <= counts[:, None]).all()  # a neuron fires only on tokens that chose its expert
        assert 0 < fired.sum().item() < counts.sum().item() * n  # ReGLU: some neurons stay quiet
    freq = placement_frequencies(stats, 8, n, engine.config.num_layers)
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    units = 5 * n + n // 2  # five and a half experts' worth of neurons
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + units * probe.sparse.problem.neuron_fast,
                         ram_budget=BIG)
    hot = [(i, u) for i, layer in enumerate(engine.model.layers) for u in layer.ffn.hot.unit_ids(n).tolist()]
    cold = [(i, u) for i, layer in enumerate(engine.model.layers) for u in layer.ffn.cold.unit_ids(n).tolist()]
    assert len(hot) == units and len(hot) + len(cold) == 4 * 8 * n
    assert min(freq[i][u] for i, u in hot) >= max(freq[i][u] for i, u in cold)  # the hottest units are fast
    assert engine.sparse.plan.hot_hit_fraction > units / (4 * 8 * n)  # better than units picked blindly
    assert engine.sparse.plan.summary()["experts_per_tier"]["split"] > 0  # hot neurons of experts kept apart


def test_budget_changes_move_experts_live_and_keep_the_conversation(model, dense, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    base, one = dense_part(probe), expert_bytes(probe)
    engine = Engine.load(model, mode="hybrid", vram_budget=base + 4 * one, ram_budget=BIG, cpu_weights="fp32")
    dense.eos_ids = engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    expected = dense.generate(PROMPT, params).token_ids
    assert engine.generate(PROMPT, params).token_ids == expected
    neuron = engine.sparse.problem.neuron_fast
    for experts in (20, 2, 32, 0, 3.5, 7.25, 1.5):  # fractions: an expert split between the tiers
        report = engine.set_budgets(base + int(experts * 32) * neuron, None)
        assert report.applied
        assert sum(layer.ffn.hot.neurons(e) for layer in engine.model.layers for e in layer.ffn.hot.ids) \
            == int(experts * 32)
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
        assert engine.generate(PROMPT, params).token_ids == expected


def test_decode_reads_only_chosen_experts_and_their_fired_neurons(model, one_torch_thread):
    """Poison (NaN) every expert a decode step does not choose, and inside the chosen ones
    the up and down rows of every neuron whose relu(gate) is 0: the step's logits stay
    exactly as they were, so none of those rows was read."""
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    engine = Engine.load(model, mode="hybrid", ram_budget=BIG, cpu_weights="fp32",
                         vram_budget=dense_part(probe) + 12 * expert_bytes(probe) + 16 * probe.sparse.problem.neuron_fast)
    assert engine.sparse.plan.summary()["experts_per_tier"]["split"] == 1  # half an expert on each tier
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
            for tier in (t for t in (ffn.hot, ffn.cold) if e in t):
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
    assert engine.sparse.plan.summary()["experts_per_tier"] == {"fast": 0, "split": 0, "cpu": 32}
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
    assert out["unit"] == "experts" and out["experts_per_tier"] == {"fast": 9, "split": 0, "cpu": 23}
    assert sum(layer["hot_experts"] for layer in out["layers"]) == 9
    assert np.isclose(out["tier_bytes"]["fast_ffn"], 9 * expert_bytes(probe))
    assert main(["place", "--model", str(model), "--vram-budget", str(vram), "--ram-budget", "1GiB",
                 "--device", "cpu", "--ctx", "512"]) == 0
    assert "experts" in capsys.readouterr().out


def test_train_predictors_explains_a_mixture_needs_none(model):
    from engine.errors import UserError
    from engine.calibration.predictor_training import train_predictors

    with pytest.raises(UserError, match="mixture of experts"):
        train_predictors(model)


def test_eval_of_a_mixture_scores_sparse_as_dense_and_counts_experts(model, tmp_path, one_torch_thread):
    """No predictors: the router's choice is the sparse set; with fp32 CPU rows the sparse
    and oracle perplexities equal the dense one, and sparsity is 1 - k/E per layer."""
    from model_factory import WORDS

    from engine.calibration.evaluation import EvalSettings, evaluate

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(" ".join(WORDS[::-1] * 3))
    engine = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights="fp32", ctx=64)
    report = evaluate(engine, [heldout], EvalSettings(max_tokens=80, window=32))
    assert report["predictor_source"] == "router"
    assert report["ppl_sparse"] == pytest.approx(report["ppl_dense"], rel=1e-5)
    assert report["ppl_oracle"] == pytest.approx(report["ppl_dense"], rel=1e-5)
    assert report["sparsity"] == pytest.approx(1 - 2 / 8) and report["recall"] == 1.0


def test_int4_experts_hold_the_planned_bytes_and_match_their_dequantized_rows(model, dense, one_torch_thread,
                                                                            monkeypatch):
    """4-bit (Q4_0) cold experts: the bytes held are the planned ones (4-bit rows, a 4-bit
    copy of the tied head), a decode step's expert output is the fp32 computation over the
    dequantized rows, and the logits keep the dense model's direction."""
    engine = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights="int4")
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
    ffn = engine.model.layers[0].ffn
    assert all(rows.quant == "int4" for rows in ffn.cold.rows.values())
    x = torch.randn(1, engine.config.hidden_size, generator=torch.Generator().manual_seed(3))
    from engine.model.moe import reglu, route

    routing = route(engine.model.layers[0].router, x, engine.config.experts_per_token, engine.config.router_softmax)
    expected = torch.zeros(x.shape[1], dtype=torch.float64)
    for e, w in zip(routing.experts[0].tolist(), routing.weights[0].tolist()):
        g, u, d = (t.double() for t in ffn.cold.rows[e].dequantized())
        expected += reglu(x[0].double()[None], g, u, d)[0] * w
    from engine.kernels import cpu_q4

    # On AVX2 hosts the kernels round the activation to 8-bit blocks, as llama.cpp's Q4_0 x Q8_0
    # does: within that rounding. With fp32 activations: the fp32 computation itself.
    got = ffn(x, routing, 0)
    assert (got[0].double() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    with monkeypatch.context() as m:
        m.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
        got = ffn(x, routing, 0)
    assert (got[0].double() - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    assert engine.sparse.counters.expert_bytes > 0
    cos = torch.nn.functional.cosine_similarity(engine.score(PROMPT, "sparse"), dense.score(PROMPT), dim=-1)
    assert cos.min() > 0.8 and cos.mean() > 0.9  # 4 bits on a tiny random model: direction only
    engine.eos_ids = set()
    assert len(engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0)).token_ids) == 4


def test_the_profile_observer_counts_firing_inside_each_chosen_expert():
    """DenseMoe reports, per chosen expert, on how many of the tokens that chose it each
    neuron fired: checked against a plain fp64 computation."""
    from engine.model.moe import DenseMoe, route

    g = torch.Generator().manual_seed(5)
    experts, n, d, t = 6, 16, 24, 11
    moe = DenseMoe(*(torch.randn(experts, n, d, generator=g) for _ in range(3)))
    router = torch.randn(experts, d, generator=g)
    x = torch.randn(t, d, generator=g)
    routing = route(router, x, 2, False)

    class Observer:
        def __init__(self):
            self.fired = torch.zeros(experts, n, dtype=torch.float64)

        def __call__(self, layer, inputs, act):
            assert act.shape == (t, experts)

        def expert_neurons(self, layer, e, fired):
            self.fired[e] += fired.double()

    observer = Observer()
    moe(x, routing, 0, observer)
    expected = torch.zeros(experts, n, dtype=torch.float64)
    for e in range(experts):
        tokens = (routing.experts == e).any(1)
        xs = x[tokens].double()
        act = torch.relu(xs @ moe.gate[e].double().T) * (xs @ moe.up[e].double().T)
        expected[e] = (act != 0).sum(0).double()
    assert torch.equal(observer.fired, expected)
    assert 0 < expected.sum() < 2 * t * n


def test_pre_attention_prefetch_reads_the_chosen_cold_experts_while_attention_runs(model, dense, monkeypatch,
                                                                                   one_torch_thread):
    """With prefetching on, each decode layer hands the worker the gate rows of exactly
    its chosen cold experts before its attention starts; the tokens stay the dense ones."""
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    monkeypatch.setenv("THERMOCLINE_MOE_PREFETCH", "1")
    engine = Engine.load(model, mode="hybrid", vram_budget=dense_part(probe) + 10 * expert_bytes(probe),
                         ram_budget=BIG, cpu_weights="fp32")
    prefetcher = engine.sparse.prefetcher
    assert prefetcher is not None
    events = []
    original_start, original_attention = prefetcher.start, engine.model._attention

    def start(rows):
        events.append(("prefetch", [id(r) for r in rows]))
        original_start(rows)

    def attention(index, *args):
        events.append(("attention", index))
        return original_attention(index, *args)

    monkeypatch.setattr(prefetcher, "start", start)
    monkeypatch.setattr(engine.model, "_attention", attention)
    dense.eos_ids = engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=4, temperature=0)
    expected = dense.generate(PROMPT, params).token_ids
    assert engine.generate(PROMPT, params).token_ids == expected
    c = engine.sparse.counters
    # per decode layer: the prefetch of its chosen cold experts came right before its attention
    decode = [i for i, ev in enumerate(events) if ev[0] == "prefetch"]
    assert decode and all(events[i + 1][0] == "attention" for i in decode)
    cold_chosen = c.experts_chosen - round(c.experts_hot)
    assert sum(len(events[i][1]) for i in decode) == cold_chosen
    gate_bytes = 32 * engine.config.hidden_size * 4  # fp32 gate rows of one expert
    assert c.prefetched_bytes == cold_chosen * gate_bytes
    assert c.prefetch_wait_s >= 0.0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_decode_bytes_are_the_chosen_experts_fired_rows_and_no_more(model, quant, one_torch_thread, monkeypatch):
    """Count the bytes a decode step reads from the experts: every gate row of the k chosen
    experts and the up and down rows of their neurons that fire (recomputed here from the
    layer's input), which is at most the k chosen experts whole; the dense parts read are
    attention, router and norms. Nothing else is read per layer."""
    from engine.kernels import cpu_q4, q4_format
    from engine.hotcold.moe_tiers import row_bytes

    # fp32 activations, so the neurons recounted here from x fire exactly where the kernel's do
    # (8-bit activation rounding can flip a gate that is within a rounding step of zero).
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    engine = Engine.load(model, mode="sparse", ram_budget=BIG, cpu_weights=quant)
    cfg = engine.config
    seen = {}
    for layer in engine.model.layers:
        ffn = layer.ffn

        def spy(x, routing, index, observer=None, _ffn=ffn):
            seen[index] = (x.clone(), routing.experts[0].tolist())
            return type(_ffn).__call__(_ffn, x, routing, index, observer)

        layer.ffn = _Spy(ffn, spy)
    engine.model.forward(torch.tensor(PROMPT), 0, engine.cache)
    engine.sparse.begin_generation()
    engine.model.forward(torch.tensor([11]), len(PROMPT), engine.cache)
    read = engine.sparse.counters.expert_bytes
    expected = whole = 0
    for i, layer in enumerate(engine.model.layers):
        x, chosen = seen[i]
        for e in chosen:
            rows = layer.ffn.inner.cold.rows[e]
            g, u, _ = rows.dequantized()
            xe = x[0].float()
            if quant == "int4":  # the kernel reads x padded to whole blocks: same sums
                xe = q4_format.padded(xe, rows.dim)[: rows.dim]
            fired = int(((torch.relu(g @ xe) * (u @ xe)) != 0).sum())
            expected += (cfg.intermediate_size + 2 * fired) * row_bytes(rows)
            whole += 3 * cfg.intermediate_size * row_bytes(rows)
    assert read == expected
    assert 0 < read < whole  # ReGLU zeros cut the bytes below the chosen experts whole


def test_a_split_expert_on_a_torch_fast_tier_adds_up_to_the_whole_expert(model, dense, one_torch_thread):
    """The fast tier's torch path (a GPU's; here fp64 on the CPU, so no kernel stands in):
    an expert split between it and the CPU tier, for one token and for many, equals the
    whole expert in fp64, before and after a re-split."""
    from engine.model.moe import Routing, reglu
    from engine.hotcold.moe_tiers import HotExperts

    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    neuron = probe.sparse.problem.neuron_fast
    engine = Engine.load(model, mode="hybrid", ram_budget=BIG, cpu_weights="fp32",
                         vram_budget=dense_part(probe) + (3 * 32 + 16) * neuron)
    ffn = engine.model.layers[0].ffn
    torch_tier = HotExperts(torch.device("cpu"), torch.float64)
    assert not torch_tier.on_cpu
    for e in ffn.hot.ids.tolist():
        torch_tier.add(e, *ffn.hot.pop(e))
    ffn.hot = torch_tier
    assert ffn.hot.neurons(3) == 16 and ffn.cold.neurons(3) == 16  # expert 3 is split
    whole = dense.model.layers[0].ffn
    g = torch.Generator().manual_seed(8)

    def check(tokens: int):
        x = torch.randn(tokens, engine.config.hidden_size, generator=g)
        experts = torch.tensor([[3, 1]] * tokens)
        weights = torch.tensor([[0.6, 0.4]] * tokens)
        expected = sum(w * reglu(x.double(), *(t.double() for t in whole.expert(e)))
                       for e, w in ((3, 0.6), (1, 0.4)))
        got = ffn(x, Routing(x, experts, weights), 0)
        assert (got.double() - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()

    check(1)
    check(3)
    n = engine.config.intermediate_size
    engine.sparse._move_neurons(ffn, np.array(list(range(0, 2 * n)) + list(range(3 * n + 8, 3 * n + 24))))
    assert ffn.hot.neurons(2) == 0 and ffn.hot.neurons(3) == 16 and ffn.cold.neurons(2) == n
    assert ffn.hot.neuron_ids[3].tolist() == list(range(8, 24))
    check(1)
    check(12)  # more tokens than the kernel takes: the dense matmuls over each part


def _prefetch_threads() -> list:
    import gc
    import threading

    from engine.hotcold.moe_tiers import ColdPrefetcher

    gc.collect()  # an earlier test's unreferenced engine ends its thread when collected, not at a random later point
    return [t for t in threading.enumerate() if t.name == ColdPrefetcher.THREAD_NAME and t.is_alive()]


def test_prefetch_thread_lives_as_long_as_its_engine(model, monkeypatch):
    """The pre-attention prefetcher's thread ends when its engine closes (or turns
    prefetching off); no thread is left behind an unloaded model."""
    monkeypatch.setenv("THERMOCLINE_MOE_PREFETCH", "1")
    before = len(_prefetch_threads())
    engine = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
    assert len(_prefetch_threads()) == before + 1
    engine.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=0))  # the thread did work
    assert engine.sparse.counters.prefetched_bytes > 0
    engine.close()
    assert len(_prefetch_threads()) == before and engine.sparse.prefetcher is None
    engine.close()  # idempotent
    with Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32") as second:
        assert len(_prefetch_threads()) == before + 1
        first_finalizer = second.sparse._prefetch_finalizer
        second.sparse.set_prefetch(False)
        assert len(_prefetch_threads()) == before
        assert not first_finalizer.alive  # detached with its prefetcher: toggling does not pile them up
        second.sparse.set_prefetch(True)
        assert len(_prefetch_threads()) == before + 1
        assert second.sparse._prefetch_finalizer.alive and second.sparse._prefetch_finalizer is not first_finalizer
    assert len(_prefetch_threads()) == before


def test_the_window_worker_ends_the_prefetch_thread_on_reload_and_on_shutdown(model, monkeypatch, qtbot):
    from app.gui.worker import EngineClient

    monkeypatch.setenv("THERMOCLINE_MOE_PREFETCH", "1")
    before = len(_prefetch_threads())
    client = EngineClient()
    try:
        for _ in range(2):  # a reload unloads the first engine
            client.model_info = None
            client.load(str(model), mode="hybrid", ctx=64, vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
            qtbot.waitUntil(lambda: client.model_info is not None, timeout=120_000)
            assert client.model_info.get("mode") == "hybrid"
            assert len(_prefetch_threads()) == before + 1
    finally:
        assert client.shutdown(30_000)
    assert len(_prefetch_threads()) == before
