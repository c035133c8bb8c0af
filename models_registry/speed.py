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

from .fit import VERDICT_DISK, disk_reason

PROBE_BYTES = 128 * 1024**2  # four times an L3 of 32 MB
READABLE_WORDS_PER_S = 8.0   # about reading pace: slower answers keep the reader waiting


# Each thread reads for at least this much CPU time: Windows counts it in 15.6 ms ticks.
MIN_CPU_S = 0.05 if os.name == "nt" else 0.01


@lru_cache(maxsize=1)
def read_bandwidth() -> float:
    """Bytes a second this machine reads from RAM on its cores (measured once per process)."""
    return measure_read_bandwidth()


def measure_read_bandwidth(nbytes: int = PROBE_BYTES) -> float:
    """Each thread sums its share of a buffer larger than any cache; its rate is counted over
    the CPU time it ran, not the wall clock, and the threads' rates add up. On the wall clock
    the probe measured how busy the cores were at that moment: at first start our own kernel
    compile shares them, and at a load of 20 here it read 1.1 GB/s where the cores read 15,
    which put "under one word a second" on every model. Time stalled on memory is CPU time,
    so the figure is still the memory's."""
    threads = max(1, min(os.cpu_count() or 1, 8))
    parts = np.array_split(np.ones(nbytes // 4, dtype=np.float32), threads)

    def rate(part: np.ndarray) -> float:
        start, rounds = time.thread_time(), 0
        while True:
            np.sum(part)
            rounds += 1
            spent = time.thread_time() - start
            if spent >= MIN_CPU_S or rounds >= 64:
                return part.nbytes * rounds / max(spent, 1e-6)

    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # pages touched, threads started
        for _ in range(3):
            best = max(best, sum(pool.map(rate, parts)))
    return best


def words_per_second(est, bandwidth: float | None = None) -> float:
    """Words a second a `fit.FitEstimate`'s reads per token allow at `bandwidth` (measured here)."""
    return decode_speed(est, bandwidth or read_bandwidth(), DISK_BANDWIDTH) * WORDS_PER_TOKEN


def speed_words(words_s: float) -> str:
    """`about 12 words a second on this machine`."""
    if words_s < 1:
        return "under one word a second on this machine"
    n = f"{round(words_s):,}"
    return f"about {n} word{'' if n == '1' else 's'} a second on this machine"


def measured_reason(est) -> str:
    """A verdict's reason for a row that shows its measured speed beside it: a disk verdict's
    reason drops the speed it gave at the placement's fixed bandwidths (two speeds on one card)."""
    return disk_reason(est, None) if est.verdict == VERDICT_DISK else est.reason
