"""The fused decode (one compiled call per CPU layer) against the unfused path, in one process.

    python -m bench.fused_decode --model DIR [--mode sparse] [--cpu-weights int8] [--rounds 4] [--tokens 40]

Loads the model once and decodes the same greedy continuation with THERMOCLINE_FUSED_DECODE=1
and =0, alternating the order every round, so both see the same machine; reports decode tok/s of
each round, the ratio of the best and of the medians, whether the tokens agree, and which
layers ran fused (and why not). On a shared machine, read the medians; run `vs_llamacpp` for
the ratio against llama.cpp. Its `--workdir` keeps a bench model to point --model at (its hf/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench import emit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="sparse")
    parser.add_argument("--cpu-weights", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from engine import Engine, SamplingParams
    from engine.runtime.fused_decode import FUSED_ENV

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = Engine.load(args.model, mode=args.mode, ctx=512, threads=args.threads, cpu_weights=args.cpu_weights)
    load_s = time.perf_counter() - t0
    engine.eos_ids = set()
    prompt = list(range(1, 9))

    def run(flag: str) -> tuple[float, list[int]]:
        os.environ[FUSED_ENV] = flag
        engine.reset()
        engine.generate(prompt, SamplingParams(max_new_tokens=args.tokens + 1, temperature=0))
        return engine.last_stats.decode_tok_s, list(engine.last_token_ids)

    run("1"), run("0")  # warm-up: first touches of the weights
    rates: dict[str, list[float]] = {"1": [], "0": []}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for flag in ("1", "0") if r % 2 == 0 else ("0", "1"):
            rate, tokens[flag] = run(flag)
            rates[flag].append(round(rate, 2))
    os.environ.pop(FUSED_ENV, None)
    layers = engine.model.layers
    emit({"mode": args.mode, "cpu_weights": args.cpu_weights, "threads": args.threads, "load_s": round(load_s, 2),
          "fused_tok_s": rates["1"], "unfused_tok_s": rates["0"],
          "best_ratio": round(max(rates["1"]) / max(rates["0"]), 3),
          "median_ratio": round(statistics.median(rates["1"]) / statistics.median(rates["0"]), 3),
          "same_tokens": tokens["1"] == tokens["0"],
          "fused_calls": [layer.fused.calls if layer.fused is not None else 0 for layer in layers],
          "not_fused_because": sorted({layer.fused.why for layer in layers if layer.fused is not None} - {""}),
          "ffn_active_fraction": round(engine.last_stats.ffn_active_fraction, 4),
          "loadavg": [round(v, 2) for v in os.getloadavg()]}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
