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
    monkeypatch.setattr(batching, "MEMORY_RESERVE", psutil.virtual_memory().total)  # no room left at all (available moves)
    with pytest.raises(BatchMemoryError, match="KV cache needs"):
        batch.start(Sequence(engine.encode_prompt("hi"), SamplingParams(max_new_tokens=4), print, print))
    assert batch.active == []


def test_the_room_running_answers_will_write_is_not_offered_again(demo_path, monkeypatch):
    # KV caches take no memory until written, so `available` does not see what the running
    # answers will still write; a second request that fits only in that room is refused
    from types import SimpleNamespace

    engine = Engine.load(demo_path)
    batch = Batch(engine)
    params = SamplingParams(max_new_tokens=200)
    first = Sequence(engine.encode_prompt("hi"), params, print, print)
    slots = min(engine.ctx, len(first.ids) + params.max_new_tokens + 1)
    room = int(batch.cache_bytes(slots) * 1.5)  # one such cache, not two; the machine's own figure moves
    monkeypatch.setattr(batching.psutil, "virtual_memory", lambda: SimpleNamespace(available=room))
    monkeypatch.setattr(batching, "MEMORY_RESERVE", 0)
    batch.start(first)
    with pytest.raises(BatchMemoryError, match="KV cache needs"):
        batch.start(Sequence(engine.encode_prompt("hi"), params, print, print))
    assert len(batch.active) == 1


def test_prompts_that_arrive_together_are_read_in_one_pass(demo_path):
    engine = Engine.load(demo_path)
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=3, temperature=0)
    batch, ended = Batch(engine), {}
    for i, p in enumerate(PROMPTS):
        batch.start(Sequence(engine.encode_prompt(p), params, lambda ev: None,
                             lambda stats, ids, i=i: ended.__setitem__(i, ids)))
    assert all(s.reading for s in batch.active)  # start only sizes a sequence
    assert sum(len(s.ids) for s in batch.active) <= batching.PREFILL_BUDGET
    batch.step()  # one forward over all eight prompts
    assert not any(s.reading for s in batch.active) and len(batch.active) == len(PROMPTS)
    while batch.active:
        batch.step()
    assert [ended[i] for i in range(len(PROMPTS))] == [engine.generate(p, params).token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_long_prompt_is_read_in_pieces_while_the_others_decode(demo_path, mode, monkeypatch):
    monkeypatch.setattr(batching, "PREFILL_BUDGET", 32)  # the demo's 256 positions hold a few pieces of 32
    engine = Engine.load(demo_path, mode=mode)
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    long_prompt = " ".join(f"word{i}" for i in range(40))
    ids = engine.encode_prompt(long_prompt)
    assert batching.PREFILL_BUDGET * 3 < len(ids) < engine.ctx - 8
    batch, ended, seen = Batch(engine), {}, []
    batch.start(Sequence(engine.encode_prompt(PROMPTS[0]), params, lambda ev: seen.append(ev.token_id),
                         lambda stats, got: ended.__setitem__("short", got)))
    batch.step()  # the short prompt read
    batch.start(Sequence(ids, params, lambda ev: None, lambda stats, got: ended.__setitem__("long", got)))
    long_seq = batch.active[-1]
    pieces = 0
    while long_seq.reading:
        before = len(seen)
        batch.step()
        pieces += 1
        assert len(seen) == before + 1 or "short" in ended  # the short answer goes on meanwhile
    assert pieces >= 3  # read beside the short answer's steps, not in a pause of its own
    while batch.active:
        batch.step()
    assert ended["short"] == engine.generate(PROMPTS[0], params).token_ids
    assert ended["long"] == engine.generate(long_prompt, params).token_ids


def test_an_answer_that_ends_keeps_the_text_held_back_for_a_stop_string(demo_path):
    import torch

    from engine.runtime.answer import Answer

    engine = Engine.load(demo_path)
    tok = engine.tokenizer
    [e_id] = tok.encode("E", add_special_tokens=False)[-1:]
    eos = min(engine.eos_ids)

    def forcing(token):
        logits = torch.full((engine.config.vocab_size,), -1e9)
        logits[token] = 0.0
        return logits

    answer = Answer([1], SamplingParams(max_new_tokens=8, temperature=0, stop=["END"]), tok, engine.eos_ids,
                    engine.sampled_vocab)
    events, token = answer.take(forcing(e_id))
    assert token == e_id and "".join(ev.text for ev in events) == ""  # "E" may begin "END": held
    events, token = answer.take(forcing(eos))
    assert token is None and answer.finish_reason == "stop" and answer.emitted.endswith("E")
    assert events and events[-1].token_id == -1


@pytest.mark.parametrize("fused", [False, True])
def test_each_decode_step_takes_the_way_measured_cheaper(demo_path, fused):
    """Unfused, a batched decode step is timed against each sequence through the fused decode
    and both ways are tried; through the fused batch it is always batched."""
    engine = Engine.load(demo_path)
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=10, temperature=0)
    alone = [engine.generate(p, params).token_ids for p in PROMPTS[:3]]
    if fused:
        _fused_batch_ready(engine)
    else:
        engine.model.batch_decoder = None
    batch, ways = Batch(engine), []
    ended = {}
    for i, p in enumerate(PROMPTS[:3]):
        batch.start(Sequence(engine.encode_prompt(p), params, lambda ev: None,
                             lambda stats, ids, i=i: ended.__setitem__(i, ids)))
    batch.step()  # the prompts, together
    while batch.active:
        batch.step()
        ways.append(batch.chooser.last)
    if fused:
        assert engine.model.batch_fused and set(ways) == {"batch"}
    else:
        assert {"batch", "alone"} <= set(ways)  # both tried
    assert [ended[i] for i in range(3)] == alone  # the same tokens whichever way a step ran
    chooser = batching.StepChooser()
    chooser.record("batch", 2.0)
    chooser.record("alone", 1.0)
    picks = [chooser.choose() for _ in range(chooser.EXPLORE)]
    assert picks.count("alone") == chooser.EXPLORE - 1 and picks[-1] == "batch"  # the other way, now and then


def test_a_way_that_loses_by_far_is_tried_less_and_less_often():
    """Trying "alone" on 7B shapes costs a step five times a batched one: each time it loses
    by more than FAR it waits twice as long (up to a bound), and one close result brings the
    exploration back to every EXPLORE steps."""
    chooser = batching.StepChooser()
    chooser.record("batch", 1.0)
    chooser.record("alone", 5.0)
    tried = []
    for step in range(1, 1100):
        way = chooser.choose()
        if way == "alone":
            tried.append(step)
            chooser.record("alone", 5.0)
        else:
            chooser.record("batch", 1.0)
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    E = chooser.EXPLORE
    assert gaps[:4] == [2 * E, 4 * E, 8 * E, 16 * E] and set(gaps[4:]) <= {16 * E}
    chooser.forget("alone")
    assert chooser.choose() == "alone"
    chooser.record("alone", 1.1)  # close: tried every EXPLORE steps again, from the next exploration on
    picks = [chooser.choose() for _ in range(2 * E)]
    assert picks.count("alone") == 2


def test_one_slowed_step_does_not_turn_the_choice():
    """A step slowed by another process (a quarter of the demo's batched steps, when its 8
    clients share the host) counts for nothing while a recent one was fast: the cost is the
    least of the last WINDOW steps."""
    chooser = batching.StepChooser()
    chooser.record("batch", 1.0)
    chooser.record("alone", 3.0)
    chooser.record("batch", 10.0)  # slowed
    assert chooser.cost["batch"] == 1.0 and chooser.choose() == "batch"
    for _ in range(chooser.WINDOW):  # but a way that became slower is seen within WINDOW steps
        chooser.record("batch", 4.0)
    assert chooser.cost["batch"] == 4.0 and chooser.choose() == "alone"


def test_each_width_of_step_has_its_own_choice():
    """A way measured at one width says nothing of another: steps of 2 that go better alone
    leave steps of 8 batched."""
    chooser = batching.ChooserByWidth()
    for width, batched, alone in ((2, 3.0, 1.0), (8, 1.0, 3.0)):
        assert chooser.choose(width) == "batch"
        chooser.record(width, "batch", batched)
        assert chooser.choose(width) == "alone"
        chooser.record(width, "alone", alone)
    assert chooser.choose(2) == "alone" and chooser.choose(8) == "batch" and chooser.last == "alone"
    chooser.forget("batch")
    assert chooser.choose(2) == "batch" and chooser.choose(8) == "batch"


def _fused_batch_ready(engine) -> None:
    from engine.runtime import fused_batch

    Batch(engine)  # the first batch starts the batch kernels' warm-up thread
    if not fused_batch.wait_ready(900):
        pytest.skip("no fused decode here (numba or AVX2 missing)")


@pytest.mark.parametrize("mode,weights,kv", [("dense", "int8", None), ("sparse", "int8", None),
                                             ("hybrid", "int8", None), ("dense", "int4", None),
                                             ("sparse", "int4", None), ("sparse", "fp32", "fp32"),
                                             ("dense", "fp32", "fp32")])
def test_the_fused_batched_step_gives_each_sequence_its_tokens_alone(demo_path, mode, weights, kv, monkeypatch):
    """Every decode step of the batch through decode_batch (one compiled call per layer for all
    rows): each sequence's greedy tokens are those it decodes alone, with late joiners."""
    if kv is not None:
        monkeypatch.setenv("THERMOCLINE_KV_CACHE", kv)
    engine = Engine.load(demo_path, mode=mode, cpu_weights=weights)
    engine.eos_ids = set()
    params = SamplingParams(max_new_tokens=12, temperature=0)
    alone = [engine.generate(p, params).token_ids for p in PROMPTS]
    _fused_batch_ready(engine)
    batch = Batch(engine)
    batch.chooser.choose = lambda width: "batch"  # every decode step batched, none through the one-token decode
    ended, widest = _run(batch, engine, PROMPTS, params, join_late=(6, 7))
    assert widest == len(PROMPTS)
    assert [ended[i] for i in range(len(PROMPTS))] == alone
    assert all(layer.fused_batch is not None and layer.fused_batch.calls >= 11 for layer in engine.model.layers)
    if mode != "dense":  # the runtime counts the neurons the batched rows computed
        assert 0 < engine.last_stats.ffn_active_fraction < 1


def test_a_fused_decode_step_makes_as_many_torch_calls_for_8_sequences_as_for_2(demo_path):
    """Each torch op hands the GIL to a thread waiting for it (the server's event loop), and the
    engine then waits out that thread's turn: a step made 67 torch calls for 8 sequences, 8 of
    them per sequence, and under 8 streams of the demo took twice its time alone. The step's
    torch calls no longer grow with its sequences."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    engine = Engine.load(demo_path, mode="dense")
    engine.eos_ids = set()
    _fused_batch_ready(engine)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    calls = {}
    for width in (2, 8):
        batch = Batch(engine)
        batch.chooser.choose = lambda width: "batch"
        for p in PROMPTS[:width]:
            batch.start(Sequence(engine.encode_prompt(p), params, lambda ev: None, lambda stats, ids: None))
        for _ in range(3):  # the prompts, then decode steps
            batch.step()
        Count.calls = 0
        with Count():
            batch.step()
        calls[width] = Count.calls
        assert all(layer.fused_batch is not None and layer.fused_batch.calls for layer in engine.model.layers)
    assert 0 < calls[8] == calls[2]


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_fused_batched_logits_match_the_unfused_batch_and_each_alone(demo_path, mode):
    """Three sequences at different positions: the fused step's logits and the K/V it writes
    equal each sequence's one-token fused decode, and are within float rounding of the unfused
    batched layers."""
    import torch

    engine = Engine.load(demo_path, mode=mode)
    _fused_batch_ready(engine)
    model = engine.model
    lengths = [3, 9, 17]
    ids = torch.tensor([11, 22, 33])

    def caches_with_prompts():
        out = [engine.make_cache(engine.config, 32, [la.device for la in model.layers],
                                 [la.dtype for la in model.layers]) for _ in lengths]
        for cache, n in zip(out, lengths):
            model.forward(torch.arange(5, 5 + n), 0, cache)
        return out

    def segments(caches):
        return [(ids[b : b + 1], n, c) for b, (n, c) in enumerate(zip(lengths, caches))]

    batched, one_by_one = caches_with_prompts(), caches_with_prompts()
    fused = model.forward_batch(segments(batched))
    assert all(layer.fused_batch.calls > 0 for layer in model.layers)
    alone = torch.cat([model.forward(t, n, c) for t, n, c in segments(one_by_one)])
    assert torch.equal(fused, alone)
    for a, b, n in zip(batched, one_by_one, lengths):
        assert all(torch.equal(x[:, : n + 1], y[:, : n + 1]) for x, y in zip(a.k + a.v, b.k + b.v))
    decoder, model.batch_decoder = model.batch_decoder, None
    try:
        unfused = model.forward_batch(segments(caches_with_prompts()))
    finally:
        model.batch_decoder = decoder
    assert torch.allclose(fused, unfused, atol=1e-3 * float(unfused.abs().max()), rtol=0)


def test_a_small_models_batched_step_runs_on_one_thread_with_the_same_logits(demo_path, monkeypatch):
    """A step reading fewer than ONE_THREAD_STEP_BYTES (the demo's 20 MB) runs its kernels on
    one thread: on two, a descheduled thread costs it a scheduler's time slice while a server's
    clients take a core. The kernels split the work as for every thread, so the logits are
    the bits of a step on all of them; a larger model's step runs on all."""
    import torch

    from engine.kernels import numba_pool
    from engine.runtime import fused_batch

    if numba_pool.configured_threads() < 2:
        pytest.skip("the kernels run on one thread here")
    engine = Engine.load(demo_path, mode="dense")
    _fused_batch_ready(engine)
    model, kern = engine.model, numba_pool.module()
    seen = []
    layer_batch = fused_batch._module.decode_layer_batch

    def noting_threads(*args):  # after decode_batch_step applied its count to this thread
        seen.append(kern.numba.get_num_threads())
        return layer_batch(*args)

    monkeypatch.setattr(fused_batch._module, "decode_layer_batch", noting_threads)

    def step():
        caches = [engine.make_cache(engine.config, 16, [la.device for la in model.layers],
                                    [la.dtype for la in model.layers]) for _ in range(3)]
        for i, cache in enumerate(caches):
            model.forward(torch.tensor([1 + i, 5, 9]), 0, cache)
        return model.forward_batch([(torch.tensor([20 + i]), 3, c) for i, c in enumerate(caches)])

    small = step()
    assert seen and set(seen) == {1}
    seen.clear()
    monkeypatch.setattr(fused_batch, "ONE_THREAD_STEP_BYTES", 0)  # as a model of more bytes
    assert torch.equal(step(), small)
    assert set(seen) == {numba_pool.configured_threads()}


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_prompt_piece_fused_beside_a_decode_equals_its_tokens_decoded_one_by_one(demo_path, mode):
    """A step of one decode and one prompt piece with `fuse_prompts`: every prompt token is a
    row of the fused batch, attending the rows before it. The logits and the K/V written equal
    the one-token fused decode of each token in turn, and are within float rounding of the
    unfused prefill."""
    import torch

    engine = Engine.load(demo_path, mode=mode)
    _fused_batch_ready(engine)
    model = engine.model

    def cache():
        return engine.make_cache(engine.config, 32, [la.device for la in model.layers],
                                 [la.dtype for la in model.layers])

    prompt, history = torch.tensor([5, 9, 13, 17, 21, 25]), torch.arange(30, 34)
    calls = [layer.fused_batch.calls if layer.fused_batch is not None else 0 for layer in model.layers]
    a, b = cache(), cache()
    model.forward(history, 0, a)
    fused = model.forward_batch([(torch.tensor([11]), 4, a), (prompt, 0, b)], fuse_prompts=True)
    assert fused.shape == (2, engine.config.vocab_size)
    assert all(layer.fused_batch.calls == n + 1 for layer, n in zip(model.layers, calls))  # one call, all rows

    a_ref, b_ref = cache(), cache()
    model.forward(history, 0, a_ref)
    last_a = model.forward(torch.tensor([11]), 4, a_ref)
    for i in range(len(prompt)):
        last_b = model.forward(prompt[i : i + 1], i, b_ref)
    assert torch.equal(fused[0], last_a[0]) and torch.equal(fused[1], last_b[0])
    for got, want, n in ((a, a_ref, 5), (b, b_ref, len(prompt))):
        assert all(torch.equal(x[:, :n], y[:, :n]) for x, y in zip(got.k + got.v, want.k + want.v))
    prefill = model.forward(prompt, 0, cache())[0]
    # sparse: the many-token prefill and a token's decode may choose other neurons at the
    # predictor's threshold (0.5% of the largest logit here)
    tolerance = 1e-3 if mode == "dense" else 2e-2
    assert torch.allclose(fused[1], prefill, atol=tolerance * float(prefill.abs().max()), rtol=0)
