"""The embedded demo model: present, small, loadable with no download, writes English, and
its sparse-inference figures stay within the targets of its model card."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import Engine, SamplingParams
from engine.hotcold.activation_stats import ActivationStats
from engine.calibration.evaluation import EvalSettings, default_corpus, evaluate
from engine.loading.predictors import PredictorSet
from models_registry.resolve import resolve_model
from models_registry.resolve import demo_model_dir

DEMO = demo_model_dir()


@pytest.fixture(autouse=True)
def one_thread():
    """A 5M-parameter model gains little from threads; on a busy 2-core CI box they cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def fresh_install(tmp_path, monkeypatch):
    """No models folder, no settings: what a first start sees."""
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def english_words() -> set[str]:
    return set(re.findall(r"[a-z]+", default_corpus(DEMO).read_text(encoding="utf-8").lower()))


def test_files_and_sizes():
    config = json.loads((DEMO / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["model_type"] == "llama"
    assert (DEMO / "model.safetensors").stat().st_size <= 25 * 1024**2
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md",
                 "thermocline/predictors.safetensors", "thermocline/activation_stats.safetensors",
                 "thermocline/eval.txt"):
        assert (DEMO / name).is_file(), name
    assert not (DEMO / "thermocline" / "profile").exists()  # training pairs are not shipped
    layers, d, n_ff = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    preds = PredictorSet.load(DEMO, layers, d, n_ff)
    assert preds.source == "thermocline"
    stats = ActivationStats.load(DEMO)
    assert len(stats.counts) == layers and stats.tokens > 10_000
    assert sum(stats.sparsity()) / layers >= 0.8


def test_loads_from_a_fresh_install_and_writes_english(fresh_install):
    engine = Engine.load(resolve_model("demo"), ctx=256)
    result = engine.generate("It is a truth universally acknowledged",
                             SamplingParams(max_new_tokens=40, temperature=0))
    words = re.findall(r"[A-Za-z]+", result.text)
    assert len(words) >= 15, result.text
    known = english_words()
    assert sum(w.lower() in known for w in words) / len(words) >= 0.9, result.text

    reply = engine.generate([{"role": "user", "content": "Will you walk with me to Highbury?"}],
                            SamplingParams(max_new_tokens=30, temperature=0.7, seed=1))
    assert reply.text.strip() and "User:" not in reply.text


def test_sparse_mode_writes_english_computing_a_fraction_of_the_neurons(fresh_install):
    # Free-running greedy paths of sparse and dense part once one near-tie flips; their
    # token-by-token agreement is measured teacher-forced by the eval test below.
    engine = Engine.load(resolve_model("demo"), mode="sparse", ctx=128)
    result = engine.generate("Emma was not sorry to see", SamplingParams(max_new_tokens=32, temperature=0))
    assert 0.0 < result.stats.ffn_active_fraction < 0.3
    words = re.findall(r"[A-Za-z]+", result.text)
    known = english_words()
    assert len(words) >= 12 and sum(w.lower() in known for w in words) / len(words) >= 0.9, result.text


def test_quick_eval_within_the_targets():
    engine = Engine.load(resolve_model("demo"), mode="sparse", ctx=256)
    report = evaluate(engine, None, EvalSettings(max_tokens=768, window=256))
    assert report["sparsity"] >= 0.80
    assert report["recall"] >= 0.95
    assert abs(report["predicted_sparsity"] - report["sparsity"]) <= 0.05
    assert report["ppl_sparse"] <= 1.02 * report["ppl_dense"]
    assert report["greedy_agreement"] >= 0.95
    assert report["ppl_oracle"] == pytest.approx(report["ppl_dense"], rel=1e-5)
