"""Constrained decoding (engine.runtime.constraints): the grammar library's token masks, applied by
the sampler in every mode, greedy included, on byte-level BPE and sentencepiece tokenizers."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import real_config_models as rc
from engine import Engine, SamplingParams, UserError
from engine.runtime.constraints import GrammarError, GrammarSpec
from engine.runtime.sampling import Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": -5, "maximum": 500},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["title", "count", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo_path():
    from models_registry.resolve import resolve_model

    return resolve_model("demo")


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_every_answer_matches_the_schema_greedy_or_sampled(demo_path, mode):
    engine = Engine.load(demo_path, mode=mode)
    spec = GrammarSpec.json_schema(SCHEMA)
    for temperature, seed in ((0, None), (1.0, 1), (1.5, 2), (0.7, 3)):
        result = engine.generate("Once upon a time", SamplingParams(max_new_tokens=120, temperature=temperature,
                                                                    seed=seed, top_k=0, grammar=spec))
        jsonschema.validate(json.loads(result.text), SCHEMA)
        assert result.stats.finish_reason == "stop"
    free = engine.generate("Once upon a time", SamplingParams(max_new_tokens=20, temperature=0)).text
    assert not free.startswith("{")  # the demo writes prose: the mask, not the model, made the JSON


def test_a_sentencepiece_model_with_added_tokens_and_a_padded_vocabulary(tmp_path):
    path, _, _ = rc.turbosparse(tmp_path / "turbo")
    engine = Engine.load(path)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"enum": ["x y", "z"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for temperature in (0, 1.2):
        result = engine.generate("the quick", SamplingParams(max_new_tokens=40, temperature=temperature, seed=4,
                                                             grammar=GrammarSpec.json_schema(schema)))
        jsonschema.validate(json.loads(result.text), schema)
        assert max(result.token_ids) < engine.tokenizer.vocab_size


def test_a_lark_grammar_constrains_too(demo_path):
    engine = Engine.load(demo_path)
    spec = GrammarSpec.lark('start: "yes" | "no" | "maybe so"')
    for seed in range(4):
        text = engine.generate("Is it?", SamplingParams(max_new_tokens=10, temperature=1.5, seed=seed, grammar=spec)).text
        assert text in ("yes", "no", "maybe so")


def test_the_mask_comes_after_the_bias_so_a_bias_cannot_escape_it(demo_path):
    engine = Engine.load(demo_path)
    grammar = engine.token_grammar()
    constraint = grammar.start(GrammarSpec.json_schema({"enum": ["cat"]}))
    forced = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    sampler = Sampler(SamplingParams(temperature=0, logit_bias={forced: 100}), None, constraint)
    token = sampler(torch.zeros(engine.config.vocab_size), [])
    assert token != forced and engine.tokenizer.decode([token]) in ('"', '"c', '"ca', '"cat', '"cat"')


@pytest.mark.parametrize("schema, words", [({"$ref": "#/$defs/none"}, "none"),
                                           ({"type": "string", "pattern": "(open"}, "unclosed group"),
                                           ({"type": "wrong"}, "wrong")])
def test_a_schema_the_library_cannot_compile_is_a_user_error_naming_it(demo_path, schema, words):
    engine = Engine.load(demo_path)
    spec = GrammarSpec.json_schema(schema)
    with pytest.raises(GrammarError, match=words):
        engine.check_grammar(spec)
    with pytest.raises(UserError, match=words):
        engine.generate("hi", SamplingParams(max_new_tokens=4, grammar=spec))
