"""The CPU kernels' thread count, chosen between decode steps from the steps' own times.

A parallel kernel ends when its slowest thread does. When another process holds one of
the cores, a step on every thread waits for the descheduled one: on the shared 2-core host
(load 7-8, SmallThinker-4B shapes, int8) a token took 46 ms on one thread and 45-312 ms on
two. So the decode times itself (`ThreadTuner`): every `period` steps it runs `trial`
steps at each candidate count (one thread first, then half, then all) and keeps the
fastest by median until the next probe; a step slower than `slack` times that median
starts a probe early. A candidate whose step takes `2 * slack` times one thread's median
is dropped from the probe at once, so a probe costs at most one collapsed step.
The kernels split their work as for all threads whatever runs it
(numba_pool.set_running_threads), so the numbers never depend on the choice.
THERMOCLINE_THREAD_TUNING=0 keeps every thread.
"""

from __future__ import annotations

import os
import statistics

from engine.kernels import numba_pool


def enabled() -> bool:
    return os.environ.get("THERMOCLINE_THREAD_TUNING", "1").strip() not in ("0", "off", "no")


class ThreadTuner:
    """Pure bookkeeping: `count()` is the thread count for the coming step, `record(seconds)`
    its time; `apply()` hands the count to the kernels' pool."""

    def __init__(self, max_threads: int, period: int = 32, trial: int = 3, slack: float = 2.0):
        self.candidates = sorted({max_threads, max(1, max_threads // 2), 1})  # one thread first: the baseline
        self.period, self.trial, self.slack = period, trial, slack
        self.best = self.candidates[0]
        self.best_median: float | None = None
        self._queue: list[int] = []
        self._samples: dict[int, list[float]] = {}
        self._since = 0
        self._recent: list[float] = []
        self.probes = 0
        if len(self.candidates) > 1:
            self._start_probe()

    @property
    def probing(self) -> bool:
        return bool(self._queue)

    def _start_probe(self) -> None:
        self._queue = [c for c in self.candidates for _ in range(self.trial)]
        self._samples = {c: [] for c in self.candidates}
        self.probes += 1

    def count(self) -> int:
        return self._queue[0] if self._queue else self.best

    def record(self, seconds: float) -> None:
        if self._queue:
            count = self._queue.pop(0)
            self._samples[count].append(seconds)
            base = self._samples[self.candidates[0]]
            if (count != self.candidates[0] and len(base) == self.trial
                    and seconds > 2 * self.slack * statistics.median(base)):
                self._queue = [c for c in self._queue if c != count]  # collapsed: no more steps of it
            if not self._queue:
                medians = {c: statistics.median(t) for c, t in self._samples.items()}
                self.best = min(medians, key=lambda c: (medians[c], -c))  # ties: more threads
                self.best_median = medians[self.best]
                self._since, self._recent = 0, []
            return
        if len(self.candidates) == 1:
            return
        self._since += 1
        self._recent = (self._recent + [seconds])[-self.trial:]
        slow = (self.best_median is not None and len(self._recent) == self.trial
                and statistics.median(self._recent) > self.slack * self.best_median)
        if self._since >= self.period or slow:
            self._start_probe()

    def apply(self) -> numba_pool.running_threads:
        """The kernels' thread count for the coming step, as a scope: `with tuner.apply():`
        (only that step's calls, on the calling thread, run on the chosen count)."""
        return numba_pool.running_threads(self.count())


def for_this_process() -> ThreadTuner | None:
    """A tuner over the kernels' threads, or None (tuning off, no numba kernels, one thread)."""
    if not enabled() or numba_pool.module() is None:
        return None
    threads = numba_pool.configured_threads()
    return ThreadTuner(threads) if threads > 1 else None
