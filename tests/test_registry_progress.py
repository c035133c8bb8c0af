"""Speed, ETA and event delivery of the download progress meter, on a controlled clock."""

from __future__ import annotations

import pytest

from models_registry import progress as progress_mod
from models_registry.progress import DownloadCancelled, DownloadControl, ProgressMeter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_speed_and_eta_come_from_the_recent_window(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    events = []
    meter = ProgressMeter("org/m", total=10_000, callback=events.append, min_interval_s=0.0)
    meter.start_file("w.safetensors", 10_000, 0)
    for _ in range(5):
        clock.now += 1.0
        meter.add(1_000)  # 1000 bytes per second
    assert meter.speed() == pytest.approx(1_000)
    assert meter.eta() == pytest.approx(5.0)
    last = [e for e in events if e.kind == "progress"][-1]
    assert (last.done, last.file_done) == (5_000, 5_000)
    assert (last.speed_bps, last.eta_s) == (pytest.approx(1_000), pytest.approx(5.0))
    clock.now += 60.0  # a long pause: the old samples leave the window
    meter.reset_speed()
    meter.add(500)
    assert meter.speed() == 0.0 and meter.eta() is None  # unknown, not a stale guess


def test_throttled_events_still_add_up(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    events = []
    meter = ProgressMeter("org/m", total=1_000, callback=events.append, min_interval_s=10.0)
    meter.start_file("f", 1_000, 0)
    for _ in range(10):
        clock.now += 0.01
        meter.add(100)
    meter.end_file()
    progress = [e for e in events if e.kind == "progress"]
    assert 1 <= len(progress) < 10 and sum(e.delta for e in progress) == 1_000
    assert events[-1].kind == "file_done" and events[-1].file_done == 1_000


def test_control_pause_resume_cancel():
    control = DownloadControl()
    control.checkpoint()  # running: returns at once
    control.pause()
    assert control.paused and control.should_stop_stream()
    control.cancel()  # wakes a paused download, which then stops
    with pytest.raises(DownloadCancelled, match="partial files are kept"):
        control.checkpoint()
