"""The scripted first use (issue 27): a fresh data folder, the welcome on screen, at 800x600:
Ctrl+N, type, Enter, Esc, Ctrl+Q sends a message, stops its answer and quits. Keys go to
whatever has the keyboard focus, as a person's would; the real window and engine.

The same script against the real program under Xvfb with xdotool (tools/first_use.sh) runs
where both are installed; offscreen, pytest-qt drives the same keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QApplication

from gui_helpers import LOAD_TIMEOUT_MS

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def keys(qtbot, key, modifier=Qt.KeyboardModifier.NoModifier) -> None:
    """A key pressed where the focus is (no widget chosen by the test)."""
    target = QApplication.focusWidget() or QApplication.activeWindow()
    assert target is not None, "nothing has the keyboard focus"
    qtbot.keyClick(target, key, modifier)


def inside(widget, window) -> bool:
    """The widget is shown whole inside the window's client area."""
    top_left = widget.mapTo(window, QPoint(0, 0))
    return (widget.isVisible() and top_left.x() >= 0 and top_left.y() >= 0
            and top_left.x() + widget.width() <= window.width() and top_left.y() + widget.height() <= window.height())


@pytest.fixture
def first_start(qtbot, tmp_path, llama_dir, monkeypatch):
    """The window as a first start makes it: no settings, the welcome to come."""
    from app.gui.main import make_application, preload_engine
    from app.gui.main_window import MainWindow
    from app.settings import Settings
    from app.storage import Storage

    for name, sub in (("MODELS", "models"), ("CONFIG", "cfg"), ("DATA", "data")):
        monkeypatch.setenv(f"THERMOCLINE_{name}_DIR", str(tmp_path / sub))
    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-host.invalid")  # the welcome's recommendation stays local
    make_application()
    preload_engine()
    settings = Settings(tmp_path / "cfg" / "settings.json")
    settings["model.active"] = str(llama_dir)
    settings["engine.mode"] = "dense"
    settings["chat.max_new_tokens"] = 4000  # long enough that Esc lands inside the answer
    settings["chat.temperature"] = 1.0
    # The tiny model ends an answer at random (seed 1: 11 characters, too short to stop with Esc;
    # it failed so on the AMD host); this seed's answer to "Hello there" runs 620 characters.
    settings["chat.seed"] = 11
    storage = Storage(tmp_path / "data" / "conversations.db")
    w = MainWindow(storage, settings, show_welcome=True)
    qtbot.addWidget(w)
    w.resize(800, 600)
    w.show()
    w.start()
    yield w
    if w.isVisible():
        w.close()
    storage.close()


def test_ctrl_n_type_enter_esc_ctrl_q_at_800x600(qtbot, first_start):
    w = first_start
    qtbot.waitUntil(lambda: getattr(w, "welcome", None) is not None and w.welcome.isVisible(), timeout=10_000)
    # The window fits the screen: nothing wider than it, the prompt box in sight.
    assert w.width() <= 800 and w.height() <= 600
    for part in (w.chat.input.edit, w.chat.input.button, w.chat.title_label):
        assert inside(part, w), part.objectName()
    assert w.minimumSizeHint().width() <= 800
    # Ctrl+N from the welcome: it closes, the prompt box takes the keys.
    keys(qtbot, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not w.welcome.isVisible(), timeout=3000)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is w.chat.input.edit, timeout=3000)
    for ch in "Hello there":
        keys(qtbot, ch)
    assert w.chat.input.edit.toPlainText() == "Hello there"
    keys(qtbot, Qt.Key.Key_Return)  # sent now, or as soon as the model has loaded
    qtbot.waitUntil(lambda: w.chat.busy and len(w.chat.session.answer_text) > 20, timeout=LOAD_TIMEOUT_MS)
    keys(qtbot, Qt.Key.Key_Escape)
    qtbot.waitUntil(lambda: not w.chat.busy, timeout=30_000)
    stored = w.storage.messages(w.chat.conversation.id)
    assert [(m.role, m.content) for m in stored][0] == ("user", "Hello there")
    assert stored[-1].role == "assistant" and stored[-1].status == "stopped"
    assert w.chat.view.last().status == "stopped" and w.chat.readout.text().startswith("stopped")
    keys(qtbot, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not w.isVisible(), timeout=10_000)


def test_a_first_start_on_a_small_screen_fits_the_screen(qtbot, tmp_path, llama_dir, monkeypatch):
    """No size set by the test: the window's own first-start size (1280x800) is cut to the
    screen, so at 800x600 the conversation's right edge and the prompt box stay in sight."""
    from app.gui.main import make_application
    from app.gui.main_window import MainWindow
    from app.settings import Settings
    from app.storage import Storage

    for name, sub in (("MODELS", "models"), ("CONFIG", "cfg"), ("DATA", "data")):
        monkeypatch.setenv(f"THERMOCLINE_{name}_DIR", str(tmp_path / sub))
    make_application()
    room = QApplication.primaryScreen().availableGeometry()
    if room.width() >= 1280 and room.height() >= 800:
        pytest.skip(f"this screen ({room.width()}x{room.height()}) holds the first-start size")
    settings = Settings(tmp_path / "cfg" / "settings.json")
    settings["model.active"] = str(llama_dir)
    storage = Storage(tmp_path / "data" / "conversations.db")
    w = MainWindow(storage, settings, show_welcome=False)
    qtbot.addWidget(w)
    try:
        w.show()
        qtbot.waitExposed(w)
        assert w.width() <= room.width() and w.height() <= room.height(), (w.size(), room)
        for part in (w.chat.input.edit, w.chat.input.button, w.chat.title_label):
            assert inside(part, w), part.objectName()
    finally:
        w.close()
        storage.close()


def test_enter_while_the_model_loads_sends_once_it_is_loaded_and_esc_keeps_it(qtbot, first_start):
    w = first_start
    qtbot.waitUntil(lambda: getattr(w, "welcome", None) is not None, timeout=10_000)
    w.welcome.accept()
    if w.client.model_info is not None:
        pytest.skip("the tiny model loaded before the keys came: nothing to wait for")
    edit = w.chat.input.edit
    qtbot.waitUntil(lambda: QApplication.focusWidget() is edit, timeout=3000)  # the welcome gave it back
    qtbot.keyClicks(edit, "first words")
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    assert w.chat.input.waiting and w.chat.input.button.text() == "Sends when loaded"
    qtbot.keyClick(edit, Qt.Key.Key_Escape)
    assert not w.chat.input.waiting and edit.toPlainText() == "first words"  # kept, unsent
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.chat.conversation is not None, timeout=LOAD_TIMEOUT_MS)
    assert w.storage.messages(w.chat.conversation.id)[0].content == "first words"


def test_the_budgets_panel_fits_after_a_text_size_change(qtbot, first_start):
    w = first_start
    qtbot.waitUntil(lambda: getattr(w, "welcome", None) is not None, timeout=10_000)
    w.welcome.accept()
    w.panel_button.click()
    qtbot.waitUntil(w.panel.isVisible, timeout=3000)
    inner, bar = w.panel.widget(), w.panel.horizontalScrollBar()

    def fits() -> bool:
        return inner.minimumSizeHint().width() <= w.panel.viewport().width() and not bar.isVisible()

    qtbot.waitUntil(fits, timeout=3000)
    normal = inner.minimumSizeHint().width()
    w.settings["ui.font_size"] = 14
    qtbot.waitUntil(lambda: inner.minimumSizeHint().width() > normal, timeout=3000)
    qtbot.waitUntil(fits, timeout=3000)  # no restart: the panel took the width its text needs
    assert inside(w.chat.input.edit, w) and w.chat.width() >= 400
    w.settings["ui.font_size"] = 0  # "System size" goes back to the system's size
    qtbot.waitUntil(lambda: inner.minimumSizeHint().width() == normal, timeout=3000)
    assert fits()


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")), reason="needs Xvfb and xdotool")
def test_the_real_program_under_xvfb(tmp_path, llama_dir):
    """tools/first_use.sh: the installed program, real X11 keys, at 800x600."""
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": str(llama_dir), "SCRATCH": str(tmp_path)}
    out = subprocess.run(["bash", str(ROOT / "tools" / "first_use.sh")], capture_output=True, text=True,
                         env=env, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "first use: sent, stopped and quit" in out.stdout


def test_a_message_waiting_for_the_load_stays_in_its_chat_when_another_opens(qtbot, tmp_path, llama_dir,
                                                                             monkeypatch):
    """Enter during a load, then another chat: the load's end sends nothing, anywhere; the
    message is the first chat's draft again (it used to go out in whichever chat was open)."""
    from gui_helpers import close_window, make_window

    w = make_window(qtbot, tmp_path, llama_dir, start=False, monkeypatch=monkeypatch)
    try:
        first = w.storage.create_conversation("First")
        second = w.storage.create_conversation("Second")
        w.conversations.refresh(first.id)
        w.client.loading_model = str(llama_dir)  # as the window shows a load
        w.chat._sync_ready()
        edit = w.chat.input.edit
        w.chat.open_conversation(second.id)
        qtbot.keyClicks(edit, "second draft")  # typed, never sent
        w.chat.open_conversation(first.id)
        qtbot.keyClicks(edit, "first words")
        qtbot.keyClick(edit, Qt.Key.Key_Return)
        assert w.chat.input.waiting
        w.chat.open_conversation(second.id)
        assert not w.chat.input.waiting and edit.toPlainText() == "second draft"
        w.client.loading_model, w.client.model_info = None, {"model": str(llama_dir)}
        w.chat._sync_ready()  # the load ends
        qtbot.wait(200)
        assert w.storage.messages(first.id) == [] and w.storage.messages(second.id) == []
        w.chat.open_conversation(first.id)
        assert edit.toPlainText() == "first words"
    finally:
        close_window(w)
