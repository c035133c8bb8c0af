"""Shared set-up for the GUI tests: the real window over a temporary database and settings,
with the real engine loading a tiny random model built by `model_factory`."""

from __future__ import annotations

import os
import time


LOAD_TIMEOUT_MS = 120_000


def make_window(qtbot, tmp_path, model_dir, *, mode="dense", max_new_tokens=32, temperature=0.0,
                start=True, monkeypatch=None):
    """A MainWindow over fresh storage/settings in tmp_path, loading `model_dir`."""
    from app.gui.main import make_application, preload_engine
    from app.gui.main_window import MainWindow
    from app.settings import Settings
    from app.storage import Storage

    if monkeypatch is not None:
        monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(tmp_path / "models"))
        monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
        monkeypatch.setenv("THERMOCLINE_DATA_DIR", str(tmp_path / "data"))
    make_application()
    preload_engine()  # as run_window does before the window shows
    settings = Settings(tmp_path / "cfg" / "settings.json")
    if settings.is_default("model.active"):
        settings["model.active"] = str(model_dir)
        settings["engine.mode"] = mode
        settings["ui.welcome_shown"] = True
        settings["chat.temperature"] = temperature
        settings["chat.max_new_tokens"] = max_new_tokens
    storage = Storage(tmp_path / "data" / "conversations.db")
    window = MainWindow(storage, settings, show_welcome=False)
    qtbot.addWidget(window)
    window.resize(1100, 720)
    window.show()
    if start:
        window.start()
        qtbot.waitUntil(lambda: window.client.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    return window


def close_window(window) -> None:
    window.close()
    window.storage.close()


def send(qtbot, window, text: str, key_delay_ms: int = -1) -> None:
    """Type `text` and press Enter. With `key_delay_ms` >= 0 the event loop runs between keys,
    as when a person types; by default QTest delivers every key inside this one call, which
    an event-loop stall meter would count as a single long turn."""
    from PySide6.QtCore import Qt

    edit = window.chat.input.edit
    edit.setFocus()
    paced = {"delay": key_delay_ms} if key_delay_ms >= 0 else {}  # test_gui_chat's plain-process Bot has no delay
    qtbot.keyClicks(edit, text, **paced)
    qtbot.keyClick(edit, Qt.Key.Key_Return, **paced)


def wait_idle(qtbot, window, timeout_ms: int = 60_000) -> None:
    qtbot.waitUntil(lambda: not window.chat.busy and not window.client.busy, timeout=timeout_ms)


class StallMeter:
    """The longest gap between ticks of a 5 ms GUI-thread timer.

    `max_gap` is the raw wall-clock gap. `max_app_gap` is the part of a gap the app is to
    blame for, on a machine whose cores other programs keep busy (Linux schedstat: run time
    and run-queue wait of each of our threads):
    - the GUI thread's own run time always counts (a slow handler is the app's);
    - its run-queue wait never does (it was runnable; the OS gave its core to someone else);
    - the rest of the gap it slept: idle, or blocked on the GIL or a lock that another of our
      threads held. Of that, the longest run-queue wait of any other of our threads in the
      gap is taken out: a GIL holder the OS has descheduled cannot hand the GIL back (the
      source of this test's failures on a loaded machine), and no holder waits longer than
      the longest wait. Time a holder spends running (holding the GIL over a long call, or a
      lock the GUI needs) still counts.
    `worst` keeps the parts of the gap that set `max_app_gap`, to say where a stall went.
    """

    def __init__(self, interval_ms: int = 5):
        from PySide6.QtCore import QTimer

        self.timer = QTimer()
        self.timer.setTimerType(__import__("PySide6.QtCore", fromlist=["Qt"]).Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.max_gap = 0.0
        self.max_app_gap = 0.0
        self.worst: dict = {}
        self.ticks = 0
        self._last = None
        self._last_stats: dict[str, tuple[float, float]] = {}
        self._gui = None
        try:
            import threading

            self._gui = str(threading.get_native_id())
            self._read_stats()
        except OSError:
            self._gui = None

    @staticmethod
    def _read_stats() -> dict[str, tuple[float, float]]:
        """(seconds run, seconds waited runnable) of each thread of this process."""
        stats = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run, wait = f.read().split()[:2]
            except (OSError, ValueError):
                continue  # a thread that ended in between
            stats[tid] = (int(run) / 1e9, int(wait) / 1e9)
        return stats

    def start(self) -> None:
        self._last = time.perf_counter()
        self._last_stats = self._read_stats() if self._gui else {}
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        gap = now - self._last
        self.max_gap = max(self.max_gap, gap)
        parts = {"gap": gap, "gui_run": gap, "gui_wait": 0.0, "others_wait": 0.0}
        if self._gui is not None:
            stats = self._read_stats()
            run0, wait0 = self._last_stats.get(self._gui, (0.0, 0.0))
            run1, wait1 = stats.get(self._gui, (run0, wait0))
            others = [w - self._last_stats[t][1] for t, (_, w) in stats.items()
                      if t != self._gui and t in self._last_stats]
            parts.update(gui_run=run1 - run0, gui_wait=wait1 - wait0, others_wait=max(others, default=0.0))
            self._last_stats = stats
        slept = max(0.0, gap - parts["gui_run"] - parts["gui_wait"])
        app = min(gap, parts["gui_run"] + max(0.0, slept - parts["others_wait"]))
        if app > self.max_app_gap:
            self.max_app_gap, self.worst = app, parts
        self._last = now
        self.ticks += 1

    def stop(self) -> float:
        self.timer.stop()
        return self.max_app_gap
