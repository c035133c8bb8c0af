"""PowerInfer's claim on one machine: hot neurons on the GPU, cold ones on the CPU, against
our all-CPU sparse decode and against offloading whole layers, with the same VRAM.

    python -m bench.hybrid [--layers 8] [--shares 0.25,0.5] [--json]     (bench/gpu.sh runs it)
    python -m bench.hybrid --smoke --json      (tiny shapes; the CPU stands in for the GPU)

One random model of 7B layer shapes (bench.vs_llamacpp's weights: exact predictors, whose
neurons fire at rates drawn from a power law of mean `--active`, so a hot set exists; its
activation statistics are those rates). For each VRAM budget, "dense parts + share x the
FFN's bytes on the fast tier":
- `hybrid`: our placement (the hottest neurons on the GPU, the rest on the CPU tier);
- `offload`: the layer-offload baseline. The same engine and kernels, but the statistics say
  the first layers' neurons always fire and the others never, so the solver fills the GPU
  with the first N whole layers' FFNs (N by the same VRAM; the next one in part), and every
  predictor's threshold is -inf: every neuron is computed, on the GPU for the first N layers
  and densely on the CPU for the rest. (The solver places every layer's attention on the GPU
  first when it fits, which only helps the baseline.)
- `cpu`: our all-CPU sparse decode (no VRAM).
Each engine is loaded alone (one at a time), warmed, then decodes greedily; the figure is the
best of `--repeats`. Correctness: the teacher-forced logits of a prompt, each engine against
the all-CPU one (the CPU tier's rows are `--cpu-weights`, the GPU's fp16): cosine similarity
and the share of positions with the same argmax. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import emit
from bench.sparse_decode import power_law
from bench.vs_llamacpp import SHAPES, make_weights, write_hf

NEVER = -1e30  # a threshold every logit passes: the predictor selects every neuron


def build(root: Path, shape, layers: int, rank: int, active: float, seed: int) -> tuple[Path, list[np.ndarray]]:
    import torch

    from engine.hotcold.activation_stats import ActivationStats

    rng = np.random.default_rng(seed)
    probs = [power_law(shape.n_ff, active, rng) for _ in range(layers)]
    tensors, fc1s, fc2s = make_weights(shape, layers, rank, active, seed, probs)
    write_hf(root, shape, tensors, fc1s, fc2s, layers)
    ActivationStats([torch.from_numpy(p * 1e6) for p in probs], tokens=1_000_000).save(root)
    return root, probs


def offload_copy(model: Path, dest: Path, layers: int, n_ff: int) -> Path:
    """The model's files (linked) with statistics that put whole layers first on the fast tier
    and predictors that select every neuron."""
    import torch

    from engine.hotcold.activation_stats import ActivationStats
    from engine.loading.predictors import PredictorSet

    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy(f, dest / f.name)
    # layer i's neurons "fire" with frequency 1 - i / layers: the solver takes layer 0 whole, then 1, ...
    ActivationStats([torch.full((n_ff,), 1e6 * (1 - i / layers), dtype=torch.float64) for i in range(layers)],
                    tokens=1_000_000).save(dest)
    preds = PredictorSet.load(model)
    PredictorSet(preds.fc1, preds.fc2, [NEVER] * layers, preds.source).save(dest)
    return dest


def measure(model: Path, mode: str, vram: int | None, prompt: list[int], tokens: int, repeats: int,
            cpu_weights: str, threads: int, reference=None) -> dict:
    import torch

    from engine import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine.load(model, mode=mode, ctx=len(prompt) + tokens + 8, vram_budget=vram, cpu_weights=cpu_weights,
                         threads=threads)
    load_s = time.perf_counter() - t0
    engine.eos_ids = set()
    logits = engine.score(prompt).float().cpu()
    rates = []
    for _ in range(repeats + 1):  # the first run warms the kernels and pages
        engine.reset()
        engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0))
        rates.append(engine.last_stats.decode_tok_s)
    plan = engine.sparse.plan
    out = {"decode_tok_s": max(rates[1:]), "load_s": round(load_s, 2),
           "ffn_active_fraction": round(engine.last_stats.ffn_active_fraction, 4),
           "served_hot_fraction": round(engine.last_stats.hot_hit_fraction, 4),
           "vram_bytes": engine.memory()["vram_bytes"], "fast_device": str(engine.sparse.fast),
           "layers_whole_on_fast": sum(len(ids) == engine.config.intermediate_size for ids in plan.hot_ids),
           "token_ids": list(engine.last_token_ids)}
    if reference is not None:
        out["cosine_vs_cpu"] = round(float(torch.nn.functional.cosine_similarity(logits, reference, dim=-1).min()), 5)
        out["top1_agree_vs_cpu"] = round(float((logits.argmax(-1) == reference.argmax(-1)).float().mean()), 4)
    del engine
    gc.collect()
    return out, logits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=256, help="gate rank; predictors have 2x this hidden size")
    parser.add_argument("--active", type=float, default=0.10, help="mean firing rate of the power law")
    parser.add_argument("--shares", default="0.25,0.5", help="VRAM budgets: shares of the FFN's fast-tier bytes")
    parser.add_argument("--cpu-weights", default="int8", choices=("int8", "int4", "fp32"))
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.rank, args.tokens, args.repeats, args.threads = 2, 8, 3, 1, 2
    shape = SHAPES["smoke" if args.smoke else "7B"]
    shares = [float(s) for s in args.shares.split(",")]
    prompt = [1] + list(range(300, 315))
    import torch

    from engine import Engine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, _ = build(Path(tmp) / "hf", shape, args.layers, args.rank, args.active, args.seed)
        offload = offload_copy(model, Path(tmp) / "offload", args.layers, shape.n_ff)
        build_s = time.perf_counter() - t0
        probe = Engine.load(model, mode="hybrid", ctx=64, vram_budget=0, cpu_weights=args.cpu_weights).sparse.problem
        ffn_fast = probe.neuron_fast * shape.n_ff * args.layers
        dense_parts = probe.head_fast + sum(c.dense_fast + c.kv_fast for c in probe.layers)
        del probe
        common = dict(prompt=prompt, tokens=args.tokens, repeats=args.repeats, cpu_weights=args.cpu_weights,
                      threads=args.threads)
        cpu, reference = measure(model, "sparse", None, **common)
        budgets = []
        for share in shares:
            vram = dense_parts + int(share * ffn_fast)
            hybrid, _ = measure(model, "hybrid", vram, reference=reference, **common)
            layered, _ = measure(offload, "hybrid", vram, reference=reference, **common)
            budgets.append({"vram_share_of_ffn": share, "vram_budget": vram, "hybrid": hybrid, "offload": layered,
                            "hybrid_vs_offload": round(hybrid["decode_tok_s"] / layered["decode_tok_s"], 3),
                            "hybrid_vs_cpu": round(hybrid["decode_tok_s"] / cpu["decode_tok_s"], 3)})
    result = {"shape": f"{args.layers} layers x ({shape.d} x {shape.n_ff}, {shape.heads} heads), vocab {shape.vocab}",
              "active_mean": args.active, "cpu_weights": args.cpu_weights, "threads": args.threads,
              "cuda": torch.cuda.is_available(), "build_s": round(build_s, 1), "ffn_fast_bytes": ffn_fast,
              "dense_parts_fast_bytes": dense_parts, "cpu": cpu, "budgets": budgets,
              "same_tokens_as_cpu": all(b[k]["token_ids"] == cpu["token_ids"] for b in budgets
                                        for k in ("hybrid", "offload"))}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
