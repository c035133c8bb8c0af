"""A first start (`Engine.load(..., kernels="background")` with no completed preparation in
numba's cache): the load returns before the CPU kernels are ready, answers on the torch paths
the same tokens as the compiled engine, and takes each kernel in between two tokens once it is
compiled, never within a token; other engines in the process are not held back."""

from __future__ import annotations


import pytest

from engine import Engine, SamplingParams
from models_registry.resolve import demo_model_dir
from engine.kernels import cpu_numba, numba_pool
from engine.runtime import kernel_preparation as kp
from kernel_steps import HeldSteps, forget_preparation

pytestmark = pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")

DEMO = demo_model_dir()
PARAMS = SamplingParams(max_new_tokens=8, temperature=0)
KIND = kp.kind_of("sparse", "int8")


def fused_calls(engine) -> int:
    return sum(getattr(getattr(layer, "fused", None), "calls", 0) for layer in engine.model.layers)


@pytest.fixture
def reference():
    compiled = Engine.load(DEMO, mode="sparse")  # the reference: every kernel in use
    expected = compiled.generate("It is a truth", PARAMS).token_ids
    assert fused_calls(compiled) > 0
    return compiled, expected


def test_first_answer_comes_on_the_torch_paths_and_each_kernel_comes_in_between_tokens(reference, monkeypatch):
    compiled, expected = reference
    forget_preparation(KIND)
    steps = HeldSteps(monkeypatch)
    progress = []
    engine = Engine.load(DEMO, mode="sparse", kernels="background",
                         kernel_progress=lambda *report: progress.append(report))
    try:
        prep = engine.kernel_preparation
        assert prep is not None and not prep.ready() and prep.total >= 3
        compiles_before = numba_pool.compiles_under_gate
        first = engine.generate("It is a truth", PARAMS)
        assert first.token_ids == expected
        assert fused_calls(engine) == 0 and prep.taken_in() == 0  # nothing compiled yet: the torch paths
        assert numba_pool.kernels() is not None  # this thread, outside the engine, is not held back
        assert compiled.generate("It is a truth", PARAMS).token_ids == expected and fused_calls(compiled) > 0

        # The prompt's kernels and the fused decode compile while an answer runs: they come in
        # at the next token boundary, not within the token that is computing.
        seen = []
        layer_of = engine.model._layer

        def one_layer(index, layer, *args):
            if index == 0 and not steps.prompt_go.is_set():
                steps.prompt_go.set()  # compiled in the middle of this token
                assert steps.all_entered.wait(600) and prep.compiled() > prep.taken_in()
            seen.append((index, numba_pool.kernels("ffn_rows") is not None))
            return layer_of(index, layer, *args)

        engine.model._layer = one_layer
        second = engine.generate("It is a truth universally", PARAMS)
        del engine.model._layer
        assert prep.compiled() > 0 and not prep.ready()  # run_all is still held
        assert seen[0] == (0, False) and all(not used for _i, used in seen[:len(engine.model.layers)])
        assert prep.taken_in() > 0 and fused_calls(engine) > 0  # in from the next token on
        assert engine.kernel_preparation is prep
        assert numba_pool.compiles_under_gate == compiles_before  # nothing compiled within the engine's tokens

        steps.release()
        assert prep.wait(600) and prep.error is None
        assert kp.is_cached(KIND)  # the next start loads them with the weights
        third = engine.generate("It is a truth", PARAMS)  # the last come in before its prompt
        assert engine.kernel_preparation is None and engine._kernel_gate is None
        assert third.token_ids == expected
        assert second.token_ids == compiled.generate("It is a truth universally", PARAMS).token_ids
        assert progress[-1] == (prep.compiled(), prep.total, True) and not any(f for *_n, f in progress[:-1])
        assert [d for d, _t, _f in progress] == sorted(d for d, _t, _f in progress)
    finally:
        steps.release()
        if engine.kernel_preparation is not None:
            engine.kernel_preparation.wait(600)
            engine.swap_in_kernels()


def test_an_engine_left_preparing_holds_back_no_other_engine(reference, monkeypatch):
    compiled, expected = reference
    forget_preparation(KIND)
    steps = HeldSteps(monkeypatch)
    try:
        preparing = Engine.load(DEMO, mode="sparse", kernels="background")
        assert preparing.kernel_preparation is not None
        steps.unpatch()
        # Another engine of the process (as the next in-process CLI test) computes with every kernel.
        other = Engine.load(DEMO, mode="sparse")
        calls = fused_calls(other)
        assert other.generate("It is a truth", PARAMS).token_ids == expected
        assert fused_calls(other) > calls and other.kernel_preparation is None
    finally:
        steps.release()
        preparing.kernel_preparation.wait(600)


def test_a_completed_preparation_loads_the_kernels_with_the_weights():
    Engine.load(DEMO, mode="sparse")  # writes nothing; make sure a stamp exists
    kp.mark_cached(KIND)
    engine = Engine.load(DEMO, mode="sparse", kernels="background")
    assert engine.kernel_preparation is None and engine._kernel_gate is None
    engine.generate("It is a truth", PARAMS)
    assert fused_calls(engine) > 0


PROBE_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from engine.kernels import numba_pool
import probed
if sys.argv[2] == "call":
    probed.twice(2.0)  # compiles, and numba's cache keeps it
print(numba_pool.loads_without_compiling(probed.twice, 3.0), len(probed.twice.signatures),
      sum(probed.twice.stats.cache_misses.values()), sum(probed.twice.stats.cache_hits.values()))
"""


def test_loads_without_compiling_loads_from_the_cache_and_never_compiles(tmp_path):
    """The warm-up asks it before a disk tier's or a mixture's layer calls: True where they run
    without numba compiling (in this process already, or loaded from numba's disk cache now),
    False where they would compile, and then nothing is compiled."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "probed.py").write_text("import numba\n\n\n@numba.njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parents[1]

    def probe(step: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", PROBE_CHILD, str(tmp_path), step], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert probe("ask") == ["False", "0", "0", "0"]  # not compiled, not cached: refused, nothing compiled
    assert probe("call") == ["True", "1", "1", "0"]  # compiled in this process (and cached on disk)
    assert probe("ask") == ["True", "1", "0", "1"]  # a new process: loaded from the cache, no compile
