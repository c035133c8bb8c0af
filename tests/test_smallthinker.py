"""SmallThinker (sparse mixture of ReGLU experts): config, dense engine against an fp64
reference written from the published equations, tokenizer end tokens."""

from __future__ import annotations

import pytest
import torch

import smallthinker_factory as sf
from engine import Engine, SamplingParams
from engine.arch import parse_config
from engine.errors import ModelFormatError

PROMPT = [3, 5, 9, 17, 33, 100, 7, 8, 250, 4, 42, 61, 90]
MIXED = dict(rope_layout=[1, 0, 1, 1], window_layout=[0, 1, 0, 1], window=5)  # NoPE and windowed layers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("smallthinker")
    return {
        "real_layout": sf.smallthinker(root / "real_layout", seed=0),
        "mixed_layout": sf.smallthinker(root / "mixed_layout", seed=1, **MIXED),
        "softmax": sf.smallthinker(root / "softmax", seed=2, softmax=True),
    }


def test_real_config_parses_to_the_published_shape():
    cfg = parse_config(sf.real_config())
    assert (cfg.family, cfg.model_type) == ("smallthinker", "smallthinker")
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size) == (32, 4, 768)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (1536, 12, 2, 128)
    assert cfg.n_ff == 32  # placement and profiling count experts
    assert cfg.tie_word_embeddings and cfg.vocab_size == 151936
    assert cfg.eos_token_ids == (151643, 151645)
    assert not cfg.router_softmax  # no moe_primary_router_apply_softmax key: sigmoid
    assert cfg.rope_layers == (True,) * 32 and cfg.window_layers == (False,) * 32
    assert cfg.layer_window is None and cfg.sliding_window is None
    assert cfg.rope.theta == 1.5e6


def test_layouts_are_read_per_layer():
    cfg = parse_config(sf.tiny_config(**MIXED))
    assert cfg.rope_layers == (True, False, True, True)
    assert cfg.window_layers == (False, True, False, True) and cfg.layer_window == 5


@pytest.mark.parametrize("change", [
    {"rope_layout": [1, 1]},                     # not one entry per layer
    {"sliding_window_layout": [0, 2, 0, 0]},     # not 0/1
    {"moe_num_active_primary_experts": 9},       # more than there are
    {"moe_num_primary_experts": 0},
])
def test_malformed_configs_are_refused(change):
    cfg = sf.tiny_config()
    cfg.update(change)
    with pytest.raises(ModelFormatError):
        parse_config(cfg)


@pytest.mark.parametrize("name", ["real_layout", "mixed_layout", "softmax"])
def test_logits_match_the_fp64_reference(models, name, one_torch_thread, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp32")  # the exact reference
    ref = sf.Reference(models[name])
    expected = ref.forward(PROMPT).float()
    ours = Engine.load(models[name]).score(PROMPT)
    assert expected.abs().max() > 1.0  # the comparison means something
    assert (ours - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("name", ["real_layout", "mixed_layout", "softmax"])
def test_the_default_fp16_cache_stays_within_its_bound_of_the_fp64_reference(models, name, one_torch_thread):
    """fp16 keys and values (11 significant bits) in full and windowed layers, prefill and
    decode: within 3e-3 of the largest logit (measured: 5.1e-4 at most on these models)."""
    ref = sf.Reference(models[name])
    expected = ref.forward(PROMPT).float()
    engine = Engine.load(models[name])
    assert {k.dtype for k in engine.cache.k} == {torch.float16}
    prefill = engine.score(PROMPT[:5])
    steps = [engine.model.forward(torch.tensor([t]), i, engine.cache) for i, t in enumerate(PROMPT[5:], start=5)]
    ours = torch.cat([prefill, *steps])
    assert (ours - expected).abs().max().item() <= 3e-3 * expected.abs().max().item()


def test_the_router_reads_the_layer_input_not_the_normed_one(models):
    """Routing on input_layernorm's output would pick other experts on this model."""
    ref = sf.Reference(models["real_layout"])
    x = ref.w["model.embed_tokens.weight"][torch.tensor(PROMPT)]
    normed = ref._rms(x, ref.w["model.layers.0.input_layernorm.weight"])
    _, from_input = ref.moe(0, x, x)
    _, from_normed = ref.moe(0, normed, x)
    assert not torch.equal(from_input, from_normed)


@pytest.mark.parametrize("name", ["real_layout", "mixed_layout"])
def test_24_greedy_tokens_match_the_reference(models, name, one_torch_thread):
    expected = sf.Reference(models[name]).greedy(PROMPT, 24)
    engine = Engine.load(models[name])
    engine.eos_ids = set()  # compare all the tokens
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=24, temperature=0))
    assert result.token_ids == expected


def test_windowed_layers_mask_old_positions(models, one_torch_thread):
    """Past the window (5), the mixed model's logits differ from the same weights with
    every layer full; both equal their own reference."""
    import json
    import shutil

    path = models["mixed_layout"]
    full = path.parent / "mixed_full"
    shutil.copytree(path, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window_layout"] = [0, 0, 0, 0]
    (full / "config.json").write_text(json.dumps(cfg))
    windowed, unwindowed = Engine.load(path).score(PROMPT), Engine.load(full).score(PROMPT)
    assert torch.allclose(windowed[:5], unwindowed[:5], atol=1e-4)  # inside the window: the same
    assert (windowed[6:] - unwindowed[6:]).abs().max() > 1e-2


def test_end_tokens_and_chat_template(models):
    engine = Engine.load(models["real_layout"])
    tok = engine.tokenizer
    im_end, endoftext = tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")
    assert {im_end, endoftext} <= engine.eos_ids  # the tokenizer config's and config.json's
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
