"""Shared set-up for the GUI tests: the real window over a temporary database and settings,
with the real engine loading a tiny random model built by `model_factory`."""

from __future__ import annotations

import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

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


def send(qtbot, window, text: str) -> None:
    from PySide6.QtCore import Qt

    edit = window.chat.input.edit
    edit.setFocus()
    qtbot.keyClicks(edit, text)
    qtbot.keyClick(edit, Qt.Key.Key_Return)


def wait_idle(qtbot, window, timeout_ms: int = 60_000) -> None:
    qtbot.waitUntil(lambda: not window.chat.busy and not window.client.busy, timeout=timeout_ms)


class StallMeter:
    """The longest gap between ticks of a 5 ms GUI-thread timer.

    `max_gap` is the raw wall-clock gap. `max_app_gap` subtracts the time the GUI thread
    spent runnable but waiting for a CPU (Linux schedstat): on a machine whose cores are
    busy with other programs, that wait is the OS's doing, not the app's. Time spent
    waiting for the GIL or in our own handlers still counts.
    """

    def __init__(self, interval_ms: int = 5):
        from PySide6.QtCore import QTimer

        self.timer = QTimer()
        self.timer.setTimerType(__import__("PySide6.QtCore", fromlist=["Qt"]).Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.max_gap = 0.0
        self.max_app_gap = 0.0
        self.ticks = 0
        self._last = None
        self._last_wait = 0.0
        self._schedstat = None
        try:
            import threading

            path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            open(path).read()
            self._schedstat = path
        except OSError:
            pass

    def _runqueue_wait(self) -> float:
        if self._schedstat is None:
            return 0.0
        try:
            with open(self._schedstat) as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def start(self) -> None:
        self._last = time.perf_counter()
        self._last_wait = self._runqueue_wait()
        self.timer.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        wait = self._runqueue_wait()
        gap = now - self._last
        self.max_gap = max(self.max_gap, gap)
        self.max_app_gap = max(self.max_app_gap, gap - (wait - self._last_wait))
        self._last, self._last_wait = now, wait
        self.ticks += 1

    def stop(self) -> float:
        self.timer.stop()
        return self.max_app_gap
