"""4-bit hot rows (engine.hotcold.hot_q4): with a CUDA fast tier and int4 CPU weights the
hot tier stores Q4_0 rows and computes them with the Triton q4 kernels; placement counts
their bytes. No GPU here: THERMOCLINE_HOT_WEIGHTS=int4 puts the same rows on the CPU
standing in for the fast device, where they run in cpu_q4's kernels, in its torch
fallback, and (TRITON_INTERPRET=1) in the Triton kernels, each checked against fp64."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from engine import Engine
from engine.arch import read_config
from engine.hotcold import hot_q4
from engine.hotcold.placement import INDEX_BYTES, ModelBytes, build_problem
from engine.hotcold.sparse_solve import placement_problem
from engine.kernels import cpu_q4, q4_format, q4_quantize
from engine.kernels.q4_format import row_bytes
from engine.loading.weights import WeightSource

from test_sparse import PROMPT, RAM, random_predictors, vram_for

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_placement_counts_4bit_hot_rows(llama_dir):
    config = read_config(llama_dir)
    d = config.hidden_size
    model = ModelBytes.from_config(config)
    freqs = [np.ones(config.intermediate_size)] * config.num_layers
    f16 = build_problem(model, [0] * config.num_layers, freqs, 64, 2, 2, "int4")
    q4 = build_problem(model, [0] * config.num_layers, freqs, 64, 2, 2, "int4", hot_weights="int4")
    assert f16.neuron_fast == 3 * d * 2 + INDEX_BYTES
    assert q4.neuron_fast == 3 * row_bytes(d) + INDEX_BYTES
    # the engine's problem: a CUDA fast tier with int4 CPU weights holds 4-bit hot rows
    cuda = torch.device("cuda:0")
    assert placement_problem(config, [0] * 2, freqs, 64, cuda, torch.float16, "int4").neuron_fast == q4.neuron_fast
    assert placement_problem(config, [0] * 2, freqs, 64, cuda, torch.float16, "int8").neuron_fast == f16.neuron_fast
    assert hot_q4.hot_weights(cuda, "int4") == "int4" and hot_q4.hot_weights(torch.device("cpu"), "int4") is None


def _fp64_ffn(x, gate, up, down_t, mask, activation):
    """The FFN over dequantized rows in float64 (relu family of the tiny models)."""
    x = x.double()
    u = up.double() @ x
    if gate is not None:
        a = torch.relu(gate.double() @ x) * (torch.relu(u) if activation == "drelu" else u)
    else:
        a = torch.relu(u)
    return (a * mask) @ down_t.double()


@pytest.fixture
def q4_hot_engine(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(hot_q4.HOT_WEIGHTS_ENV, "int4")
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)  # fp32 activations: tight bounds
    import shutil

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    config = read_config(model)
    random_predictors(config).save(model)
    probe = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    engine = Engine.load(model, mode="oracle", vram_budget=vram_for(probe, 0.5), ram_budget=RAM,
                         cpu_weights="int4")
    return engine, model


BACKENDS = ["cpu_kernels", "torch_fallback"] + (["triton_interpret"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_4bit_hot_rows_decode_against_fp64(q4_hot_engine, backend, monkeypatch):
    engine, model = q4_hot_engine
    if backend == "torch_fallback":
        monkeypatch.setattr(cpu_q4, "_kernels", lambda: None)
    if backend == "triton_interpret":
        monkeypatch.setattr(hot_q4, "TRITON_ON_CPU", True)
    source = WeightSource(model)
    g = torch.Generator().manual_seed(1)
    layers = engine.model.layers
    assert 0 < sum(len(layer.ffn.hot) for layer in layers) < sum(layer.ffn.n_ff for layer in layers)
    for i, layer in enumerate(layers):
        ffn = layer.ffn
        hot = ffn.hot
        assert isinstance(hot, hot_q4.Q4HotRows)
        if not len(hot):
            continue
        # the hot rows are Q4_0 rows of the checkpoint's weights (ggml's rounding), 4-bit bytes
        p = f"model.layers.{i}.mlp."
        ids = hot.ids.cpu()
        assert torch.equal(hot.q_up, q4_quantize.quantize_rows_q4(source.get(p + "up_proj.weight")[ids]))
        assert torch.equal(hot.q_down, q4_quantize.quantize_rows_q4(source.get(p + "down_proj.weight").t()[ids]))
        assert hot.nbytes == len(hot) * (3 * row_bytes(engine.config.hidden_size) + 8)
        gate, up, down_t = hot.fp32_rows()
        x = torch.randn(engine.config.hidden_size, generator=g)
        # oracle: every hot neuron; predicted: those whose layer logits reach the threshold
        y = ffn._hot_decode(x, None)
        ref = _fp64_ffn(x, gate, up, down_t, torch.ones(len(hot), dtype=torch.float64), ffn.activation)
        assert (y.cpu().double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
        logits = torch.randn(ffn.n_ff, generator=g)
        y = ffn._hot_decode(x, logits)
        mask = (logits[ids] >= ffn.context.threshold).double()
        assert 0 < mask.sum() < len(hot)
        ref = _fp64_ffn(x, gate, up, down_t, mask, ffn.activation)
        assert (y.cpu().double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


def test_4bit_hot_rows_in_the_engine_and_between_tiers(q4_hot_engine):
    engine, model = q4_hot_engine
    cold = Engine.load(model, mode="oracle", vram_budget=0, ram_budget=RAM, cpu_weights="int4")

    def steps(e):  # decode, one token at a time: the 4-bit hot rows' kernels
        e.reset()
        return torch.cat([e.model.forward(torch.tensor([t]), i, e.cache) for i, t in enumerate(PROMPT)])

    # decoding (4-bit kernels) equals the batched path (torch over the dequantized rows)
    assert (steps(engine) - engine.score(PROMPT, "oracle")).abs().max().item() <= 1e-4
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes

    def codes(e):  # every neuron's 4-bit up rows, in neuron order, from both tiers
        out = []
        for layer in e.model.layers:
            rows = torch.empty(layer.ffn.n_ff, row_bytes(e.config.hidden_size), dtype=torch.uint8)
            rows[layer.ffn.cold.ids] = layer.ffn.cold.rows.up
            if len(layer.ffn.hot):
                rows[layer.ffn.hot.ids.cpu()] = layer.ffn.hot.q_up.cpu()
            out.append(rows)
        return out

    want = codes(cold)
    assert all(torch.equal(a, b) for a, b in zip(codes(engine), want))
    # neurons move as codes, never requantized, and the model stays the same
    hot_counts = set()
    for fraction in (0.2, 0.8):
        engine.set_budgets(vram=vram_for(engine, fraction))
        hot_counts.add(sum(len(layer.ffn.hot) for layer in engine.model.layers))
        assert all(isinstance(layer.ffn.hot, hot_q4.Q4HotRows) for layer in engine.model.layers)
        assert all(torch.equal(a, b) for a, b in zip(codes(engine), want))
        assert (steps(engine) - engine.score(PROMPT, "oracle")).abs().max().item() <= 1e-4
        assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
    assert len(hot_counts) == 2
    # all back to the CPU: the all-cold engine's model, to float rounding
    engine.set_budgets(vram=0)
    assert all(torch.equal(a, b) for a, b in zip(codes(engine), want))
    assert (steps(engine) - steps(cold)).abs().max().item() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA fast tier")
def test_cuda_fast_tier_with_int4_cpu_weights_holds_4bit_hot_rows(llama_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.delenv(hot_q4.HOT_WEIGHTS_ENV, raising=False)
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    random_predictors(read_config(model)).save(model)
    probe = Engine.load(model, mode="oracle", device="cuda", vram_budget=0, ram_budget=RAM, cpu_weights="int4")
    engine = Engine.load(model, mode="oracle", device="cuda", vram_budget=vram_for(probe, 0.5), ram_budget=RAM,
                         cpu_weights="int4")
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
    g = torch.Generator().manual_seed(2)
    tested = 0
    for layer in engine.model.layers:
        hot = layer.ffn.hot
        assert isinstance(hot, hot_q4.Q4HotRows) and hot.device.type == "cuda"
        if not len(hot):
            continue
        gate, up, down_t = hot.fp32_rows()
        x = torch.randn(engine.config.hidden_size, generator=g)
        logits = torch.randn(layer.ffn.n_ff, generator=g)
        y = layer.ffn._hot_decode(x.cuda().half(), logits.cuda())
        mask = (logits[hot.ids.cpu()] >= layer.ffn.context.threshold).double()
        ref = _fp64_ffn(x.half().float(), gate, up, down_t, mask, layer.ffn.activation)
        assert (y.cpu().double() - ref).abs().max() <= 1e-3 * (1 + ref.abs().max())
        tested += 1
    assert tested


def test_a_prefill_dequantizes_each_4bit_hot_matrix_once(q4_hot_engine, monkeypatch):
    """The batched path reads the hot rows' dtype and width as metadata and dequantizes each of
    gate, up, down once per layer (not on every attribute read), with the same result."""
    engine, _ = q4_hot_engine
    want = engine.score(PROMPT, "oracle")
    hot_codes = {}
    for i, layer in enumerate(engine.model.layers):
        for q in (layer.ffn.hot.q_gate, layer.ffn.hot.q_up, layer.ffn.hot.q_down):
            if q is not None and len(layer.ffn.hot):
                hot_codes[q.data_ptr()] = i
    calls = []
    real = q4_format.dequantize_rows_q4

    def counting(q, dim, *args, **kwargs):
        if q.data_ptr() in hot_codes:
            calls.append(hot_codes[q.data_ptr()])
        return real(q, dim, *args, **kwargs)

    monkeypatch.setattr(q4_format, "dequantize_rows_q4", counting)
    got = engine.score(PROMPT, "oracle")
    assert torch.equal(got, want)
    layers_with_hot = sorted(set(hot_codes.values()))
    assert layers_with_hot and sorted(calls) == sorted(layers_with_hot * 3)  # gate, up, down: once each
