"""TurboSparse-Mixtral (Mixtral with dReLU experts, each carrying its neuron predictor):
the published config, tiny models under the published tensor names against an fp64
reference written from the published modeling code, its predictors in every tier, the
bytes the placement counts, and the catalogue row."""

from __future__ import annotations

import pytest
import torch

import turbosparse_mixtral_factory as tf
from engine import Engine, SamplingParams
from engine.arch import parse_config
from engine.errors import ModelFormatError
from models_registry.catalogue import DTYPE_BYTES, get_entry
from models_registry.fit import shape_from_config

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8, 250, 4, 42, 61, 90]
BIG = 1 << 40
pytestmark = pytest.mark.usefixtures("exact_kv_cache")  # comparisons to 1e-4: the fp32 cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tf.turbosparse_mixtral(tmp_path_factory.mktemp("tsm") / "m", seed=0)


@pytest.fixture(scope="module")
def reference(model):
    return tf.Reference(model)


def test_the_published_config_is_a_mixture_of_drelu_experts_routed_after_attention():
    cfg = parse_config(tf.real_config())
    assert (cfg.arch, cfg.model_type, cfg.activation) == ("turbosparsemixtral", "turbosparsemixtral", "drelu")
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size) == (8, 2, 14336)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert cfg.router_softmax and cfg.router_input == "ffn"
    assert not cfg.tie_word_embeddings and cfg.vocab_size == 57024 and cfg.sliding_window is None
    assert cfg.rope.theta == 1e6 and cfg.eos_token_ids == (2,)


def test_the_published_predictor_ranks_give_the_published_checkpoint_size():
    """The published index's total_size is 103,592,501,248 bytes of bf16: 51,796,250,624
    parameters, of which 4,888,461,312 are the experts' predictors at the modeling code's ranks."""
    cfg = parse_config(tf.real_config())
    shape = shape_from_config(tf.real_config())
    assert sum(shape.expert_predictor_params) == 4_888_461_312 and len(cfg.expert_predictor_ranks) == 32
    assert shape.total_params * 2 == 103_592_501_248
    entry = get_entry("turbosparse-mixtral")
    assert entry.size_bytes == DTYPE_BYTES[entry.dtype] * shape.total_params == 103_592_501_248
    assert entry.predictor.source == "checkpoint" and entry.chat_format == "chatml"


def test_the_tiny_model_has_the_published_tensor_names(model):
    from safetensors import safe_open

    published = (tf.REAL_DIR / "tensors.txt").read_text().split()
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert published and set(published) <= names


@pytest.mark.parametrize("change", [{"num_experts_per_tok": 5}, {"hidden_act": "silu"}, {"num_local_experts": 0}])
def test_malformed_configs_are_refused(change):
    with pytest.raises(ModelFormatError):
        parse_config({**tf.tiny_config(), **change})


def test_the_predictors_choose_the_neurons_that_count(reference, model):
    """On this model the masks change the logits, and let through part of the neurons: a
    mode that ignored them could not pass the comparisons below."""
    with_masks = reference.forward(PROMPT)
    assert 0.3 < reference.selected / reference.considered < 0.8
    without = tf.Reference(model, masks=False).forward(PROMPT)
    assert (with_masks - without).abs().max() > 0.1 * with_masks.abs().max()


@pytest.mark.parametrize("mode", ["sparse", "hybrid"])
def test_sparse_and_hybrid_logits_match_the_fp64_reference(model, reference, mode, one_torch_thread):
    """Prefill and token-by-token decode, the fast tier holding some experts (hybrid) or none."""
    expected = reference.forward(PROMPT).float()
    vram = 0
    if mode == "hybrid":  # the dense parts and about a third of the experts' neurons
        probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG, cpu_weights="fp32")
        plan = probe.sparse.solve(BIG, BIG)
        problem = probe.sparse.problem
        vram = plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"] + \
            problem.neuron_fast * problem.expert_size * 4
    engine = Engine.load(model, mode=mode, vram_budget=vram, ram_budget=BIG, cpu_weights="fp32")
    if mode == "hybrid":
        assert 0 < engine.sparse.plan.summary()["experts_per_tier"]["fast"] < 12
    assert (engine.score(PROMPT, mode) - expected).abs().max().item() <= 1e-3
    prefill = engine.score(PROMPT[:5], mode)
    steps = [engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT[5:], start=5)]
    assert (torch.cat([prefill, *steps]) - expected).abs().max().item() <= 1e-3


def test_dense_and_oracle_modes_compute_every_neuron_of_the_chosen_experts(model, one_torch_thread):
    expected = tf.Reference(model, masks=False).forward(PROMPT).float()
    assert (Engine.load(model).score(PROMPT) - expected).abs().max().item() <= 1e-3
    sparse = Engine.load(model, mode="sparse", cpu_weights="fp32")
    assert (sparse.score(PROMPT, "oracle") - expected).abs().max().item() <= 1e-3


def test_24_greedy_tokens_match_the_reference(model, reference, one_torch_thread):
    expected = reference.greedy(PROMPT, 24)
    engine = Engine.load(model, mode="sparse", cpu_weights="fp32")
    engine.eos_ids = set()
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=24, temperature=0)).token_ids == expected


@pytest.mark.parametrize("cpu_weights", ["int8", "int4"])
def test_quantized_tiers_keep_int8_predictors_and_allocate_the_planned_bytes(model, reference, cpu_weights,
                                                                            one_torch_thread):
    from engine.kernels.quantized import Int8Matrix

    engine = Engine.load(model, mode="sparse", cpu_weights=cpu_weights)
    predictors = engine.model.layers[0].ffn.predictors
    assert all(isinstance(w, Int8Matrix) for w in (*predictors.fc1, *predictors.fc2))  # int8 on an int4 tier too
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes
    expected = reference.forward(PROMPT).float()
    error = (engine.score(PROMPT) - expected).abs().max().item() / expected.abs().max().item()
    assert error < (0.15 if cpu_weights == "int8" else 0.4)  # quantized weights (measured 0.09, 0.28), the same model
    engine.eos_ids = set()
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0))
    assert 0.0 < result.stats.ffn_active_fraction < 0.5  # 2 of 4 experts, then what their predictors let fire


def test_planned_bytes_with_experts_on_the_fast_tier(model, one_torch_thread):
    probe = Engine.load(model, mode="hybrid", vram_budget=0, ram_budget=BIG)
    plan = probe.sparse.solve(BIG, BIG)
    vram = plan.tier_bytes["fast_dense"] + plan.tier_bytes["fast_kv"]
    engine = Engine.load(model, mode="hybrid", vram_budget=vram // 2, ram_budget=BIG)  # some layers' dense parts
    assert 0 < sum(engine.sparse.plan.layer_on_fast) < 3
    assert engine.memory()["tiers"] == engine.sparse.plan.tier_bytes


def test_end_tokens_and_chat_template(model):
    engine = Engine.load(model)
    tok = engine.tokenizer
    assert tok.token_id("<|im_end|>") in engine.eos_ids
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
