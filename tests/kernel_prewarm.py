"""Compiles the suite's CPU kernels into numba's disk cache in a process of its own, beside the
suite (conftest starts it when a run collects 200 tests or more, its log in the temp folder as
thermocline-prewarm-<pytest's pid>.log; THERMOCLINE_TEST_PREWARM=0 turns it off).

Why: on a fresh clone (CI) numba compiles every kernel at its first use, and that was about
half of a cold suite's time on a 2-core host (2,628 s, its ten slowest tests mostly compiles).
numba compiles on one core, so while the suite compiles or runs, the other core would idle.
Here it compiles what the suite needs later: each kernel the suite reaches after this process
cached it loads from the cache instead (numba checks its disk cache at every new signature),
and a kernel both compile at once is compiled twice, which costs this process, not the suite.

The suite's first files compile the demo's int8 kernels themselves, so this process starts
with the 4-bit kernels, the mixtures, the batch steps and the exact KV cache that later files
need. The files that compile most (conftest's COMPILE_HEAVY_MODULES: test_batching,
test_bench_smoke) run last in a run that starts this process, by when it is done (5.5-7
minutes on a 2-core host). The answers are never checked here; every step stands alone, and
one that fails is skipped.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path


def _steps(root: Path) -> list:
    """(name, step) in the order they run."""
    from engine import Engine
    from engine.runtime.sampling import SamplingParams
    from models_registry.resolve import resolve_model

    demo = resolve_model("demo")
    built: dict[str, Path] = {}

    def answer(model, mode, weights, kv=None):
        if kv is None:
            os.environ.pop("THERMOCLINE_KV_CACHE", None)
        else:
            os.environ["THERMOCLINE_KV_CACHE"] = kv
        path = built[model] if model in built else demo
        engine = Engine.load(path, mode=mode, cpu_weights=weights, kernels="wait")
        for _ in engine.stream("Mr. Darcy", SamplingParams(max_new_tokens=3, temperature=0.0)):
            pass

    def mixtures():
        import smallthinker_factory as sf
        import turbosparse_mixtral_factory as tf

        sizes = {"hidden": 256, "heads": 4, "kv_heads": 2, "experts": 8, "active": 2, "ff": 64, "layers": 2}
        built["smallthinker"] = sf.smallthinker(root / "st", seed=3, **{**sizes, "head_dim": 32})
        built["turbosparse-mixtral"] = tf.turbosparse_mixtral(root / "tsm", seed=4, **sizes)

    def kernels_int4():
        from engine.kernels import cpu_q4, cpu_q4x8, q4_tiles

        cpu_q4.warmup()
        q4_tiles.warmup()
        cpu_q4x8.warmup()

    def batch(mode):  # the batched decode's own kernels (engine.runtime.batching): test_batching
        from engine.runtime import fused_batch
        from engine.runtime.batching import Batch, Sequence

        engine = Engine.load(demo, mode=mode, kernels="wait")
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        runs = Batch(engine)
        for prompt in ("Mr. Darcy", "It is a truth universally"):
            runs.start(Sequence(engine.encode_prompt(prompt), params, lambda _ev: None, lambda _stats, _ids: None))
        fused_batch.wait_ready(1800)  # the batch kernels, on the thread the first batch starts
        while runs.active:
            runs.step()

    def kernels_all():
        from engine.kernels import cpu

        cpu.warmup(batch=True)

    steps = [("int4 kernels", kernels_int4), ("the mixtures", mixtures)]
    steps += [(f"{name} {mode} {weights}", lambda n=name, m=mode, w=weights: answer(n, m, w))
              for weights in ("int4", "int8") for name in ("smallthinker", "turbosparse-mixtral")
              for mode in ("sparse", "dense")]
    steps += [(f"demo {mode} int4", lambda m=mode: answer("demo", m, "int4")) for mode in ("sparse", "dense", "hybrid")]
    steps.append(("every cpu kernel", kernels_all))
    steps += [(f"demo {mode} int8, a batch of two", lambda m=mode: batch(m)) for mode in ("dense", "sparse")]
    steps += [(f"demo {mode} {weights}, fp32 cache", lambda m=mode, w=weights: answer("demo", m, w, kv="fp32"))
              for weights in ("int8", "fp32", "int4") for mode in ("sparse", "dense")]
    steps += [(f"demo {mode} {weights}", lambda m=mode, w=weights: answer("demo", m, w))
              for weights in ("fp32", "int8") for mode in ("sparse", "dense", "hybrid")]
    return steps


def main() -> int:
    try:
        os.nice(5)  # the suite's own work first, where both cores are busy
    except (AttributeError, OSError):
        pass
    with tempfile.TemporaryDirectory(prefix="thermocline-prewarm-") as tmp:
        for name, step in _steps(Path(tmp)):
            try:
                step()
                print(f"prewarm: {name}", flush=True)
            except Exception:  # noqa: BLE001 - a step the suite will compile itself, and test
                print(f"prewarm: {name} failed\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
