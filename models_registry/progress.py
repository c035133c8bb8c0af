"""Download progress events, the meter that computes speed and ETA, and pause/cancel control.

Events go to one callback (`progress(event)`); the app turns them into Qt signals, the CLI
prints them. A `progress` event's `delta` is the bytes received since the previous event of
that file, so the deltas of a file plus its `resumed_from` add up to its size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from engine.errors import UserError

# kinds: plan, file_start, progress, file_done, retry, corrupt, paused, resumed, predictors, convert, done
EVENT_KINDS = ("plan", "file_start", "progress", "file_done", "retry", "corrupt", "paused", "resumed",
               "predictors", "convert", "done")


@dataclass(frozen=True)
class DownloadEvent:
    kind: str
    repo: str
    filename: str | None = None
    delta: int = 0  # progress: new bytes of `filename` since its previous event
    file_done: int = 0
    file_total: int = 0
    resumed_from: int = 0  # file_start: bytes kept from an earlier, interrupted transfer
    done: int = 0  # over the whole job (model and predictor repos)
    total: int = 0
    speed_bps: float = 0.0
    eta_s: float | None = None
    message: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class DownloadCancelled(UserError):
    """The user cancelled; partial files are kept and the next download continues them."""


class DownloadControl:
    """Thread-safe pause / resume / cancel for a running download."""

    def __init__(self) -> None:
        self._running = threading.Event()
        self._running.set()
        self._cancelled = threading.Event()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def cancel(self) -> None:
        self._cancelled.set()
        self._running.set()  # wake a paused download so it can stop

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def should_stop_stream(self) -> bool:
        """True when the current HTTP stream should be closed (paused or cancelled)."""
        return self.paused or self.cancelled

    def checkpoint(self, on_pause=None, on_resume=None) -> None:
        """Block while paused; raise DownloadCancelled once cancelled."""
        if self.paused and not self.cancelled:
            if on_pause:
                on_pause()
            self._running.wait()
            if on_resume and not self.cancelled:
                on_resume()
        if self.cancelled:
            raise DownloadCancelled("download cancelled; partial files are kept and the next download resumes them")

    def sleep(self, seconds: float, on_pause=None, on_resume=None) -> None:
        """Wait between retries, waking early on cancel; a pause that falls in the wait is
        reported through the same callbacks as `checkpoint`'s."""
        if seconds > 0:
            self._cancelled.wait(seconds)
        self.checkpoint(on_pause, on_resume)


class ProgressMeter:
    """Totals, speed over a sliding window, ETA, and throttled delivery of events."""

    WINDOW_S = 5.0

    def __init__(self, repo: str, total: int, callback=None, min_interval_s: float = 0.1) -> None:
        self.repo = repo
        self.total = total
        self.done = 0  # bytes of the job on disk: kept from earlier runs, plus fetched now
        self.transferred = 0  # bytes received over the network in this run
        self.callback = callback
        self.min_interval_s = min_interval_s
        self._samples: deque[tuple[float, int]] = deque()
        self._pending = 0
        self._last_emit = 0.0
        self._file = None
        self._file_done = 0
        self._file_total = 0

    def speed(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def eta(self) -> float | None:
        speed = self.speed()
        return (self.total - self.done) / speed if speed > 0 else None

    def emit(self, kind: str, filename: str | None = None, message: str = "", **extra) -> None:
        if self.callback is None:
            return
        self.callback(DownloadEvent(kind=kind, repo=self.repo, filename=filename, done=self.done,
                                    total=self.total, speed_bps=self.speed(), eta_s=self.eta(),
                                    message=message, **extra))

    def start_file(self, filename: str, size: int, resumed_from: int) -> None:
        self._file, self._file_total, self._file_done = filename, size, resumed_from
        self._pending = 0
        self._last_emit = 0.0  # the first bytes of every file are reported at once
        self.done += resumed_from
        self.emit("file_start", filename, file_done=resumed_from, file_total=size, resumed_from=resumed_from)

    def add(self, delta: int) -> None:
        self.done += delta
        self.transferred += max(delta, 0)
        self._file_done += delta
        self._pending += delta
        now = time.monotonic()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.WINDOW_S:
            self._samples.popleft()
        if now - self._last_emit >= self.min_interval_s:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._last_emit = time.monotonic()
            delta, self._pending = self._pending, 0
            self.emit("progress", self._file, delta=delta, file_done=self._file_done,
                      file_total=self._file_total)

    def discard(self, nbytes: int) -> None:
        """Bytes that no longer count (a damaged file about to be fetched again)."""
        self.flush()
        self.done -= nbytes
        self._file_done -= nbytes

    def reset_speed(self) -> None:
        """After a pause, old samples would make the speed look low."""
        self._samples.clear()

    def end_file(self, message: str = "") -> None:
        self.flush()
        self.emit("file_done", self._file, file_done=self._file_done, file_total=self._file_total,
                  message=message)
