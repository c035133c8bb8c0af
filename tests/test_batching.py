"""Continuous batching (engine.runtime.batching): sequences decoding together give the tokens
each would get alone (greedy), in the dense and the sparse modes; new ones join between steps;
a sequence whose KV cache does not fit is refused before it starts."""

from __future__ import annotations

import pytest

from engine import Engine, SamplingParams
from engine.runtime import batching
from engine.runtime.batching import Batch, BatchMemoryError, Sequence

PROMPTS = [f"Story {i}: the {w} went" for i, w in enumerate("cat dog bird fish fox owl bee ant".split())]


@pytest.fixture(scope="module")
def demo_path():
    from models_registry.resolve import resolve_model

    return resolve_model("demo")


def _run(batch: Batch, engine, prompts, params, join_late=()):
    out = {i: [] for i in range(len(prompts))}
    ended = {}

    def sequence(i):
        return Sequence(engine.encode_prompt(prompts[i]), params, lambda ev, i=i: out[i].append(ev.token_id),
                        lambda stats, ids, i=i: ended.__setitem__(i, ids))

    for i in range(len(prompts)):
        if i not in join_late:
            batch.start(sequence(i))
    widest, steps = len(batch.active), 0
    while batch.active:
        batch.step()
        steps += 1
        if steps == 3:  # new sequences join between steps
            for i in join_late:
                batch.start(sequence(i))
        widest = max(widest, len(batch.active))
    return ended, widest


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_batched_greedy_tokens_equal_each_sequence_alone(demo_path, mode):
    engine = Engine.load(demo_path, mode=mode)
    engine.eos_ids = set()  # every sequence runs its full length: the batch stays wide
    params = SamplingParams(max_new_tokens=12, temperature=0)
    alone = [engine.generate(p, params).token_ids for p in PROMPTS]
    assert engine.model.can_batch([engine.cache])
    ended, widest = _run(Batch(engine), engine, PROMPTS, params, join_late=(6, 7))
    assert widest == len(PROMPTS)
    assert [ended[i] for i in range(len(PROMPTS))] == alone


def test_each_sequence_keeps_its_own_sampling(demo_path):
    engine = Engine.load(demo_path)
    engine.eos_ids = set()
    kinds = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s, presence_penalty=p)
             for s, p in ((1, 0.0), (2, 2.0), (3, -1.0))]
    alone = [engine.generate(PROMPTS[0], k).token_ids for k in kinds]
    batch, ended = Batch(engine), {}
    for i, k in enumerate(kinds):
        batch.start(Sequence(engine.encode_prompt(PROMPTS[0]), k, lambda ev: None,
                             lambda stats, ids, i=i: ended.__setitem__(i, ids)))
    while batch.active:
        batch.step()
    assert [ended[i] for i in range(3)] == alone


def test_a_sequence_that_does_not_fit_in_memory_is_refused_before_it_starts(demo_path, monkeypatch):
    import psutil

    engine = Engine.load(demo_path)
    batch = Batch(engine)
    monkeypatch.setattr(batching, "MEMORY_RESERVE", psutil.virtual_memory().available)  # no room left at all
    with pytest.raises(BatchMemoryError, match="KV cache needs"):
        batch.start(Sequence(engine.encode_prompt("hi"), SamplingParams(max_new_tokens=4), print, print))
    assert batch.active == []
