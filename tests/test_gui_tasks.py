"""Background tasks (app/gui/tasks.py): a result that comes after its receiver is gone is dropped
quietly, as at exit while a Hub call is still timing out."""

from __future__ import annotations

import threading

import shiboken6
from PySide6.QtCore import QThreadPool

from app.gui import tasks


def test_a_task_that_outlives_its_relay_ends_without_an_error(qapp, capfd):
    release, results = threading.Event(), []
    tasks.run_in_background(lambda: release.wait(10) and "late", results.append)
    relay = next(iter(tasks._alive))
    shiboken6.delete(relay)  # what Qt's teardown does to a parentless QObject at exit
    release.set()
    assert QThreadPool.globalInstance().waitForDone(10_000)
    qapp.processEvents()
    tasks._alive.discard(relay)
    assert results == []
    assert "Signal source has been deleted" not in capfd.readouterr().err


def test_a_task_delivers_its_result_on_the_gui_thread(qtbot):
    results = []
    tasks.run_in_background(lambda: threading.current_thread().name, results.append)
    qtbot.waitUntil(lambda: bool(results), timeout=10_000)
    assert results[0] != threading.current_thread().name
