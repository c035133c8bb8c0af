"""Decode speed of `dense` vs `sparse` vs `hybrid` on a random model of 7B layer shapes.

A few layers of ReluLLaMA-7B's shapes (d 4096, 11008 neurons, 32 heads, 32k vocabulary),
random weights, predictors of rank 1024 (PowerInfer's 7B predictors are of that order).
Random weights do not give a power law, so the active sets are drawn from one: neuron i
of a layer is in the set with probability p_i, a Zipf-like law scaled to the target
active fraction; the predictor still runs every token (its cost is real) but the drawn
set replaces its threshold. Statistics with the same p_i drive the hybrid placement.

`limit` is the bytes of weights read per token, dense over sparse, predictors included:
the speed-up a memory-bound decode could reach. Target: sparse/dense >= 85% of it. The
sparse engine's CPU tier holds its weight matrices as int8 rows (attention, head and
predictors too), so part of the limit is the int8 attention; the hybrid engine's fast tier is the CPU
standing in for a GPU here, in fp32, so hybrid reads more bytes than sparse.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from bench import emit

from engine import Engine, SamplingParams
from engine.hotcold.activation_stats import ActivationStats
from engine.loading.predictors import PredictorSet

# (d, n_ff, heads, vocab): ReluLLaMA-7B's layers, and tiny ones for --smoke (the test suite's
# check that the benchmark runs end to end; its figures mean nothing)
SHAPES = {"7B": (4096, 11008, 32, 32000), "smoke": (128, 512, 4, 512)}


def power_law(n: int, active: float, rng: np.random.Generator, alpha: float = 1.0) -> np.ndarray:
    """Firing probabilities p_i ~ 1/rank^alpha over a random neuron order, mean `active`, capped at 1."""
    weights = 1.0 / np.arange(1, n + 1) ** alpha
    scale = active * n / weights.sum()
    for _ in range(50):  # renormalise after capping so the mean stays on target
        p = np.minimum(weights * scale, 1.0)
        scale *= active * n / p.sum()
    return rng.permutation(np.minimum(weights * scale, 1.0))


def build_checkpoint(root: Path, layers: int, d: int, n_ff: int, heads: int, vocab: int, rank: int,
                     active: float, seed: int) -> tuple[Path, list[np.ndarray]]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).half()

    tensors = {"model.embed_tokens.weight": rand(vocab, d), "model.norm.weight": torch.ones(d).half(),
               "lm_head.weight": rand(vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = rand(d, d)
        tensors[p + "mlp.gate_proj.weight"] = rand(n_ff, d)
        tensors[p + "mlp.up_proj.weight"] = rand(n_ff, d)
        tensors[p + "mlp.down_proj.weight"] = rand(d, n_ff)
        tensors[p + "input_layernorm.weight"] = torch.ones(d).half()
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(d).half()
    save_file(tensors, str(root / "model.safetensors"))
    del tensors
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "relu", "hidden_size": d,
        "intermediate_size": n_ff, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float16",
    }))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import model_factory

    model_factory.build_tokenizer(root)
    rng = np.random.default_rng(seed)
    probs = [power_law(n_ff, active, rng) for _ in range(layers)]
    PredictorSet([torch.randn(rank, d, generator=g) * 0.02 for _ in range(layers)],
                 [torch.randn(n_ff, rank, generator=g) * 0.02 for _ in range(layers)], [0.0] * layers).save(root)
    ActivationStats([torch.from_numpy(p * 1e6) for p in probs], tokens=1_000_000).save(root)
    return root, probs


class DrawnSets:
    """Per layer, a stream of active sets drawn in advance (drawing costs nothing in the timing)."""

    def __init__(self, probs: list[np.ndarray], tokens: int, seed: int):
        rng = np.random.default_rng(seed + 1)
        self.masks = [torch.from_numpy(rng.random((tokens, len(p))) < p) for p in probs]
        self.step = [0] * len(probs)

    def __call__(self, layer: int) -> torch.Tensor:
        masks = self.masks[layer]
        mask = masks[self.step[layer] % len(masks)]
        self.step[layer] += 1
        return mask


def fired_fraction(engine: Engine, prompt: list[int]) -> float:
    """Share of neurons whose ReLU fires on real hidden states (random weights: about half)."""
    seen = []
    engine.model.ffn_observer = lambda layer, x, acts: seen.append(float((acts != 0).float().mean()))
    engine.score(prompt)
    engine.model.ffn_observer = None
    return float(np.mean(seen))


def decode_tok_s(engine: Engine, prompt: list[int], tokens: int) -> float:
    engine.reset()
    engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0))
    return engine.last_stats.decode_tok_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--active", type=float, default=0.10)
    parser.add_argument("--rank", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vram-share", type=float, default=0.30, help="hybrid VRAM budget: share of FFN weights")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rank, args.tokens, args.repeats = 16, 3, 1
    d, n_ff, heads, vocab = SHAPES["smoke" if args.smoke else "7B"]
    with tempfile.TemporaryDirectory() as tmp:
        root, probs = build_checkpoint(Path(tmp), args.layers, d, n_ff, heads, vocab, args.rank, args.active, 0)
        prompt = [0] + list(range(100, 115))
        ctx = len(prompt) + args.tokens + 4
        dense = Engine.load(root, ctx=ctx)
        sparse = Engine.load(root, mode="sparse", ctx=ctx, cpu_weights="int8")
        probe = sparse.sparse.problem
        ffn_fast_bytes = probe.neuron_fast * n_ff * args.layers
        dense_parts = probe.head_fast + sum(c.dense_fast + c.kv_fast for c in probe.layers)
        hybrid = Engine.load(root, mode="hybrid", ctx=ctx, cpu_weights="int8",
                             vram_budget=dense_parts + int(args.vram_share * ffn_fast_bytes))
        for engine in (dense, sparse, hybrid):
            engine.eos_ids = set()
        for engine in (sparse, hybrid):
            engine.sparse.override_masks = DrawnSets(probs, 64, 0)
        fired = fired_fraction(dense, prompt)
        for engine in (dense, sparse, hybrid):  # warm-up (numba compiles once, then reads its cache)
            decode_tok_s(engine, prompt, 2)
        runs = {"dense": [], "sparse": [], "hybrid": []}
        for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
            for name, engine in (("dense", dense), ("sparse", sparse), ("hybrid", hybrid)):
                runs[name].append(decode_tok_s(engine, prompt, args.tokens))
        active_measured, _ = sparse.last_stats.ffn_active_fraction, None
        hot_hit = hybrid.sparse.plan.hot_hit_fraction
        served_hot = hybrid.last_stats.hot_hit_fraction

    # Bytes of weights read per token (the KV cache is tiny at this context). Dense mode
    # reads fp32; sparse mode's CPU tier holds attention, head, predictors and FFN rows as
    # int8 rows with an fp32 scale each, norms in fp32.
    def int8(params: int, rows: int) -> int:
        return params + 4 * rows

    attn, attn_rows = 4 * d * d, 4 * d  # q, k, v, o
    norms = 2 * d
    dense_bytes = 4 * (args.layers * (attn + norms + 3 * d * n_ff) + vocab * d + d)
    sparse_ffn = n_ff * active_measured * (1 + fired * 2) * int8(d, 1)  # gate rows; up/down where fired
    predictor = int8(args.rank * (d + n_ff), args.rank + n_ff)
    sparse_bytes = (args.layers * (int8(attn, attn_rows) + 4 * norms + predictor + sparse_ffn)
                    + int8(vocab * d, vocab) + 4 * d)
    limit = dense_bytes / sparse_bytes
    med = {k: statistics.median(v) for k, v in runs.items()}
    speedup = med["sparse"] / med["dense"]
    result = {
        "shape": f"{args.layers} layers x ({d} x {n_ff}), vocab {vocab}",
        "active_target": args.active,
        "ffn_active_fraction": round(active_measured, 4),
        "fired_fraction_of_computed": round(fired, 3),
        "predictor_rank": args.rank,
        "cold_rows": "int8",
        "dense_tok_s": round(med["dense"], 3),
        "sparse_tok_s": round(med["sparse"], 3),
        "hybrid_tok_s": round(med["hybrid"], 3),
        "speedup": round(speedup, 3),
        "limit": round(limit, 3),
        "share_of_limit": round(speedup / limit, 3),
        "dense_gb_per_token": round(dense_bytes / 1e9, 3),
        "sparse_gb_per_token": round(sparse_bytes / 1e9, 3),
        "dense_implied_gbps": round(dense_bytes * med["dense"] / 1e9, 2),
        "sparse_implied_gbps": round(sparse_bytes * med["sparse"] / 1e9, 2),
        "hybrid_vram_share_of_ffn": args.vram_share,
        "hot_hit_fraction": round(hot_hit, 4),
        "hybrid_served_hot_fraction": round(served_hot, 4),
        "hybrid_fast_device": str(hybrid.sparse.fast),
        "runs": runs,
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
