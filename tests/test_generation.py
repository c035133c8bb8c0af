"""Tokenizers, streaming, sampling, stop strings, cancellation, context limits."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import ContextFullError, Engine, SamplingParams, UserError
from engine.runtime.sampling import Sampler, first_maxima
from engine.runtime.tokenizer import StreamDecoder, Tokenizer


def test_tokenizer_round_trips_unicode(llama_dir):
    tok = Tokenizer(llama_dir)
    for text in ["the quick brown fox", "héllo wörld ✓ 日本語 🙂", "  spaces\n\nand lines  "]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id
        assert tok.decode(ids) == text


def test_stream_decoder_never_splits_a_character(llama_dir):
    tok = Tokenizer(llama_dir)
    text = "héllo wörld ✓ 日本語 🙂 the fox"
    ids = tok.encode(text, add_special_tokens=False)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog"] * 50 + ["a b c d e f g h"] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=40,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = Tokenizer(tmp_path)
    ids = tok.encode("the lazy dog")
    assert ids[0] == tok.bos_id == 1
    assert tok.decode(ids) == "the lazy dog"
    assert "User: hi" in tok.render_chat([{"role": "user", "content": "hi"}])


def test_chat_template_runs_sandboxed(tmp_path, llama_dir):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(model)
    with pytest.raises(UserError):
        rendered = tok.render_chat([{"role": "user", "content": "x"}])
        assert "class" not in rendered  # if jinja renders it, nothing of Python leaks


def test_streamed_text_equals_final_text(llama_dir):
    engine = Engine.load(llama_dir)
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=3)
    pieces = [e.text for e in engine.stream("the quick brown", params)]
    assert "".join(pieces) == engine.last_text
    assert engine.last_stats.new_tokens == len(engine.last_token_ids) > 0
    same = Engine.load(llama_dir).generate("the quick brown", params)
    assert same.token_ids == engine.last_token_ids  # a seed makes sampling repeatable


def test_stop_string_ends_generation_and_is_not_emitted(llama_dir):
    engine = Engine.load(llama_dir)
    engine.eos_ids = set()
    free = engine.generate("the quick", SamplingParams(max_new_tokens=30, temperature=0))
    assert len(free.text) > 6
    stop = free.text[3:6]
    stopped = engine.generate("the quick", SamplingParams(max_new_tokens=30, temperature=0, stop=[stop]))
    assert stopped.text == free.text[: free.text.index(stop)]
    assert engine.last_stats.finish_reason == "stop"


def test_cancellation_stops_within_one_token(llama_dir):
    engine = Engine.load(llama_dir)
    engine.eos_ids = set()
    cancel = threading.Event()
    seen = []
    for event in engine.stream("the quick", SamplingParams(max_new_tokens=200, temperature=0), cancel):
        seen.append(event)
        if len(seen) == 3:
            threading.Thread(target=cancel.set).start()
            while not cancel.is_set():
                pass
    assert engine.last_stats.finish_reason == "cancelled"
    assert engine.last_stats.new_tokens <= 4


def test_sampler_filters():
    logits = torch.tensor([5.0, 4.0, 1.0, -3.0])
    assert Sampler(SamplingParams(temperature=0))(logits, []) == 0
    picks = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits, []) for s in range(40)}
    assert picks == {0, 1}
    picks = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s))(logits, []) for s in range(40)}
    assert picks == {0}
    picks = {Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=s))(logits, []) for s in range(40)}
    assert picks == {0, 1}
    # A repeated token with a positive logit is pushed down below its rival.
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=2.0))(logits, [0]) == 1


def test_greedy_picks_what_torch_argmax_picks():
    """first_maxima (numpy's argmax on CPU fp32) picks torch.argmax's index: the first of tied
    maxima, a NaN as the maximum, -inf rows, one row or many, a view of a wider tensor, and
    other dtypes through torch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    logits[1, 5] = logits[1, 250] = 50.0   # a tie: the first wins
    logits[2, 17] = float("nan")           # NaN counts as the maximum
    logits[3] = float("-inf")
    logits[4, 299] = float("inf")
    for view in (logits, logits[:, :200], logits[[5, 0, 2]]):
        assert first_maxima(view).tolist() == view.argmax(dim=-1).tolist()
        for row in view:
            assert int(first_maxima(row)) == int(torch.argmax(row))
    assert first_maxima(logits.to(torch.bfloat16)).tolist() == logits.to(torch.bfloat16).argmax(-1).tolist()


def test_openai_penalties_and_logit_bias_follow_their_definitions():
    """logit[j] - count[j] * frequency - (count[j] > 0) * presence, over this answer's tokens only
    (the prompt in `history` does not count), after the bias is added."""
    logits = torch.tensor([5.0, 4.0, 1.0, -3.0, 0.5])
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.25, logit_bias={3: 7.0, 4: -2.0})
    sampler = Sampler(params)
    for token in (0, 0, 2):
        sampler.accept(token)
    counts = [2, 0, 1, 0, 0]
    bias = [0.0, 0.0, 0.0, 7.0, -2.0]
    expected = [float(v) + b - c * 1.25 - (0.5 if c else 0.0)
                for v, b, c in zip(logits.tolist(), bias, counts)]
    got = sampler.adjust(logits, history=[4, 4, 4, 0, 0, 2])  # the prompt (4, 4, 4) is not penalised
    assert got.double().tolist() == pytest.approx(expected, abs=1e-6)
    assert sampler(logits, [0, 0, 2]) == 1  # 0 fell to 2.0, 3 rose to 4.0, tying 1: argmax takes the first
    # -100 bans a token even when greedy; a negative penalty favours what was said.
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100}))(logits, []) == 1
    favour = Sampler(SamplingParams(temperature=0, presence_penalty=-2, frequency_penalty=-2))
    favour.accept(1)
    assert favour(logits, []) == 1
    assert torch.equal(logits, torch.tensor([5.0, 4.0, 1.0, -3.0, 0.5]))  # the model's logits untouched


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                                          ("logit_bias", {0: 101}), ("logit_bias", {-1: 1}), ("logit_bias", [1])])
def test_out_of_range_penalties_are_user_errors(field, value):
    with pytest.raises(UserError):
        SamplingParams(**{field: value}).validate()


def test_penalties_through_the_engine(llama_dir):
    engine = Engine.load(llama_dir)
    engine.eos_ids = set()
    plain = engine.generate("the quick brown", SamplingParams(max_new_tokens=12, temperature=0)).token_ids
    penalised = engine.generate("the quick brown", SamplingParams(max_new_tokens=12, temperature=0,
                                                                  presence_penalty=2, frequency_penalty=2))
    assert penalised.token_ids != plain or len(set(plain)) == len(plain)
    assert len(set(penalised.token_ids)) >= len(set(plain))
    banned = engine.generate("the quick brown", SamplingParams(max_new_tokens=12, temperature=0,
                                                               logit_bias={t: -100 for t in plain}))
    assert not set(banned.token_ids) & set(plain)
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        engine.generate("the quick", SamplingParams(logit_bias={engine.config.vocab_size: 1}))


def test_every_sampling_option_through_the_engine(llama_dir):
    engine = Engine.load(llama_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.3, seed=7)
    first = engine.generate("the quick brown", params)
    assert first.stats.new_tokens > 0 or first.stats.finish_reason == "stop"
    assert Engine.load(llama_dir).generate("the quick brown", params).token_ids == first.token_ids


def test_context_limits(llama_dir):
    engine = Engine.load(llama_dir, ctx=16)
    with pytest.raises(ContextFullError):
        engine.generate(list(range(2, 30)), SamplingParams(max_new_tokens=4))
    engine.eos_ids = set()
    engine.generate(list(range(2, 12)), SamplingParams(max_new_tokens=50, temperature=0))
    assert engine.last_stats.finish_reason == "context_full"
    assert engine.last_stats.new_tokens == 16 - 10 + 1


def test_chat_messages_use_the_template(llama_dir):
    engine = Engine.load(llama_dir)
    messages = [{"role": "user", "content": "the fox"}]
    ids = engine.encode_prompt(messages)
    assert engine.tokenizer.decode(ids, skip_special=False).startswith("<s><user>the fox</s><assistant>")


def test_stop_while_reading_the_prompt_lands_between_chunks(llama_dir):
    """A stop during prefill takes effect at the next chunk boundary: no token, no answer,
    and what was read stays cached for the next try."""
    import engine.runtime.engine as engine_module

    engine = Engine.load(llama_dir)
    engine.eos_ids = set()
    prompt = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 40)[:400]
    assert len(prompt) > 2 * engine_module.PREFILL_CHUNK and len(prompt) < engine.ctx
    cancel = threading.Event()
    forward, calls = engine.model.forward, []

    def forward_then_stop(ids, start, cache, **kw):  # the user presses Stop during the first chunk
        calls.append((start, ids.shape[0]))
        out = forward(ids, start, cache, **kw)
        cancel.set()
        return out

    engine.model.forward = forward_then_stop
    events = list(engine.stream(prompt, SamplingParams(max_new_tokens=20, temperature=0), cancel))
    engine.model.forward = forward
    assert events == [] and len(calls) == 1
    assert engine.last_stats.finish_reason == "cancelled" and engine.last_stats.new_tokens == 0
    # The chunk read is reused; the answer equals that of an engine reading the prompt at once.
    again = engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))
    assert again.stats.cached_tokens == calls[0][1]
    fresh = Engine.load(llama_dir)
    fresh.eos_ids = set()
    whole = fresh.model.forward(torch.tensor(prompt), 0, fresh.cache)
    fresh.reset()
    chunked = fresh._prefill(prompt, 0, None)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    fresh.reset()
    assert again.token_ids == fresh.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0)).token_ids
