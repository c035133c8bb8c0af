"""A first start (`Engine.load(..., kernels="background")` with no completed preparation in
numba's cache): the load returns before the CPU kernels are ready, answers on the torch paths
the same tokens as the compiled engine, and takes the kernels (the fused decode included) only
between tokens once they are all ready."""

from __future__ import annotations

import threading

import pytest

from engine import Engine, SamplingParams
from models_registry.resolve import demo_model_dir
from engine.kernels import cpu_numba, numba_pool
from engine.runtime import engine as engine_module
from engine.runtime import kernel_preparation as kp

pytestmark = pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")

DEMO = demo_model_dir()
PARAMS = SamplingParams(max_new_tokens=8, temperature=0)


def fused_calls(engine) -> int:
    return sum(getattr(getattr(layer, "fused", None), "calls", 0) for layer in engine.model.layers)


def test_first_answer_comes_on_the_torch_paths_and_the_kernels_swap_in_between_tokens(monkeypatch):
    compiled = Engine.load(DEMO, mode="sparse")  # the reference: the kernels in use
    expected = compiled.generate("It is a truth", PARAMS).token_ids
    assert fused_calls(compiled) > 0

    stamp, _content = kp._stamp(kp.kind_of("sparse", "int8"))
    stamp.unlink(missing_ok=True)  # as on a machine where no preparation completed
    gate = threading.Event()  # the compile thread waits here: the first answer certainly comes first
    run_prompt = engine_module._KernelWarmup.run_prompt

    def held(mode, cpu_weights):
        gate.wait()
        run_prompt(mode, cpu_weights)

    monkeypatch.setattr(engine_module._KernelWarmup, "run_prompt", staticmethod(held))
    engine = Engine.load(DEMO, mode="sparse", kernels="background")
    try:
        prep = engine.kernel_preparation
        assert prep is not None and not prep.ready()
        assert numba_pool.kernels() is None  # this thread computes on the torch paths
        first = engine.generate("It is a truth", PARAMS)
        assert first.token_ids == expected
        assert fused_calls(engine) == 0 and engine.kernel_preparation is prep  # no kernel mid-answer
        gate.set()
        assert prep.wait(600) and prep.error is None
        assert prep.compiled() > 0
        assert kp.is_cached(kp.kind_of("sparse", "int8"))  # the next start loads them with the weights
        second = engine.generate("It is a truth", PARAMS)  # swapped in before its prompt
        assert engine.kernel_preparation is None and numba_pool.kernels() is not None
        assert second.token_ids == expected and fused_calls(engine) > 0
    finally:
        gate.set()
        if engine.kernel_preparation is not None:
            engine.kernel_preparation.wait(600)
            engine.swap_in_kernels()


def test_a_completed_preparation_loads_the_kernels_with_the_weights():
    Engine.load(DEMO, mode="sparse")  # writes nothing; make sure a stamp exists
    kind = kp.kind_of("sparse", "int8")
    kp.mark_cached(kind)
    engine = Engine.load(DEMO, mode="sparse", kernels="background")
    assert engine.kernel_preparation is None and numba_pool.kernels() is not None
    engine.generate("It is a truth", PARAMS)
    assert fused_calls(engine) > 0
