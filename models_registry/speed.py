"""How fast a model will answer on this machine, before it is loaded: the bytes a token reads
(the placement's `ram_read_per_token` and `disk_read_per_token`) over the read bandwidth
this machine measures, in place of the placement's fixed 20 GB/s assumption.

At batch 1 a decode step is memory-bound (gpt-fast's rule: tokens/s ≈ bandwidth / bytes read
per token). The bandwidth is measured once per process by summing a buffer larger than any
cache on a few threads (numpy releases the GIL in reductions).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from engine.hotcold.placement import DISK_BANDWIDTH, WORDS_PER_TOKEN, decode_speed

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


def words_per_second(est, bandwidth: float | None = None) -> float:
    """Words a second a `fit.FitEstimate`'s reads per token allow at `bandwidth` (measured here)."""
    return decode_speed(est, bandwidth or read_bandwidth(), DISK_BANDWIDTH) * WORDS_PER_TOKEN


def speed_words(words_s: float) -> str:
    """`about 12 words a second on this machine`."""
    if words_s < 1:
        return "under one word a second on this machine"
    n = f"{round(words_s):,}"
    return f"about {n} word{'' if n == '1' else 's'} a second on this machine"
