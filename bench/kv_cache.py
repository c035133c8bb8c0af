"""The CPU KV cache in fp16 (the default) against fp32 (THERMOCLINE_KV_CACHE=fp32).

Two figures for one model shape (default: 7B, 32 layers of 32 KV heads of 128):
- memory per token of context: the bytes `KVCache` really allocates per slot, each format;
- decode attention time at long contexts: one layer's `cpu.decode_attention` (the fused
  numba kernel the decode step calls) over a cache filled to each length, fp32 and fp16
  interleaved in the same run, median of repeats.
The last line is one JSON object (`per_token_bytes`, `attention`: per context the times and
`fp16_speedup`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import emit


def per_token_bytes(layers: int, kv_heads: int, head_dim: int, cpu_16bit: bool) -> int:
    from engine.model.kv_cache import KVCache

    slots = 64
    cache = KVCache(layers, kv_heads, head_dim, slots, [torch.float32] * layers, [torch.device("cpu")] * layers,
                    cpu_16bit=cpu_16bit)
    return cache.nbytes // slots


def time_attention(q, k, v, length: int, scale: float, repeats: int) -> float:
    from engine.kernels import cpu

    cpu.decode_attention(q, k, v, length, scale)  # compiled and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu.decode_attention(q, k, v, length, scale)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--contexts", default="512,4096,16384", help="comma-separated lengths")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.kernels import cpu

    cpu.warmup(quants=())
    result = {
        "shape": {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "threads": args.threads,
        "per_token_bytes": {"fp32": per_token_bytes(args.layers, args.kv_heads, args.head_dim, False),
                            "fp16": per_token_bytes(args.layers, args.kv_heads, args.head_dim, True)},
        "attention": {},
    }
    torch.manual_seed(0)
    scale = args.head_dim ** -0.5
    q = torch.randn(args.heads, args.head_dim)
    for length in (int(c) for c in args.contexts.split(",")):
        k32 = torch.randn(args.kv_heads, length, args.head_dim)
        v32 = torch.randn(args.kv_heads, length, args.head_dim)
        k16, v16 = k32.half(), v32.half()
        t32, t16 = [], []
        for _ in range(3):  # interleaved rounds: both formats see the same machine load
            t32.append(time_attention(q, k32, v32, length, scale, args.repeats))
            t16.append(time_attention(q, k16, v16, length, scale, args.repeats))
        m32, m16 = min(t32), min(t16)
        result["attention"][str(length)] = {
            "fp32_ms": round(m32 * 1e3, 3), "fp16_ms": round(m16 * 1e3, 3), "fp16_speedup": round(m32 / m16, 2),
            "per_layer_bytes_read": {"fp32": k32.nbytes * 2, "fp16": k16.nbytes * 2},
        }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
