"""The decode's thread count follows its own step times (engine.kernels.thread_tuner), and the
numbers never depend on how many threads computed them."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import numba_pool
from engine.kernels.thread_tuner import ThreadTuner


def run(tuner: ThreadTuner, seconds_at, steps: int) -> list[int]:
    """Feed `steps` steps whose time is seconds_at(count, step); the counts used."""
    used = []
    for step in range(steps):
        count = tuner.count()
        used.append(count)
        tuner.record(seconds_at(count, step))
    return used


def test_it_probes_each_count_and_keeps_the_fastest():
    tuner = ThreadTuner(2, period=10, trial=3)
    assert tuner.candidates == [1, 2]
    used = run(tuner, lambda c, s: {2: 0.30, 1: 0.05}[c], 4)  # a busy second core: 2 threads wait for it
    assert used == [1, 1, 1, 2] and tuner.best == 1 and not tuner.probing  # one collapsed step, no more
    assert run(tuner, lambda c, s: 0.05, 10) == [1] * 10  # until the next probe, after `period` steps
    assert tuner.probing and tuner.probes == 2


def test_a_quiet_machine_keeps_every_thread_and_a_slowdown_starts_a_probe_early():
    tuner = ThreadTuner(4, period=100, trial=3)
    assert tuner.candidates == [1, 2, 4]
    run(tuner, lambda c, s: {4: 0.02, 2: 0.03, 1: 0.05}[c], 9)
    assert tuner.best == 4 and tuner.best_median == 0.02
    run(tuner, lambda c, s: 0.02, 5)
    assert not tuner.probing
    run(tuner, lambda c, s: 0.2, 3)  # another process took the cores: 10x slower
    assert tuner.probing and tuner.probes == 2


def test_noise_of_one_step_does_not_decide():
    tuner = ThreadTuner(2, period=50, trial=3)
    times = iter([0.04, 0.5, 0.04, 0.02, 0.03, 0.02])  # one spike among the 1-thread steps
    run(tuner, lambda c, s: next(times), 6)
    assert tuner.best == 2  # medians 0.04 vs 0.02
    run(tuner, lambda c, s: 0.02, 50)  # the period: a second probe
    assert tuner.probing and tuner.probes == 2
    times = iter([0.04, 0.04, 0.04, 0.02, 0.1, 0.02])  # 2.5x once: not a collapse, the median decides
    assert run(tuner, lambda c, s: next(times), 6) == [1, 1, 1, 2, 2, 2]
    assert tuner.best == 2


def test_one_thread_has_nothing_to_tune():
    tuner = ThreadTuner(1)
    assert tuner.candidates == [1] and not tuner.probing
    assert run(tuner, lambda c, s: 1.0, 100) == [1] * 100 and tuner.probes == 0


@pytest.mark.skipif(not numba_pool.available(), reason="the numba kernels")
@pytest.mark.parametrize("family", ["llama", "smallthinker"])
def test_running_fewer_threads_changes_no_number(tmp_path, family, one_torch_thread):
    """The kernels split their work for the set count whatever runs it: the decode's logits
    are bit-identical on one thread and on two (a dense int8 model's fused decode, a
    mixture's expert kernels)."""
    import model_factory as mf
    import smallthinker_factory as sf

    from engine import Engine

    if family == "llama":
        engine = Engine.load(mf.llama_relu(tmp_path / "m", hidden=128, ff=512, layers=2), cpu_weights="int8")
    else:
        engine = Engine.load(sf.smallthinker(tmp_path / "m", hidden=128, ff=256), mode="sparse", cpu_weights="int8")
    before = numba_pool.configured_threads()
    numba_pool.set_num_threads(2)
    try:
        logits = []
        for running in (1, 2):
            engine.model.thread_tuner = None
            numba_pool.set_running_threads(running)
            engine.cache.reset(0)
            engine.model.forward(torch.tensor([1, 5, 9, 17]), 0, engine.cache)
            logits.append(torch.cat([engine.model.forward(torch.tensor([t]), 4 + i, engine.cache)
                                     for i, t in enumerate([33, 100, 7])]))
        assert torch.equal(logits[0], logits[1])
    finally:
        numba_pool.set_running_threads(None)
        numba_pool.set_num_threads(before)


@pytest.mark.skipif(not numba_pool.available() or numba_pool.configured_threads() < 2,
                    reason="the numba kernels on 2 threads")
def test_one_engines_reduced_count_stays_in_its_own_step(tmp_path):
    """A tuner that chose one thread runs that engine's one-token steps on one thread; a second
    engine, a batched decode or another calling thread afterwards runs on every thread (the
    count was process-wide and stayed at one)."""
    import threading

    import model_factory as mf

    from engine import Engine

    kern = numba_pool.module()
    engine = Engine.load(mf.llama_relu(tmp_path / "m", hidden=64, ff=128, layers=1))
    tuner = ThreadTuner(2, trial=1)
    run(tuner, lambda c, s: {1: 0.01, 2: 0.5}[c], 2)
    assert tuner.best == 1 and not tuner.probing
    seen = []

    def probe(model, ids, start, cache):  # in the decoder's place: the count this step's kernels run on
        numba_pool.use_threads(kern)
        seen.append(kern.numba.get_num_threads())
        return None  # the step goes on the ordinary path

    engine.model.thread_tuner, engine.model.decoder = tuner, probe
    engine.cache.reset(0)
    engine.model.forward(torch.tensor([1]), 0, engine.cache)
    assert seen == [1]
    # after the step, on this thread and on another: every thread again
    assert numba_pool.use_threads(kern) == 2 and kern.numba.get_num_threads() == 2
    other = []
    with numba_pool.running_threads(1):
        t = threading.Thread(target=lambda: (numba_pool.use_threads(kern), other.append(kern.numba.get_num_threads())))
        t.start()
        t.join()
    assert other == [2]
