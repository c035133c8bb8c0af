"""Placement solve time at 7B (32 x 11008) and 70B (80 x 28672) shapes.

Power-law neuron frequencies, a VRAM budget holding the dense parts and a third of the
FFN; median of several solves. Targets: <= 0.5 s (7B) and <= 2 s (70B).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from engine.arch import parse_config
from engine.hotcold.placement import solve
from engine.hotcold.sparse_solve import placement_problem

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000),
}
# --smoke: the test suite's check that the benchmark runs end to end (its figures mean nothing)
SMOKE = {"smoke": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=512)}


def measure(shape: dict, repeats: int) -> dict:
    config = parse_config({"model_type": "llama", "hidden_act": "relu", **shape})
    rng = np.random.default_rng(0)
    freqs = [np.sort(rng.pareto(1.1, config.intermediate_size))[::-1] / 50 for _ in range(config.num_layers)]
    problem = placement_problem(config, [1024] * config.num_layers, freqs, 2048, torch.device("cuda:0"),
                                torch.float16, "int8")
    dense = problem.head_fast + sum(c.dense_fast + c.kv_fast for c in problem.layers)
    neurons = config.num_layers * config.intermediate_size
    vram = dense + neurons // 3 * problem.neuron_fast
    times, plan = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        plan = solve(problem, vram, 1 << 42)
        times.append(time.perf_counter() - start)
    return {"solve_s": round(statistics.median(times), 4), "max_solve_s": round(max(times), 4),
            "neurons": neurons, "hot_hit_fraction": round(plan.hot_hit_fraction, 4),
            "vram_bytes": plan.vram_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else SHAPES
    result = {name: measure(shape, args.repeats) for name, shape in shapes.items()}
    result["targets_s"] = {"7b": 0.5, "70b": 2.0}
    if not args.json:
        for name in shapes:
            print(f"{name}: {result[name]['solve_s'] * 1000:.1f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
