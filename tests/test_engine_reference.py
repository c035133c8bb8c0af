"""Our engine against `transformers` on tiny random models of every supported family."""

from __future__ import annotations

import pytest
import torch

import model_factory as mf
from engine import Engine, SamplingParams

FAMILIES = ["llama", "mistral", "falcon_mq", "falcon_new"]
PROMPT = [0, 5, 9, 17, 33, 100, 7, 8, 250, 3, 42]
# Exact comparisons (1e-4 on the logits, equal greedy tokens) run on the fp32 KV cache; the
# fp16 default is checked against the same reference within FP16_KV_BOUND below.
pytestmark = pytest.mark.usefixtures("exact_kv_cache")
# fp16 keeps 11 significant bits of each key and value (relative error <= 2^-11, 4.9e-4). On
# these models (logits below 1) that moves the logits by at most 1.3e-4 (measured): the bound
# leaves 8x room and stays far below what a wrong position, head or scale would give.
FP16_KV_BOUND = 1e-3


def reference_logits(path, ids):
    ref = mf.load_reference(path)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0], ref


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    expected, _ = reference_logits(path, PROMPT)
    ours = Engine.load(path).score(PROMPT)
    assert expected.abs().max() > 0.05  # the comparison means something
    assert (ours - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_32_greedy_tokens_match_transformers(tiny_models, family):
    path = tiny_models[family]
    _, ref = reference_logits(path, PROMPT)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=299, min_new_tokens=32)
    expected = out[0, len(PROMPT):].tolist()
    engine = Engine.load(path)
    engine.eos_ids = set()  # compare all 32 tokens, as transformers was told to
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=32, temperature=0))
    assert result.token_ids == expected


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_variants_match_transformers(tmp_path, rope):
    path = mf.llama_relu(tmp_path / "m", rope_parameters={"rope_theta": 10000.0, **rope})
    ids = list(range(2, 40))
    expected, _ = reference_logits(path, ids)
    ours = Engine.load(path).score(ids)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_sliding_window_matches_transformers(tmp_path):
    path = mf.mistral_drelu(tmp_path / "m", sliding_window=4)
    ids = [0] + list(range(10, 30))
    expected, _ = reference_logits(path, ids)
    ours = Engine.load(path).score(ids)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_rolling_cache_decodes_past_the_context_with_a_sliding_window(tmp_path):
    """ctx 8 < sequence 24: slots are reused, yet each step equals the full reference."""
    path = mf.mistral_drelu(tmp_path / "m", sliding_window=6)
    ids = [0] + list(range(10, 33))
    expected, _ = reference_logits(path, ids)
    engine = Engine.load(path, ctx=8)
    assert engine.cache.rolling
    steps = [engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(ids)]
    assert (torch.cat(steps) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decode_equals_full_forward(tiny_models, family):
    engine = Engine.load(tiny_models[family])
    full = engine.score(PROMPT)
    engine.cache.reset(0)
    steps = torch.cat([engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT)])
    assert (full - steps).abs().max().item() <= 1e-5


def test_cache_is_written_in_place(llama_dir):
    engine = Engine.load(llama_dir)
    before = [t.data_ptr() for t in engine.cache.k + engine.cache.v]
    engine.generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0))
    assert [t.data_ptr() for t in engine.cache.k + engine.cache.v] == before


def test_prefix_reuse_gives_the_same_tokens(llama_dir):
    engine = Engine.load(llama_dir)
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    first = engine.generate(PROMPT, params)
    longer = PROMPT + first.token_ids + [12, 13]
    reused = engine.generate(longer, params)
    assert engine.last_stats.cached_tokens > len(PROMPT)
    fresh = Engine.load(llama_dir)
    fresh.eos_ids = set()
    assert fresh.generate(longer, params).token_ids == reused.token_ids


@pytest.mark.parametrize("variant", [
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.float16),
    dict(tie=True),
    dict(act="relu2"),
])
def test_checkpoint_variants_match_transformers(tmp_path, variant):
    path = mf.llama_relu(tmp_path / "m", **variant)
    expected, _ = reference_logits(path, PROMPT)
    assert (Engine.load(path).score(PROMPT) - expected).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((llama_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert torch.equal(Engine.load(sharded).score(PROMPT), Engine.load(llama_dir).score(PROMPT))


def test_fatrelu_threshold_zeroes_small_activations():
    from engine.kernels.reference import activations

    gate = torch.tensor([[-1.0, 0.005, 0.02, 3.0]])
    up = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    assert torch.allclose(activations(gate, up, "fatrelu", 0.01), torch.tensor([[0.0, 0.0, 0.04, 6.0]]))
    assert activations(gate, -up, "drelu", 0.0).tolist() == [[0.0, 0.0, 0.0, 0.0]]


@pytest.fixture
def fp16_kv_cache(monkeypatch):
    monkeypatch.delenv("THERMOCLINE_KV_CACHE")  # the default, overriding the module's pin


@pytest.mark.parametrize("family", FAMILIES + ["fp16_checkpoint"])
def test_the_default_fp16_cache_stays_within_its_bound_of_transformers(tmp_path, tiny_models, family,
                                                                        fp16_kv_cache):
    """Prefill (torch SDPA over the fp16 keys, widened) and 32 decode steps (the fused kernel
    reading fp16 in place), teacher-forced on transformers' greedy tokens."""
    path = mf.llama_relu(tmp_path / "m", dtype=torch.float16) if family == "fp16_checkpoint" else tiny_models[family]
    ref = mf.load_reference(path)
    with torch.no_grad():
        prompt = torch.tensor([PROMPT])
        ids = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=299, min_new_tokens=32)[0].tolist()
        expected = ref(torch.tensor([ids])).logits[0]
    engine = Engine.load(path)
    assert {k.dtype for k in engine.cache.k} == {torch.float16}  # the default
    prefill = engine.score(PROMPT)
    engine.cache.reset(len(PROMPT))
    steps = [engine.model.forward(torch.tensor([t]), i, engine.cache)
             for i, t in enumerate(ids[len(PROMPT):], start=len(PROMPT))]
    ours = torch.cat([prefill, *steps])
    assert expected.abs().max() > 0.05  # the comparison means something
    assert (ours[: len(PROMPT)] - expected[: len(PROMPT)]).abs().max().item() <= FP16_KV_BOUND
    assert (ours - expected).abs().max().item() <= FP16_KV_BOUND
