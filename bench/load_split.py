"""Where a load's seconds go: `Engine.load` split into its parts, as it runs (the kernel warm-up
on its thread beside the weights), then the first answer after it. Prints one JSON object.

    python -m bench.load_split --model DIR [--mode sparse] [--cpu-weights int8] [--rounds 3]

Each round is a fresh process (numba and the page cache's state are per process and per file,
as for a user's second load): `load_s` as bench.vs_llamacpp times it; `warmup_thread_s` the
thread's own time (numba's registry refresh, 0.3-0.4 s once a process, and the prompt's
kernels); `wait_for_warmup_s` how long the load then waited for it; `model_s` the weights
(`Engine._load_model`); `fused_warm_s` the decode's compiled calls; `kernels_loaded` how many
kernels numba brought from its disk cache during the load and `kernels_in_first_answer` during
the first answer (a 20-token prompt and 4 tokens), whose time is `first_answer_s` (page faults
of the mapped weights included: the bench's TTFT comes after a warm-up answer).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def one_round(model: str, mode: str, cpu_weights: str, threads: int) -> dict:
    import numba.core.caching as caching
    import torch

    import engine.runtime.engine as engine_module
    from engine import Engine, SamplingParams
    from engine.runtime import fused_decode

    times: dict[str, float] = {}
    loaded = [0]
    original_load = caching.Cache.load_overload

    def load_overload(self, sig, target_context):
        loaded[0] += 1
        return original_load(self, sig, target_context)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    caching.Cache.load_overload = load_overload
    warmup = engine_module._KernelWarmup
    warmup._run = timed("warmup_thread_s", warmup._run)
    warmup.join = timed("wait_for_warmup_s", warmup.join)
    engine_module.Engine._load_model = classmethod(timed("model_s", engine_module.Engine._load_model.__func__))
    fused_decode.warm = timed("fused_warm_s", fused_decode.warm)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = Engine.load(model, mode=mode, ctx=512, threads=threads, cpu_weights=cpu_weights)
    times["load_s"] = time.perf_counter() - t0
    at_load = loaded[0]
    engine.eos_ids = set()
    t = time.perf_counter()
    engine.generate([1] + list(range(300, 319)), SamplingParams(max_new_tokens=4, temperature=0))
    times["first_answer_s"] = time.perf_counter() - t
    return {**{k: round(v, 4) for k, v in times.items()}, "kernels_loaded": at_load,
            "kernels_in_first_answer": loaded[0] - at_load}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="sparse")
    parser.add_argument("--cpu-weights", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_round(args.model, args.mode, args.cpu_weights, args.threads)))
        return 0
    from bench.vs_llamacpp import worker_env

    rounds = []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-m", "bench.load_split", "--one", "--model", args.model, "--mode",
                              args.mode, "--cpu-weights", args.cpu_weights, "--threads", str(args.threads)],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                             env=worker_env())
        if out.returncode != 0:
            raise SystemExit(f"a round failed:\n{out.stderr[-3000:]}")
        rounds.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(rounds, key=lambda r: r["load_s"])
    print(json.dumps({"mode": args.mode, "cpu_weights": args.cpu_weights, "best_load": best, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
