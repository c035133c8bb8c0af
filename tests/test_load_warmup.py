"""Engine.load's kernel warm-up: a second load of a prepared model and its warm-up thread (which
runs on past the load's end; the first computation waits for it) leave nothing for the first
prompt and the decode after it to load from numba's cache (each a fresh process: numba's
dispatchers remember what this test process already ran); the unfused decode's kernels are
loaded where the decode is not fused; an answer right after the load is the one after the
warm-up; an error on the warm-up thread is the first answer's error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import real_config_models as rc
from engine import Engine, SamplingParams
from engine.kernels import cpu_numba
from engine.runtime import engine as engine_module
from engine.runtime import fused_decode
from test_sparse import RAM, random_predictors

pytestmark = pytest.mark.skipif(not cpu_numba.HAS_AVX2, reason="the fused decode runs on AVX2 hosts")

# hidden 256: int8 products with int8 activations (d % 128) and 4-bit tiles (8 blocks a row)
WIDE = {"hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4}
LOADS = [("sparse", "int8"), ("sparse", "int4"), ("dense", "int4"), ("dense", "int8")]

# Counts each numba dispatcher's specialisations of the engine's kernel modules before and
# after a first generate (a prompt, then decoded tokens) and prints the ones that grew.
CHILD = """
import json, sys
from numba.core.registry import CPUDispatcher
from engine import Engine, SamplingParams

def counts():
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("engine.kernels.") and m is not None]
    return {f"{m.__name__}.{k}": len(v.overloads) for m in mods for k, v in vars(m).items()
            if isinstance(v, CPUDispatcher)}

path, mode, weights = sys.argv[1:4]
engine = Engine.load(path, mode=mode, cpu_weights=weights, ram_budget=1 << 30)
engine.wait_kernels()  # what the load left loading on its thread (the first computation waits for it)
before = counts()
engine.eos_ids = set()
engine.generate(list(range(5, 25)), SamplingParams(max_new_tokens=4, temperature=0))
after = counts()
print(json.dumps({k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A ProSparse-shaped model with predictors, loaded once in every mode (the first loads
    write the prepared files)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rc, "TINY", WIDE)
        path, _, _ = rc.prosparse(tmp_path_factory.mktemp("warmup") / "prosparse")
    random_predictors(Engine.load(path).config, rank=128).save(path)
    for mode, weights in LOADS:
        Engine.load(path, mode=mode, cpu_weights=weights, ram_budget=RAM).close()
    return path


@pytest.mark.parametrize("mode,weights", LOADS)
def test_a_second_load_leaves_no_kernel_for_the_first_answer_to_load(model, mode, weights):
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), mode, weights], capture_output=True,
                         text=True, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_unfused_decode_gets_every_kernel_warmed(model, monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module._KernelWarmup, "run_all", staticmethod(lambda *a: calls.append(a)))
    def load(mode):
        engine = Engine.load(model, mode=mode, cpu_weights="int8", ram_budget=RAM)
        engine.wait_kernels()
        engine.close()

    load("sparse")
    assert calls == []  # fused: the prompt's kernels on the thread, the decode's in fused_decode.warm
    monkeypatch.setenv(fused_decode.FUSED_ENV, "0")
    load("sparse")
    load("oracle")
    assert calls == [("sparse", "int8"), ("oracle", "int8")]


def test_an_error_on_the_warm_up_thread_is_the_loads_error(model, monkeypatch):
    def broken(mode, weights):
        raise RuntimeError(f"warm-up failed for {mode} {weights}")

    monkeypatch.setattr(engine_module._KernelWarmup, "run_prompt", staticmethod(broken))
    engine = Engine.load(model, mode="sparse", cpu_weights="int4", ram_budget=RAM)  # the weights are in
    with pytest.raises(RuntimeError, match="warm-up failed for sparse int4"):  # the first answer says it
        engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0))



@pytest.mark.parametrize("mode,weights", [("sparse", "int8"), ("dense", "int4")])
def test_an_answer_right_after_the_load_is_the_one_after_its_warm_up(model, mode, weights):
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    answers = []
    for wait in (False, True):
        engine = Engine.load(model, mode=mode, cpu_weights=weights, ram_budget=RAM)
        engine.eos_ids = set()
        if wait:
            engine.wait_kernels()
        answers.append(engine.generate(list(range(5, 25)), greedy).token_ids)
        assert engine._warmup is None  # the first computation waited for it
        engine.close()
    assert answers[0] == answers[1]


# Loads and ends at once, as a CLI command or a bench worker does; an exit handler registered
# before the engine's runs after it and reports whether the warm-up thread was still running.
EXITS_AT_ONCE = """
import atexit, sys
state = {}
atexit.register(lambda: print("warm-up alive at exit:", state["warm"]._thread.is_alive(), flush=True))
from engine import Engine
engine = Engine.load(sys.argv[1], mode="sparse", cpu_weights="int4", ram_budget=1 << 30)
state["warm"] = engine._warmup
assert state["warm"] is not None
"""


def test_a_process_that_ends_right_after_a_load_waits_for_the_warm_up(model):
    # a daemon thread cut off inside numba's compiler aborted the bench's worker at exit
    # ("terminate called without an active exception")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", EXITS_AT_ONCE, str(model)], capture_output=True, text=True,
                         cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warm-up alive at exit: False" in out.stdout, out.stdout + out.stderr[-2000:]
