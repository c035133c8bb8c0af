"""The window under faults (issue 16): a disk that fills mid-answer, a second launch.

The disk-full case runs the real window and engine over a database on a small tmpfs (skipped,
with the reason, where mounting is not allowed) and fills it while the answer streams.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest
from PySide6.QtCore import Qt

from gui_helpers import close_window, make_window, wait_idle
from hostile_cases import REPO, Sandbox
from test_hostile_files import fill_disk, tmpfs  # noqa: F401

pytestmark = pytest.mark.timeout(600)


def _error_dialogs(window):
    from PySide6.QtWidgets import QMessageBox

    return [b for b in window.findChildren(QMessageBox) if b.objectName() == "errorDialog" and b.isVisible()]


def _send(qtbot, window, text):
    from gui_helpers import send

    send(qtbot, window, text)


@pytest.fixture
def full_disk_window(qtbot, tmp_path, llama_dir, monkeypatch, tmpfs):
    data = tmpfs(tmp_path / "data", "1m")
    window = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=300, monkeypatch=monkeypatch)
    yield window, data


def test_disk_full_mid_answer_keeps_the_answer_tells_once_and_saves_later(qtbot, full_disk_window):
    from app.storage import COMPLETE

    window, data = full_disk_window
    tokens, fillers = [], []

    def on_token(_request, text):
        tokens.append(text)
        if len(tokens) == 3:  # the answer has started and been saved once: now the disk fills
            fillers.append(fill_disk(data))

    window.client.worker.token.connect(on_token)
    _send(qtbot, window, "tell me about the fox")
    wait_idle(qtbot, window)
    assert fillers, "the answer ended before the disk could be filled"

    answer = "".join(tokens)
    shown = window.chat.view.messages()
    assert shown[-1].role == "assistant" and shown[-1].text() == answer  # the screen kept up
    assert not window.chat.busy and not window.client.busy  # not stuck busy
    assert window.chat.input.button.text() != "Stop"
    assert len(_error_dialogs(window)) == 1  # told once, not once per failed save
    storage = window.storage
    assert storage.has_pending  # the unsaved tail is held in memory...
    assert storage.messages(window.chat.conversation.id)[-1].content == answer  # ...and read back from it

    fillers[0].unlink()  # space returns: the retry timer writes the tail
    qtbot.waitUntil(lambda: not storage.has_pending, timeout=20_000)
    db = sqlite3.connect(storage.path)
    content, status = db.execute("SELECT content, status FROM messages WHERE role = 'assistant' "
                                 "ORDER BY id DESC LIMIT 1").fetchone()
    db.close()
    assert content == answer and status == COMPLETE
    close_window(window)


def test_quitting_works_while_the_disk_is_still_full(qtbot, full_disk_window):
    window, data = full_disk_window
    tokens = []

    def on_token(_request, text):
        tokens.append(text)
        if len(tokens) == 3:
            fill_disk(data)

    window.client.worker.token.connect(on_token)
    _send(qtbot, window, "tell me about the fox")
    qtbot.waitUntil(lambda: len(tokens) > 5, timeout=60_000)
    close_window(window)  # mid-answer, disk full: must not raise
    assert not window.isVisible()


def test_rename_and_delete_on_a_full_disk_keep_the_conversation_and_say_so(qtbot, full_disk_window):
    window, data = full_disk_window
    _send(qtbot, window, "tell me about the fox")
    wait_idle(qtbot, window)
    cid = window.chat.conversation.id
    saved_title = window.storage.conversation(cid).title
    filler = fill_disk(data)
    lst = window.conversations.list
    item = next(lst.item(i) for i in range(lst.count()) if lst.item(i).data(Qt.ItemDataRole.UserRole) == cid)
    item.setText("a new title")  # what finishing an in-place edit does: must not raise in the slot
    assert len(_error_dialogs(window)) == 1
    assert item.text() == saved_title  # the list shows what is saved, not the lost edit
    window.conversations.delete(cid)
    assert window.storage.conversation(cid) is not None  # still there
    assert len(_error_dialogs(window)) == 2
    filler.unlink()
    window.conversations.delete(cid)  # space returns: deleting works again
    assert window.storage.conversation(cid) is None
    close_window(window)


# -- one window at a time -----------------------------------------------------------------------
def _wait_for(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_launch_brings_the_first_window_forward(tmp_path):
    box = Sandbox(tmp_path)
    log = tmp_path / "outside" / "first.log"
    with open(log, "wb") as err:
        first = subprocess.Popen([sys.executable, "-m", "app.cli"], cwd=tmp_path / "cwd", env=box.env,
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(lambda: (tmp_path / "data" / "window.lock").is_file(), 240, "the first window's lock")
        second = box.run(timeout=120)
        assert second.rc == 0 and "already open" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        _wait_for(lambda: "asked this window to come forward" in log.read_text(errors="replace"), 120,
                  "the first window to hear the second launch")
        chat = box.run("chat", "--max-new-tokens", "2", stdin=b"/quit\n")
        chat.assert_ok()
        assert "window" in chat.stderr and "holds a model" in chat.stderr
        assert first.poll() is None  # the first window is still running
    finally:
        first.terminate()
        first.wait(timeout=30)
    assert "Traceback" not in log.read_text(errors="replace")


def test_a_crashed_window_does_not_block_the_next_launch(tmp_path):
    """A lock left by a process that is gone is taken over."""
    box = Sandbox(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "data" / "window.lock").write_text(f"{dead.pid}\nthermocline\n{os.uname().nodename}\n")
    from app.single_instance import window_pid

    assert window_pid(tmp_path / "data") is None
    code = ("import sys; from app.gui.main import make_application; from app.single_instance import SingleInstance;"
            "make_application(); s = SingleInstance(); print('acquired' if s.acquire() else 'refused')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=box.env, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "acquired", done.stderr


def test_server_panel_says_what_is_allowed_and_refuses_a_bad_origin(qtbot, tmp_path, monkeypatch):
    """Issue 28: the panel names the web pages allowed; a malformed one is a dialog, not a start."""
    import httpx

    window = make_window(qtbot, tmp_path, "demo", mode="dense", monkeypatch=monkeypatch)
    panel = window.server_panel
    try:
        panel.port.setValue(0)
        assert "Web pages in a browser cannot" in panel.access.text() and "none are allowed" in panel.access.text()
        panel.origins.setText("evil example")
        panel.switch.setChecked(True)
        assert panel.server is None and _error_dialogs(window)
        assert "is not an origin" in _error_dialogs(window)[0].text() + _error_dialogs(window)[0].informativeText()
        for box in _error_dialogs(window):
            box.close()
        panel.origins.setText("http://localhost:3000")
        panel.switch.setChecked(True)
        assert panel.server is not None
        assert "except http://localhost:3000" in panel.access.text()
        assert window.settings["server.allowed_origins"] == ["http://localhost:3000"]
        base = panel.url.text()
        ok = httpx.get(base + "/models", headers={"Origin": "http://localhost:3000"}, timeout=60)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        evil = httpx.get(base + "/models", headers={"Origin": "http://evil.example"}, timeout=60)
        assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
    finally:
        panel.stop()
        close_window(window)
