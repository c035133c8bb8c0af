"""Decode of a SmallThinker-4BA0.6B-shaped mixture of experts: bytes read per token and speed.

Random weights with the 4B config's layer shapes (d 1536, 12 query / 2 KV heads of 128,
32 ReGLU experts of 768 neurons, 4 chosen per token), layers and vocabulary cut so it
fits this machine (defaults: 4 layers, 32000 tokens; the real model has 32 and 151936).

- `dense`: every expert in fp32 on the CPU, the chosen ones computed with full matmuls.
- `sparse`: every expert on the CPU tier as int8 rows (attention and router too); the
  kernel computes a chosen expert's gate rows, then the up and down rows of the neurons
  whose relu(gate) fired only (the second level of sparsity).

Bytes per decoded token are counted from what the engine read (its expert counters) and
the dense parts' sizes, against the bound "attention + router + norms + the k chosen
experts whole + the head". The gates fire about 20% of an expert's neurons (`FIRE`), as
trained ReGLU experts do; random gates alone would fire half. llama.cpp on the same weights is
bench.moe_vs_llamacpp (which reuses this checkpoint). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench import emit

from engine import Engine, SamplingParams
from engine.runtime import fused_decode

TESTS = Path(__file__).resolve().parent.parent / "tests"
REAL = TESTS / "data" / "real_configs" / "smallthinker-4b" / "config.json"
# --smoke: the real config with tiny layers (the test suite's check that the benchmark runs
# end to end; its figures mean nothing)
FIRE = 0.2  # share of a chosen expert's neurons that fire (bench weights; None: random gates, ~half)
SMOKE = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2, moe_ffn_hidden_size=64,
             moe_num_primary_experts=8, moe_num_active_primary_experts=2)


def build_checkpoint(root: Path, layers: int, vocab: int, seed: int, smoke: bool = False,
                     fire: float | None = FIRE) -> tuple[Path, dict]:
    """The checkpoint; with `fire`, a chosen expert's neurons fire at about that rate, as
    trained ReGLU experts do (random gates alone fire half): every embedding carries one
    shared direction u (half its norm after RMSNorm), every gate row a negative component
    -beta u, so relu(gate) fires where the row's random part exceeds beta |x . u|; the output
    and down projections are scaled down so the residual stream keeps u through the layers."""
    cfg = json.loads(REAL.read_text())
    cfg.update(num_hidden_layers=layers, vocab_size=vocab, rope_layout=[1] * layers,
               sliding_window_layout=[0] * layers, bos_token_id=0, eos_token_id=[0, 2], **(SMOKE if smoke else {}))
    d, hd, n, experts = cfg["hidden_size"], cfg["head_dim"], cfg["moe_ffn_hidden_size"], cfg["moe_num_primary_experts"]
    q_rows, kv_rows = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).bfloat16()

    root.mkdir(parents=True, exist_ok=True)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    # x . u = sqrt(d / 2) after RMSNorm; a gate row's random part . x ~ N(0, 1 / 2)
    beta = 0.0 if fire is None else torch.special.ndtri(torch.tensor(1 - fire)).item() * 0.5 ** 0.5 / (d / 2) ** 0.5
    shrink = 1.0 if fire is None else 0.1
    emb = torch.randn(vocab, d, generator=g) + (0.0 if fire is None else d ** 0.5) * u

    def gate_rows(n_rows):
        return (torch.randn(n_rows, d, generator=g) * (2 * d) ** -0.5 - beta * u).bfloat16()

    tensors = {"model.embed_tokens.weight": emb.bfloat16(), "model.norm.weight": torch.ones(d).bfloat16()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(d).bfloat16()
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(d).bfloat16()
        tensors[p + "self_attn.q_proj.weight"] = rand(q_rows, d)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_rows, d)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_rows, d)
        tensors[p + "self_attn.o_proj.weight"] = rand(d, q_rows, scale=shrink * q_rows ** -0.5)
        tensors[p + "block_sparse_moe.primary_router.weight"] = rand(experts, d, scale=d ** -0.5 * 4)
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            tensors[q + "gate.weight"] = gate_rows(n) if fire is not None else rand(n, d)
            tensors[q + "up.weight"] = rand(n, d)
            tensors[q + "down.weight"] = rand(d, n, scale=shrink * n ** -0.5)
        save_file(tensors, str(root / f"model-{i:05d}.safetensors"))  # a shard per layer: less peak memory
        tensors = {}
    index = {"metadata": {}, "weight_map": {}}
    from safetensors import safe_open

    for shard in sorted(root.glob("model-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            index["weight_map"].update({k: shard.name for k in f.keys()})
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(cfg))
    sys.path.insert(0, str(TESTS))
    import smallthinker_factory

    smallthinker_factory.build_tokenizer(root, 300)
    return root, cfg


def decode(engine: Engine, prompt: list[int], tokens: int) -> float:
    engine.reset()
    engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0))
    return engine.last_stats.decode_tok_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.vocab, args.tokens, args.repeats = 2, 512, 3, 1
    prompt = [3] + list(range(100, 115))
    with tempfile.TemporaryDirectory() as tmp:
        root, cfg = build_checkpoint(Path(tmp) / "m", args.layers, args.vocab, 0, args.smoke)
        ctx = len(prompt) + args.tokens + 8
        dense = Engine.load(root, ctx=ctx)
        sparse = Engine.load(root, mode="sparse", ctx=ctx, cpu_weights="int8")
        for engine in (dense, sparse):
            engine.eos_ids = set()
            decode(engine, prompt, 2)  # warm-up: kernels compiled or read from numba's cache
        fused_decode.wait_compiled_behind()  # the mixture's layer calls, where numba's cache lacked them
        runs = {"dense": [], "sparse": []}
        for _ in range(args.repeats):  # interleaved, so load changes hit both alike
            for name, engine in (("dense", dense), ("sparse", sparse)):
                runs[name].append(decode(engine, prompt, args.tokens))
        counters = sparse.sparse.counters
        steps = counters.experts_chosen // (cfg["moe_num_active_primary_experts"] * args.layers)
        expert_read = counters.expert_bytes / steps
        active_fraction = sparse.last_stats.ffn_active_fraction
        same_ids = dense.last_token_ids == sparse.last_token_ids

    d, hd, n = cfg["hidden_size"], cfg["head_dim"], cfg["moe_ffn_hidden_size"]
    experts, k, layers = cfg["moe_num_primary_experts"], cfg["moe_num_active_primary_experts"], args.layers
    q_rows, kv_rows = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def int8(params: int, rows: int) -> int:  # int8 rows with an fp32 scale each
        return params + 4 * rows

    attention = (q_rows + 2 * kv_rows) * d + d * q_rows
    attention_rows = q_rows + 2 * kv_rows + d
    per_layer_dense_int8 = int8(attention, attention_rows) + int8(experts * d, experts) + 4 * 2 * d
    head = int8(args.vocab * d, args.vocab)  # tied head: its int8 copy on the CPU tier
    expert_whole_int8 = int8(3 * n * d, 3 * n)
    sparse_bytes = layers * per_layer_dense_int8 + expert_read + head + 4 * d
    bound = layers * (per_layer_dense_int8 + k * expert_whole_int8) + head + 4 * d
    dense_bytes = 4 * (layers * (attention + experts * d + 2 * d + k * 3 * n * d) + args.vocab * d + d)
    med = {name: statistics.median(v) for name, v in runs.items()}
    result = {
        "shape": f"SmallThinker-4B{' (smoke: tiny)' if args.smoke else ''} layers x {layers}, vocab {args.vocab}"
                 " (random weights)",
        "load_1min": os.getloadavg()[0],
        "dense_tok_s": round(med["dense"], 2),
        "sparse_int8_tok_s": round(med["sparse"], 2),
        "speedup": round(med["sparse"] / med["dense"], 3),
        "same_greedy_ids": same_ids,
        "ffn_active_fraction": round(active_fraction, 4),
        "fired_share_inside_chosen_experts": round(active_fraction * experts / k, 4),
        "expert_bytes_read_per_token_MB": round(expert_read / 1e6, 3),
        "chosen_experts_whole_MB": round(layers * k * expert_whole_int8 / 1e6, 3),
        "second_level_saving": round(1 - expert_read / (layers * k * expert_whole_int8), 4),
        "sparse_MB_per_token": round(sparse_bytes / 1e6, 2),
        "bound_MB_per_token": round(bound / 1e6, 2),
        "reads_within_bound": sparse_bytes <= bound,
        "head_share_of_sparse_bytes": round(head / sparse_bytes, 3),
        "dense_MB_per_token": round(dense_bytes / 1e6, 2),
        "dense_implied_gbps": round(dense_bytes * med["dense"] / 1e9, 2),
        "sparse_implied_gbps": round(sparse_bytes * med["sparse"] / 1e9, 2),
        "runs": runs,
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
