"""How fast a model will answer here, before it is loaded: the bytes a token reads over the
bandwidth this machine measures.

At batch 1 a decode step is memory-bound (gpt-fast's rule: tokens/s ≈ bandwidth / bytes read
per token), so the estimate needs two numbers:
- the bytes one token reads, from the placement's own tiers (`FitEstimate`): every dense
  matrix in RAM (attention, predictors, the head), and of the cold FFN rows only the share
  that fires; the embeddings are one row a token, the KV cache is small early in a chat;
- the machine's read bandwidth, measured once per process by summing a buffer larger than
  any cache on a few threads (numpy releases the GIL in reductions).

The GPU's bandwidth is not measured: its share is counted at `GPU_BANDWIDTH_RATIO` times the
RAM's, which only matters when a model is mostly in RAM anyway. Words are about 3/4 of a
token in English text.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

WORDS_PER_TOKEN = 0.75
GPU_BANDWIDTH_RATIO = 10.0
# Working predictors predict this much more firing than there is (DESIGN.md: 8-13 points).
PREDICTOR_SLACK = 0.10
PROBE_BYTES = 128 * 1024**2  # four times an L3 of 32 MB
READABLE_WORDS_PER_S = 8.0   # about reading pace: slower answers keep the reader waiting


@lru_cache(maxsize=1)
def read_bandwidth() -> float:
    """Bytes a second this machine reads from RAM on its cores (the best of three passes)."""
    threads = max(1, min(os.cpu_count() or 1, 8))
    parts = np.array_split(np.ones(PROBE_BYTES // 4, dtype=np.float32), threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # pages touched, threads started
        for _ in range(3):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return PROBE_BYTES / max(best, 1e-6)


def active_share(sparsity: float | None, routed: bool) -> float:
    """The share of FFN rows a token reads: all of them without a known sparsity; a router's
    choice is exact, predictors read a little more than fires."""
    if sparsity is None:
        return 1.0
    return min(1.0, 1.0 - sparsity + (0.0 if routed else PREDICTOR_SLACK))


def bytes_per_token(est, active: float, cpu_weights: str = "int8") -> tuple[int, int]:
    """(bytes read from RAM, bytes read from VRAM) per token for a `models_registry.fit.FitEstimate`
    placed with `cpu_weights` (the placement's rule for a tied head: it reads the fp32
    embeddings unless a mixture keeps its own quantised copy)."""
    shape = est.shape
    embeddings = shape["vocab"] * shape["d"] * 4  # fp32 rows, one read a token...
    head_is_them = shape["tied_embeddings"] and not (shape["expert_ff"] and cpu_weights in ("int8", "int4"))
    skipped = 0 if head_is_them and not est.globals_on_gpu else embeddings  # ...unless they are the head
    ram = max(0, est.dense_cpu_bytes - skipped) + est.predictor_cpu_bytes + int(est.cold_ffn_bytes * active)
    vram = est.dense_gpu_bytes + est.predictor_gpu_bytes + int(est.hot_ffn_bytes * active)
    return ram, vram


def tokens_per_second(est, sparsity: float | None, bandwidth: float, cpu_weights: str = "int8") -> float:
    active = active_share(sparsity, routed=bool(est.shape["expert_ff"]))
    ram, vram = bytes_per_token(est, active, cpu_weights)
    seconds = ram / bandwidth + vram / (bandwidth * GPU_BANDWIDTH_RATIO)
    return 1.0 / seconds if seconds > 0 else 0.0


def words_per_second(est, sparsity: float | None, bandwidth: float | None = None,
                     cpu_weights: str = "int8") -> float:
    return tokens_per_second(est, sparsity, bandwidth or read_bandwidth(), cpu_weights) * WORDS_PER_TOKEN


def speed_words(words_s: float) -> str:
    """`about 12 words a second on this machine`."""
    if words_s >= 10:
        n = f"{round(words_s):,}"
    elif words_s >= 1:
        n = f"{words_s:.0f}"
    else:
        return "under one word a second on this machine"
    return f"about {n} word{'' if n == '1' else 's'} a second on this machine"
