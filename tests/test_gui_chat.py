"""The chat window end to end: the real window, the real engine on a tiny random model."""

from __future__ import annotations

import os

import pytest
from PySide6.QtCore import Qt

from gui_helpers import close_window, make_window, send, wait_idle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def window(qtbot, tmp_path, llama_dir, monkeypatch):
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=40, monkeypatch=monkeypatch)
    yield w
    close_window(w)


def test_prompt_streams_tokens_into_the_view(qtbot, window):
    from app.storage import COMPLETE

    seen = []
    window.client.worker.token.connect(lambda _r, t: seen.append(t))
    shown = []
    orig = window.chat.session.flush

    def spy():
        orig()
        last = window.chat.view.last()
        if last is not None and last.role == "assistant":
            shown.append(last.text())

    window.chat.session.flush_timer.timeout.disconnect()
    window.chat.session.flush_timer.timeout.connect(spy)
    window.settings["chat.max_new_tokens"] = 300  # long enough to be seen in pieces
    send(qtbot, window, "tell me about the fox")
    assert window.client.busy
    assert window.chat.input.button.text() == "Stop"
    wait_idle(qtbot, window)

    msgs = window.chat.view.messages()
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].text() == "tell me about the fox"
    answer = msgs[1].text()
    assert answer == "".join(seen) and answer
    # Streaming: the view showed growing prefixes of the answer before it was complete.
    partial = [s for s in shown if s != answer]
    assert partial and all(answer.startswith(s) for s in partial)
    assert msgs[1].status == COMPLETE
    assert "tokens" in msgs[1].stats_label.text() and "tok/s" in msgs[1].stats_label.text()
    assert "tok/s" in window.chat.readout.text()
    # Saved with its stats; the conversation is titled from the prompt and listed.
    conv = window.chat.conversation
    stored = window.storage.messages(conv.id)
    assert stored[-1].content == answer and stored[-1].stats["new_tokens"] > 0
    assert conv.title == "tell me about the fox"
    assert window.conversations.list.count() == 1
    assert window.chat.input.button.text() == "Send"
    # The context indicator counts the conversation against the context length.
    qtbot.waitUntil(lambda: (window.chat.context.used or 0) > 0, timeout=10_000)
    used, total = window.chat.context_label.text().split(" tokens")[0].split(" / ")  # may say " · oldest not read"
    assert int(used.replace(",", "")) == window.chat.context.used
    assert total == "512"  # 2,048 chosen, capped at the tiny model's max_position_embeddings
    assert window.chat.context_bar.value() > 0


def test_stop_mid_answer_keeps_partial_text(qtbot, window):
    from app.storage import STOPPED

    window.settings["chat.max_new_tokens"] = 2000
    window.chat.new_conversation()
    tokens = []
    window.client.worker.token.connect(lambda _r, t: tokens.append(t))
    send(qtbot, window, "count the birds")
    qtbot.waitUntil(lambda: len(tokens) >= 3, timeout=60_000)
    n_at_click = len(tokens)  # tokens the worker had emitted when Stop was pressed
    window.chat.input.button.click()  # the Send button reads Stop now
    wait_idle(qtbot, window, 30_000)
    n_at_stop = len(tokens)
    assert n_at_stop - n_at_click <= 2  # honoured within a token (one may be in flight, plus a held-back tail)
    last = window.chat.view.last()
    assert last.status == STOPPED
    assert last.text() == "".join(tokens)
    assert 3 <= n_at_stop < 200  # stopped long before max_new_tokens
    stored = window.storage.messages(window.chat.conversation.id)[-1]
    assert stored.status == STOPPED and stored.content == last.text()
    assert stored.stats["finish_reason"] == "cancelled"


def test_regenerate_replaces_last_answer(qtbot, window):
    window.settings["chat.temperature"] = 1.0  # sampled, so a new answer differs
    window.chat.new_conversation()
    send(qtbot, window, "the old man reads")
    wait_idle(qtbot, window)
    first = window.chat.view.last()
    first_id, first_text = first.message_id, first.text()
    assert first.regen_button.isVisible()
    qtbot.mouseClick(first.regen_button, Qt.MouseButton.LeftButton)
    assert window.client.busy
    wait_idle(qtbot, window)
    msgs = window.chat.view.messages()
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].message_id != first_id
    stored = window.storage.messages(window.chat.conversation.id)
    assert [m.id for m in stored][-1] == msgs[1].message_id
    assert len(stored) == 2
    assert msgs[1].text()  # a fresh answer (random text may rarely repeat, so compare ids)
    del first_text


def test_edit_and_resend_replaces_from_the_edited_message(qtbot, window):
    window.chat.new_conversation()
    send(qtbot, window, "first question")
    wait_idle(qtbot, window)
    send(qtbot, window, "second question")
    wait_idle(qtbot, window)
    user_msgs = [m for m in window.chat.view.messages() if m.role == "user"]
    user_msgs[0].edit_button.click()
    assert window.chat.input.edit.toPlainText() == "first question"
    assert window.chat.banner.isVisible()
    window.chat.input.edit.clear()
    send(qtbot, window, "a better question")
    wait_idle(qtbot, window)
    msgs = window.storage.messages(window.chat.conversation.id)
    assert [(m.role, m.content) for m in msgs][0] == ("user", "a better question")
    assert len(msgs) == 2


def test_edit_keeps_the_unsent_draft(qtbot, window):
    """Edit puts the message in the box; what the user had typed there and not sent comes back
    when the edit is cancelled or sent, and is kept under its chat when the user leaves it."""
    window.chat.new_conversation()
    send(qtbot, window, "first question")
    wait_idle(qtbot, window)
    send(qtbot, window, "second question")
    wait_idle(qtbot, window)
    box = window.chat.input.edit
    qtbot.keyClicks(box, "half a thought")
    first, second = [m for m in window.chat.view.messages() if m.role == "user"]
    first.edit_button.click()
    assert box.toPlainText() == "first question"
    window.chat.banner.action.click()  # Cancel edit
    assert box.toPlainText() == "half a thought" and not window.chat.banner.isVisible()

    first.edit_button.click()
    qtbot.keyClick(box, Qt.Key.Key_End, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClicks(box, ", reworded")
    second.edit_button.click()  # the edit under way holds words of the user's too: refused
    assert box.toPlainText() == "first question, reworded" and window.chat.banner.isVisible()
    box.clear()
    send(qtbot, window, "a better question")
    assert box.toPlainText() == "half a thought"  # sent: the draft is back
    wait_idle(qtbot, window)
    msgs = window.storage.messages(window.chat.conversation.id)
    assert [(m.role, m.content) for m in msgs][0] == ("user", "a better question") and len(msgs) == 2

    chat = window.chat.conversation.id
    [user] = [m for m in window.chat.view.messages() if m.role == "user"]
    user.edit_button.click()
    window.chat.new_conversation()  # leaving mid-edit: the edit goes, the draft stays with its chat
    assert box.toPlainText() == ""
    window.chat.open_conversation(chat)
    assert box.toPlainText() == "half a thought"


def test_per_conversation_settings_apply(qtbot, window):
    from PySide6.QtWidgets import QApplication

    from app.gui.dialogs import ConversationSettingsDialog

    window.chat.new_conversation()
    send(qtbot, window, "hello")
    wait_idle(qtbot, window)
    window.chat.open_conversation_settings()
    dlg = next(w for w in QApplication.topLevelWidgets() if isinstance(w, ConversationSettingsDialog))
    dlg.system_prompt.setPlainText("Answer in one word.")
    dlg.fields["max_new_tokens"].setValue(5)
    dlg.accept()
    conv = window.storage.conversation(window.chat.conversation.id)
    assert conv.system_prompt == "Answer in one word."
    assert conv.sampling["max_new_tokens"] == 5
    send(qtbot, window, "again")
    wait_idle(qtbot, window)
    assert window.chat.view.last().status == "complete"
    assert window.storage.messages(conv.id)[-1].stats["new_tokens"] <= 5


def test_markdown_code_block_has_copy_button(qtbot, window):
    from PySide6.QtGui import QGuiApplication

    window.chat.new_conversation()
    send(qtbot, window, "code please")
    wait_idle(qtbot, window)
    last = window.chat.view.last()
    last.set_text("Here:\n\n```python\nprint('hi')\n```\n\nDone **now**.")
    [block] = last.body.code_blocks()
    assert block.lang_label.text() == "python"
    block.copy_button.click()
    assert QGuiApplication.clipboard().text() == "print('hi')"
    assert block.copy_button.text().startswith("Copied")


def test_context_full_is_explained_not_crashed(qtbot, tmp_path, llama_dir, monkeypatch):
    from app.settings import Settings

    cfg = Settings(tmp_path / "cfg" / "settings.json")
    cfg["engine.ctx"] = 128
    cfg["chat.context_policy"] = "stop"  # the other policy forgets old messages instead (test_gui_first_hour)
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=1000, monkeypatch=monkeypatch)
    try:
        assert w.client.model_info["ctx"] == 128
        send(qtbot, w, "the quick brown fox jumps over the lazy dog")
        wait_idle(qtbot, w)
        stats = w.storage.messages(w.chat.conversation.id)[-1].stats
        assert stats["finish_reason"] in ("context_full", "length")
        qtbot.waitUntil(lambda: w.chat.banner.isVisible(), timeout=10_000)
        assert "filled what the model can read" in w.chat.banner.label.text()
        qtbot.waitUntil(lambda: w.chat.context_bar.property("level") in ("warn", "full"), timeout=10_000)
        # Another message cannot fit at all: explained in the banner, no dialog, app usable.
        send(qtbot, w, "and then what happened next in the story")
        wait_idle(qtbot, w)
        assert "filled what the model can read" in w.chat.banner.label.text()
        assert all(m.content for m in w.storage.messages(w.chat.conversation.id))  # no empty answer kept
        w.chat.banner.action.click()  # "New chat"
        assert w.chat.conversation is None and not w.chat.banner.isVisible()
    finally:
        close_window(w)


def test_shift_enter_is_a_new_line_enter_sends(qtbot, window):
    edit = window.chat.input.edit
    edit.setFocus()
    qtbot.keyClicks(edit, "line one")
    qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(edit, "line two")
    assert edit.toPlainText() == "line one\nline two"
    assert not window.chat.busy
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    assert window.chat.busy and edit.toPlainText() == ""
    wait_idle(qtbot, window)
    assert window.chat.view.messages()[0].text() == "line one\nline two"


KILL_SCRIPT = """
import os, signal, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from gui_helpers import make_window, send
from PySide6.QtCore import QCoreApplication

class Bot:  # just enough of qtbot for make_window/send, in a plain process
    def addWidget(self, w): pass
    def keyClicks(self, w, text):
        from PySide6.QtTest import QTest; QTest.keyClicks(w, text)
    def keyClick(self, w, key, *a):
        from PySide6.QtTest import QTest; QTest.keyClick(w, key, *a)
    def waitUntil(self, f, timeout):
        end = time.time() + timeout / 1000
        while not f():
            QCoreApplication.processEvents(); time.sleep(0.005)
            if time.time() > end: raise TimeoutError

from pathlib import Path
w = make_window(Bot(), Path({tmp!r}), Path({model!r}), max_new_tokens=5000)
send(Bot(), w, "tell me a long story")
Bot().waitUntil(lambda: len(w.chat.session.answer_text) > 40 and w.chat.view.last().text() == w.chat.session.answer_text, 180000)
Path({shown!r}).write_text(w.chat.view.last().text())  # what the user saw, at the moment of the kill
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_mid_answer_keeps_what_was_shown(qtbot, tmp_path, llama_dir, monkeypatch):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from app.storage import INTERRUPTED, Storage

    root = Path(__file__).resolve().parents[1]
    shown = tmp_path / "shown.txt"
    script = KILL_SCRIPT.format(root=str(root), tests=str(root / "tests"), tmp=str(tmp_path),
                                model=str(llama_dir), shown=str(shown))
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "THERMOCLINE_DATA_DIR": str(tmp_path / "data"),
           "THERMOCLINE_CONFIG_DIR": str(tmp_path / "cfg"), "THERMOCLINE_MODELS_DIR": str(tmp_path / "models")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=280)
    assert proc.returncode == -signal.SIGKILL
    text = shown.read_text()
    assert len(text) > 40
    # The next start finds the partial answer, marked interrupted, holding all that was shown.
    w = make_window(qtbot, tmp_path, llama_dir, monkeypatch=monkeypatch)
    try:
        last = w.chat.view.last()
        assert last.role == "assistant" and last.status == INTERRUPTED
        assert last.text().startswith(text)
        db = Storage(tmp_path / "data" / "conversations.db")
        stored = db.messages(w.chat.conversation.id)[-1]
        db.close()
        assert stored.status == INTERRUPTED and stored.content.startswith(text)
    finally:
        close_window(w)
