"""The published configs (tests/data/real_configs) are read as their families' code reads them,
by the engine and the registry alike, and tiny models with their keys and published tensor
names decode as a `transformers` reference of the family does."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import real_config_models as rc
from engine.arch import family_names
from engine.arch import read_config
from engine.arch import parse_config
from engine.errors import ModelFormatError
from models_registry.arch import detect_architecture

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 9, 17, 33, 100, 7, 8, 250, 3, 42]
RAM = 1 << 30

pytestmark = pytest.mark.usefixtures("exact_kv_cache")  # comparisons to 1e-4: the fp32 cache

# name -> (arch module, activation, threshold, context, vocabulary, embedding / residual / logit scales, tied head)
EXPECTED = {
    "relullama-7b": ("llama", "relu", 0.0, 2048, 32000, (1.0, 1.0, 1.0), False),
    "relullama-70b": ("llama", "relu", 0.0, 2048, 32000, (1.0, 1.0, 1.0), False),
    "prosparse-llama-2-7b": ("llama", "fatrelu", 0.01, 4096, 32000, (1.0, 1.0, 1.0), False),
    "minicpm-s-1b-sft": ("minicpm", "fatrelu", 0.03, 4096, 73440, (12.0, 1.4 / math.sqrt(52), 256 / 1536), True),
    # The Llama-format copy says llama/relu and is read as transformers' Llama reads it: no scales.
    "minicpm-s-1b-sft-llama-format": ("llama", "relu", 0.0, 4096, 73440, (1.0, 1.0, 1.0), False),
    "bamboo-base": ("bamboo", "drelu", 0.0, 32768, 32000, (1.0, 1.0, 1.0), False),
    "bamboo-dpo": ("bamboo", "drelu", 0.0, 32768, 32000, (1.0, 1.0, 1.0), False),
    "turbosparse-mistral": ("bamboo", "drelu", 0.0, 32768, 32064, (1.0, 1.0, 1.0), False),
    # a mixture of dReLU experts with their predictors (tests/test_turbosparse_mixtral.py)
    "turbosparse-mixtral": ("turbosparsemixtral", "drelu", 0.0, 32768, 57024, (1.0, 1.0, 1.0), False),
}
# name -> (the architecture module that would read it, why there is none yet)
NOT_YET: dict[str, tuple[str, str]] = {}


def all_configs() -> list[str]:
    return sorted(p.parent.name for p in rc.REAL_CONFIGS.glob("*/config.json"))


@pytest.mark.parametrize("name", all_configs())
def test_every_published_config_is_read_with_its_facts(name):
    raw = rc.real_config(name)
    if name not in EXPECTED:
        module, reason = NOT_YET.get(name, (None, ""))
        if module is not None and module not in family_names():  # refused, with the type it does not know
            with pytest.raises(ModelFormatError, match=f"unknown model_type '{module}'"):
                parse_config(raw)
            return
        parse_config(raw)  # an architecture module reads it (its own tests check the facts)
        return
    arch, activation, threshold, context, vocab, scales, tied = EXPECTED[name]
    cfg = parse_config(raw)
    assert (cfg.arch, cfg.activation, cfg.activation_threshold) == (arch, activation, threshold)
    assert (cfg.max_positions, cfg.vocab_size, cfg.tie_word_embeddings) == (context, vocab, tied)
    assert (cfg.embedding_scale, cfg.residual_scale, cfg.logit_scale) == pytest.approx(scales)
    assert cfg.num_layers == raw["num_hidden_layers"] and cfg.intermediate_size == raw["intermediate_size"]
    assert cfg.sliding_window == raw.get("sliding_window")
    # The registry's download/import/fit checks read the very same thing.
    assert detect_architecture(raw).config == cfg


def test_smallthinker_4b_is_read_as_a_mixture_of_experts():
    """SmallThinker's own tests (tests/test_smallthinker*.py) build tiny models from a copy of
    this config in tests/data; the copy is the published one."""
    import smallthinker_factory as sf

    raw = rc.real_config("smallthinker-4b")
    assert raw == sf.real_config()
    cfg = parse_config(raw)
    assert (cfg.arch, cfg.activation, cfg.num_experts, cfg.experts_per_token) == ("smallthinker", "relu", 32, 4)
    assert (cfg.intermediate_size, cfg.max_positions, cfg.vocab_size, cfg.tie_word_embeddings) == (768, 32768, 151936, True)
    assert detect_architecture(raw).config == cfg


def test_the_registry_and_the_engine_refuse_and_accept_the_same_configs():
    llama = rc.real_config("relullama-7b")
    # without hidden_act a Llama is SwiGLU (transformers' default): both accept it, dense
    swiglu = {k: v for k, v in llama.items() if k != "hidden_act"}
    assert parse_config(swiglu).activation == detect_architecture(swiglu).activation == "silu"
    for bad in ({**llama, "hidden_act": "fat_relu"}, {**llama, "hidden_act": "gelu"}):
        with pytest.raises(ModelFormatError):
            parse_config(bad)
        with pytest.raises(ModelFormatError):
            detect_architecture(bad)
    falcon = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 300, "new_decoder_architecture": True, "num_kv_heads": 2}
    # Falcon's default activation is GELU: refused by both, unless the catalogue says ReLU.
    for check in (parse_config, detect_architecture):
        with pytest.raises(ModelFormatError, match="not sparse"):
            check(falcon)
    assert parse_config(falcon, "relu").activation == detect_architecture(falcon, "relu").activation == "relu"


def test_the_architecture_comes_from_architectures_when_model_type_is_missing():
    raw = rc.real_config("minicpm-s-1b-sft")
    assert "model_type" not in raw and parse_config(raw).arch == "minicpm"
    no_type = {k: v for k, v in rc.real_config("prosparse-llama-2-7b").items() if k != "model_type"}
    assert parse_config(no_type).arch == "llama"
    with pytest.raises(ModelFormatError, match="unknown architecture"):
        parse_config({**no_type, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": 4096.5}, "hidden_size"),
    ({"vocab_size": "32000"}, "vocab_size"),
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"hidden_act_param": "0.01"}, "hidden_act_param"),
    ({"hidden_act_param": float("inf")}, "hidden_act_param"),
    ({"hidden_act_param": -0.5}, "threshold"),
    ({"rms_norm_eps": None, "num_key_value_heads": 5}, "key/value heads"),
    ({"rope_scaling": "yes"}, "rope_scaling"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
])
def test_malformed_configs_are_refused_with_the_key_named(change, words):
    raw = {**rc.real_config("prosparse-llama-2-7b"), **change}
    with pytest.raises(ModelFormatError, match=words):
        parse_config(raw)
    with pytest.raises(ModelFormatError, match=words):
        detect_architecture(raw)


def test_a_config_that_is_not_an_object_is_refused():
    for raw in ([], [rc.real_config("relullama-7b")], "llama", 3, None):
        with pytest.raises(ModelFormatError, match="JSON object"):
            parse_config(raw)
        with pytest.raises(ModelFormatError, match="JSON object"):
            detect_architecture(raw)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("change", [None, {"num_hidden_layers": 0}, {"rope_theta": float("nan")},
                                    {"hidden_act_param": "0.01"}])
def test_the_cli_refuses_a_malformed_config_with_one_error_line(tmp_path, llama_dir, change):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    good = json.loads((model / "config.json").read_text())
    text = "[]" if change is None else json.dumps({**good, "hidden_act": "fatrelu", **change})  # NaN as JSON's NaN
    (model / "config.json").write_text(text)
    for args in (("generate", "--model", str(model), "--prompt", "hi"),
                 ("place", "--model", str(model), "--vram-budget", "0", "--ram-budget", "1GiB"),
                 ("models", "fit", str(model))):
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_one_context_cap_for_the_engine_place_and_fit(tmp_path):
    """A model trained for 64 positions, asked for 2048: all three count 64."""
    from engine import Engine
    from models_registry.fit import estimate_fit

    import model_factory as mf

    model = mf.llama_relu(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (model / "config.json").write_text(json.dumps(config))
    assert read_config(model).context_length(2048) == 64
    assert read_config(model).context_length() == 64
    engine = Engine.load(model, ctx=2048)
    assert engine.ctx == 64
    assert estimate_fit(config, ctx=2048, vram_budget=0, ram_budget=RAM).ctx == 64
    proc = _cli("place", "--model", str(model), "--vram-budget", "0", "--ram-budget", "1GiB", "--ctx", "2048",
                "--json")
    at_64 = _cli("place", "--model", str(model), "--vram-budget", "0", "--ram-budget", "1GiB", "--ctx", "64",
                 "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ram_bytes"] == json.loads(at_64.stdout)["ram_bytes"]


# ------------------------------------------------------------ tiny models vs references
BUILDERS = {"relullama": rc.relullama, "prosparse": rc.prosparse, "minicpm": rc.minicpm, "bamboo": rc.bamboo,
            "turbosparse": rc.turbosparse}


@pytest.fixture(scope="module")
def real_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def _reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_tiny_real_config_models_match_their_reference(real_models, family, tmp_path, one_torch_thread):
    from engine import Engine, SamplingParams

    path, ref, facts = real_models[family]
    engine = Engine.load(path)
    ids = PROMPT
    if "mask" in facts:  # TurboSparse: dense mode is its plain dReLU (the sparse mode has its own test)
        facts["mask"]["on"] = False
    try:
        expected = _reference_logits(ref, ids)
        assert expected.abs().max() > 0.05  # the comparison means something
        assert (engine.score(ids) - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
        greedy = _reference_greedy(ref, ids, facts)
    finally:
        if "mask" in facts:
            facts["mask"]["on"] = True
    engine.eos_ids = set()
    result = engine.generate(ids, SamplingParams(max_new_tokens=16, temperature=0))
    assert result.token_ids == greedy


@pytest.mark.parametrize("family", ["minicpm", "bamboo", "prosparse"])
def test_oracle_mode_equals_dense_with_each_familys_quirks(real_models, family, tmp_path, one_torch_thread):
    """The sparse runtime's FFN (true active set) under the muP scales, dReLU and FATReLU."""
    from engine import Engine

    path, _, _ = real_models[family]
    shutil.copytree(path, tmp_path / family)
    dense = Engine.load(tmp_path / family).score(PROMPT)
    oracle = Engine.load(tmp_path / family, mode="oracle", ram_budget=RAM, cpu_weights="fp32")
    assert (oracle.score(PROMPT, "oracle") - dense).abs().max().item() <= 1e-4 * max(1.0, dense.abs().max().item())


def _reference_greedy(ref, ids, facts) -> list[int]:
    """16 greedy tokens of the reference, never one past the tokenizer's vocabulary."""
    limit = facts.get("tokenizer_vocab")
    with torch.no_grad():
        t = torch.tensor([ids])
        out = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, eos_token_id=None, pad_token_id=0,
                           suppress_tokens=list(range(limit, facts["vocab_size"])) if limit else None)
    return out[0, len(ids):].tolist()


def test_prosparse_and_minicpm_references_need_their_quirks(real_models):
    """FATReLU's threshold and MiniCPM's scales change the tiny models' logits, so the
    comparisons above would catch an engine that ignored them."""
    from engine import Engine

    for family in ("prosparse", "minicpm"):
        path, ref, config = real_models[family]
        plain = json.loads((path / "config.json").read_text())
        for key in ("hidden_act_param", "scale_emb", "scale_depth", "dim_model_base"):
            plain.pop(key, None)
        plain["hidden_act"] = "relu"
        expected = _reference_logits(ref, PROMPT)
        quirkless = tmp = path.parent / f"{family}-plain"
        shutil.copytree(path, tmp, dirs_exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(plain))
        assert (Engine.load(quirkless).score(PROMPT) - expected).abs().max().item() > 1e-3


def test_minicpm_without_model_type_has_a_tied_head_and_its_scales(real_models):
    from engine import Engine

    path, _, config = real_models["minicpm"]
    engine = Engine.load(path)
    assert engine.config.arch == "minicpm" and engine.model.lm_head is engine.model.embed
    assert engine.model.embedding_scale == 12 and engine.model.logit_scale == 256 / 64


def test_bamboo_loads_with_only_a_sentencepiece_model(real_models):
    from engine import Engine

    path, _, _ = real_models["bamboo"]
    assert not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists()
    engine = Engine.load(path)
    tok = engine.tokenizer
    ids = tok.encode("the quick brown fox")
    assert ids[0] == 1 and tok.bos_token == "<s>" and tok.eos_id == 2  # from special_tokens_map.json
    assert tok.decode(ids) == "the quick brown fox"
    assert 2 in engine.eos_ids


def test_turbosparse_never_samples_the_padded_vocabulary(real_models):
    from engine import Engine, SamplingParams

    path, ref, facts = real_models["turbosparse"]
    limit = facts["tokenizer_vocab"]
    engine = Engine.load(path)
    assert engine.tokenizer.vocab_size == limit < engine.config.vocab_size
    logits = engine.score(PROMPT)
    assert (logits.argmax(-1) >= limit).all()  # the padded rows would win every argmax
    engine.eos_ids = set()
    for temperature in (0.0, 1.5):
        result = engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3))
        assert result.token_ids and max(result.token_ids) < limit


def test_turbosparse_chatml_tokens_round_trip(real_models):
    from engine import Engine

    path, _, facts = real_models["turbosparse"]
    tok = Engine.load(path).tokenizer
    im_end = facts["tokenizer_vocab"] - 2
    ids = tok.encode("<|im_start|>user\nthe dog<|im_end|>", add_special_tokens=False)
    assert ids[0] == im_end + 1 and ids[-1] == im_end
    assert tok.eos_id == im_end  # special_tokens_map.json: eos is <|im_end|>
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nthe dog<|im_end|>"


def test_turbosparse_sparse_mode_uses_the_predictors_in_its_checkpoint(real_models, tmp_path):
    from engine import Engine
    from engine.loading.predictors import PredictorSet

    src, ref, facts = real_models["turbosparse"]
    path = tmp_path / "turbo"
    shutil.copytree(src, path)
    assert not PredictorSet.exists(path)
    engine = Engine.load(path, mode="sparse", ram_budget=RAM, cpu_weights="fp32")
    stored = PredictorSet.load(path)
    assert stored.source == "checkpoint" and stored.thresholds == [0.0] * facts["num_hidden_layers"]
    for (fc1, fc2), a, b in zip(facts["predictors"], stored.fc1, stored.fc2):
        assert torch.equal(a, fc1) and torch.equal(b, fc2)
    masked = _reference_logits(ref, PROMPT)  # relu(gate) * relu(up) * predictor mask
    sparse = engine.score(PROMPT, "sparse")
    assert (sparse - masked).abs().max().item() <= 1e-4 * max(1.0, masked.abs().max().item())
    dense = Engine.load(path).score(PROMPT)
    assert (dense - masked).abs().max().item() > 1e-3  # the mask matters


def test_checkpoint_predictors_with_wrong_shapes_are_refused(real_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.loading.predictor_import import import_checkpoint_predictors

    src, _, facts = real_models["turbosparse"]
    path = tmp_path / "turbo"
    shutil.copytree(src, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.predictor.fc2.weight"] = torch.zeros(7, 12)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="predictor of layer 1"):
        import_checkpoint_predictors(path, read_config(path))
    del tensors["model.layers.1.mlp.predictor.fc2.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="some layers only"):
        import_checkpoint_predictors(path, read_config(path))
