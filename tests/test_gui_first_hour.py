"""The first hour as a user (issue 17): deleting chats, stopping while the prompt is read, a
full context, budgets that cannot work, a small window, preferences, dark mode, export,
answer versions, code colours and stale figures. The real window, the real engine on a tiny
random model, offscreen."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QMessageBox

from gui_helpers import close_window, make_window, send, wait_idle

pytestmark = pytest.mark.timeout(300)


def boxes(name: str) -> list[QMessageBox]:
    return [w for w in QApplication.topLevelWidgets()
            if isinstance(w, QMessageBox) and w.objectName() == name and w.isVisible()]


@pytest.fixture
def window(qtbot, tmp_path, llama_dir, monkeypatch):
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=12, monkeypatch=monkeypatch)
    yield w
    close_window(w)


@pytest.fixture
def hybrid_model(tmp_path, llama_dir):
    import torch

    from engine.loading.predictors import PredictorSet

    model = tmp_path / "hybrid"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    layers, d, n_ff = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    PredictorSet([torch.randn(16, d, generator=g) for _ in range(layers)],
                 [torch.randn(n_ff, 16, generator=g) for _ in range(layers)], [0.0] * layers).save(model)
    return model


# -- 1. deleting a conversation ------------------------------------------------------------
def test_delete_from_the_menu_asks_then_deletes(qtbot, window):
    w = window
    send(qtbot, w, "about boats")
    wait_idle(qtbot, w)
    cid = w.chat.conversation.id

    def menu_delete():
        menu = w.conversations.menu_for(cid)
        action = next(a for a in menu.actions() if a.text() == "Delete…")
        action.trigger()  # what right-click → Delete… does
        qtbot.waitUntil(lambda: len(boxes("confirmDelete")) == 1, timeout=3000)
        return boxes("confirmDelete")[0]

    box = menu_delete()
    assert "about boats" in box.text()
    box.button(QMessageBox.StandardButton.Cancel).click()
    qtbot.waitUntil(lambda: not boxes("confirmDelete"), timeout=3000)
    assert w.storage.conversation(cid) is not None and w.chat.conversation.id == cid

    box = menu_delete()
    delete = next(b for b in box.buttons() if b.text() == "Delete")
    delete.click()
    qtbot.waitUntil(lambda: w.storage.conversation(cid) is None, timeout=3000)
    assert w.conversations.list.count() == 0
    assert w.chat.conversation is None and not w.chat.view.messages()


# -- 2. Stop while the model reads the prompt ----------------------------------------------
def test_stop_while_reading_the_prompt_keeps_no_answer(qtbot, window):
    import engine.runtime.engine as engine_module

    w = window
    eng = w.client.engine
    text = "the quick brown fox jumps over the lazy dog " * 12
    n_prompt = len(eng.tokenizer.encode_chat(w.chat._draft_messages(text)))
    assert n_prompt > engine_module.PREFILL_CHUNK  # read in more than one chunk
    reading, pressed, calls = threading.Event(), threading.Event(), []
    forward = eng.model.forward

    def slow_first_chunk(ids, start, cache, **kw):  # the worker thread, inside prefill
        calls.append(ids.shape[0])
        if len(calls) == 1:
            reading.set()
            pressed.wait(10)  # the user presses Stop while this chunk is being read
        return forward(ids, start, cache, **kw)

    eng.model.forward = slow_first_chunk
    try:
        send(qtbot, w, text)
        qtbot.waitUntil(reading.is_set, timeout=10_000)
        assert w.chat.readout.text().startswith("● Reading the prompt")
        qtbot.keyClick(w.chat.input.edit, Qt.Key.Key_Escape)
        assert w.chat.input.button.text() == "Stopping…" and not w.chat.input.button.isEnabled()
        assert "Stopping" in w.chat.readout.text()
        pressed.set()
        wait_idle(qtbot, w)
    finally:
        eng.model.forward = forward
        pressed.set()
    assert len(calls) == 1  # the rest of the prompt was never read
    roles = [m.role for m in w.storage.messages(w.chat.conversation.id)]
    assert roles == ["user"]  # no one-token "stopped" answer kept
    assert w.chat.readout.text() == "Stopped before the answer began."
    assert w.chat.input.button.text() == "Send"
    last = w.chat.view.last()
    qtbot.waitUntil(lambda: last.regen_button.isVisible(), timeout=3000)  # "Answer" it later


def test_a_new_chat_while_the_prompt_is_read_leaves_the_old_chat_clean(qtbot, window):
    w = window
    eng = w.client.engine
    reading, pressed = threading.Event(), threading.Event()
    forward = eng.model.forward

    def slow(ids, start, cache, **kw):
        reading.set()
        pressed.wait(10)
        return forward(ids, start, cache, **kw)

    eng.model.forward = slow
    try:
        send(qtbot, w, "the quick brown fox jumps over the lazy dog " * 12)
        old = w.chat.conversation.id
        qtbot.waitUntil(reading.is_set, timeout=10_000)
        w.new_chat()  # stops the answer on the way
        pressed.set()
        wait_idle(qtbot, w)
    finally:
        eng.model.forward = forward
        pressed.set()
    assert [m.role for m in w.storage.messages(old)] == ["user"]  # no empty answer left behind
    assert w.chat.conversation is None and not w.chat.view.messages()


# -- 3. a full context -------------------------------------------------------------------
def small_context_window(qtbot, tmp_path, llama_dir, monkeypatch, policy):
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=16, start=False, monkeypatch=monkeypatch)
    w.settings["engine.ctx"] = 128
    w.settings["chat.context_policy"] = policy
    w.settings["chat.system_prompt"] = "Be brief."
    w.start()
    qtbot.waitUntil(lambda: w.client.model_info is not None, timeout=60_000)
    assert w.client.model_info["ctx"] == 128
    return w


def test_a_long_chat_keeps_going_by_forgetting_the_oldest_messages(qtbot, tmp_path, llama_dir, monkeypatch):
    w = small_context_window(qtbot, tmp_path, llama_dir, monkeypatch, "truncate")
    finals = []
    w.client.worker.finished.connect(lambda _r, stats: finals.append(stats))
    try:
        first_banner = None  # the words when the first messages are forgotten, and how many
        for i in range(6):
            send(qtbot, w, f"tell me about the sea and the ships number {i}")
            wait_idle(qtbot, w)
            qtbot.wait(50)
            if first_banner is None and w.chat.banner.isVisible() and "forgotten" in w.chat.banner.label.text():
                first_banner = (w.chat.banner.label.text(), w.chat.context.dropped)
        assert first_banner is not None
        text, dropped = first_banner  # issue 27: "the oldest 1 message are forgotten"
        assert (("the oldest message is forgotten" if dropped == 1 else
                 f"the oldest {dropped} messages are forgotten") in text), first_banner
        assert all(f["finish_reason"] != "context_full" for f in finals)
        assert finals[-1]["dropped_messages"] > 0
        assert finals[-1]["prompt_tokens"] <= 128 - 16  # room left for the answer
        assert w.chat.view.last().status == "complete"
        qtbot.waitUntil(lambda: "oldest not read" in w.chat.context_label.text(), timeout=10_000)
        used, total = w.chat.context_label.text().split(" tokens")[0].split(" / ")
        assert int(used.replace(",", "")) <= int(total) == 128  # never "264/256"
        assert w.chat.banner.isVisible() and "forgotten" in w.chat.banner.label.text()
        assert w.chat.banner.property("kind") == "info"
        # Everything is still saved: forgetting is what the model reads, not what is kept.
        assert len(w.storage.messages(w.chat.conversation.id)) == 12
    finally:
        close_window(w)


def test_stop_policy_says_the_context_is_full(qtbot, tmp_path, llama_dir, monkeypatch):
    w = small_context_window(qtbot, tmp_path, llama_dir, monkeypatch, "stop")
    try:
        for i in range(8):
            send(qtbot, w, f"tell me about the sea and the ships number {i}")
            wait_idle(qtbot, w)
            if w.chat.banner.isVisible() and w.chat.banner.property("kind") == "error":
                break
        text = w.chat.banner.label.text()
        assert "filled what the model can read (128 tokens)" in text
        assert "raise the context length" in text  # 128 < the 512 it was trained for: possible
        assert "Preferences → Chat" in text  # the policy that keeps chatting
        used, total = w.chat.context_label.text().split(" tokens")[0].split(" / ")
        assert int(used.replace(",", "")) <= int(total)
    finally:
        close_window(w)


def test_a_paste_too_long_for_the_model_is_refused_before_sending(qtbot, window):
    w = window
    w.chat.new_conversation()
    paste = "All happy families are alike; each unhappy family is unhappy in its own way. " * 260  # ~20 KB
    w.chat.input.edit.setPlainText(paste)
    qtbot.keyClick(w.chat.input.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.chat.banner.isVisible(), timeout=10_000)
    assert "tokens long, but the model reads at most 512" in w.chat.banner.label.text()
    assert w.chat.input.edit.toPlainText() == paste.strip()  # given back, not lost
    assert w.chat.conversation is None and not w.client.busy
    assert not w.chat.readout.text().startswith("●")
    # A long message that fits is sent after its count.
    w.chat.input.edit.setPlainText("the sea " * 80)  # 640 characters, about 320 tokens
    qtbot.keyClick(w.chat.input.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: w.chat.conversation is not None, timeout=10_000)
    wait_idle(qtbot, w)
    assert [m.role for m in w.storage.messages(w.chat.conversation.id)] == ["user", "assistant"]


# -- 4. budgets are checked before they are saved ------------------------------------------
def test_a_budget_that_cannot_work_is_never_saved(qtbot, tmp_path, hybrid_model, monkeypatch):
    w = make_window(qtbot, tmp_path, hybrid_model, mode="hybrid", monkeypatch=monkeypatch)
    try:
        p = w.panel
        qtbot.waitUntil(lambda: p.placement is not None and p.machine is not None, timeout=30_000)
        p.ram.slider.setValue(0)  # a keyboard move: settles at once
        qtbot.waitUntil(lambda: "cannot work" in p.verdict.text(), timeout=10_000)
        qtbot.wait(600)  # past the save delay
        assert w.settings["budget.ram_bytes"] is None  # not saved
        assert "not saved" in p.verdict.text()
        if not p.machine["vram_total"]:
            assert "VRAM" not in p.verdict.text()  # no GPU: no advice to give it memory
        good = p.machine["ram_total"] // 2
        p.ram.slider.setValue(good // (1024**2))
        qtbot.waitUntil(lambda: w.settings["budget.ram_bytes"] is not None, timeout=10_000)
        assert w.settings["budget.ram_bytes"] == p.ram.value()
    finally:
        close_window(w)


def test_saved_budgets_that_cannot_work_are_forgotten_at_start(qtbot, tmp_path, hybrid_model, monkeypatch):
    w = make_window(qtbot, tmp_path, hybrid_model, mode="hybrid", start=False, monkeypatch=monkeypatch)
    w.settings["budget.ram_bytes"] = 0  # from an older version that saved anything
    w.settings["budget.vram_bytes"] = 0
    try:
        w.start()
        qtbot.waitUntil(lambda: w.client.model_info is not None, timeout=60_000)
        qtbot.waitUntil(lambda: w.settings["budget.ram_bytes"] is None, timeout=10_000)
        assert w.panel.ram.value() > 0  # the slider shows the budget in use, not 0
    finally:
        close_window(w)


# -- 5. small windows --------------------------------------------------------------------
def test_800x600_reaches_the_panel_and_folds_the_sidebar(qtbot, window):
    w = window
    w.resize(800, 600)
    qtbot.waitUntil(lambda: w.width() == 800, timeout=3000)
    qtbot.wait(50)
    # One side part at a time: the sidebar first, the button brings the panel.
    assert w.sidebar.isVisible() and not w.panel.isVisible()
    assert not w.panel_button.isChecked()
    w.panel_button.click()
    qtbot.waitUntil(lambda: w.panel.isVisible(), timeout=3000)
    assert not w.sidebar.isVisible() and w.panel.width() >= 240
    assert w.chat.width() >= 400 and w.panel_button.isChecked()
    assert w.panel.vram.isVisible() or w.panel.ram.isVisible()
    # The sidebar button brings the conversations back.
    w.chat.sidebar_button.click()
    qtbot.waitUntil(lambda: w.sidebar.isVisible(), timeout=3000)
    assert not w.panel.isVisible()
    # Wide again: both.
    w.resize(1280, 800)
    qtbot.waitUntil(lambda: w.panel.isVisible() and w.sidebar.isVisible(), timeout=3000)
    # The sidebar folds on request at any width.
    w.set_sidebar_visible(False)
    assert not w.sidebar.isVisible() and w.panel.isVisible()
    w.set_sidebar_visible(True)
    assert w.sidebar.isVisible()


# -- 6. desktop conventions ----------------------------------------------------------------
def test_preferences_theme_font_and_policy(qtbot, window):
    from app.gui import theme

    w = window
    dlg = w.show_preferences()
    qtbot.waitUntil(dlg.isVisible, timeout=3000)
    for name in ("ui.theme", "ui.font_size", "model.active", "engine.mode", "chat.context_policy"):
        assert dlg.field(name) is not None
    themes = dlg.field("ui.theme")
    themes.setCurrentIndex(themes.findData("dark"))
    dlg.field("ui.font_size").setValue(13)
    policy = dlg.field("chat.context_policy")
    policy.setCurrentIndex(policy.findData("stop"))
    dlg.accept()
    assert w.settings["ui.theme"] == "dark" and w.settings["ui.font_size"] == 13
    assert w.settings["chat.context_policy"] == "stop"
    sheet = QApplication.instance().styleSheet()
    assert theme.DARK["window"] in sheet and theme.LIGHT["window"] not in sheet
    assert "@" not in sheet.replace("@ICONS@", "")  # every palette name has a value
    assert QApplication.font().pointSizeF() == 13
    # The View menu switches back; Ctrl+- makes text smaller.
    qtbot.keyClick(w, Qt.Key.Key_Minus, Qt.KeyboardModifier.ControlModifier)
    assert w.settings["ui.font_size"] == 12
    w._set_theme("light")
    assert theme.LIGHT["window"] in QApplication.instance().styleSheet()
    w.settings.reset("ui.font_size")


def test_dark_and_light_palettes_name_the_same_colours():
    from app.gui import theme

    assert set(theme.LIGHT) == set(theme.DARK)
    sheet = theme.stylesheet("dark")
    assert "@" not in sheet and theme.DARK["accent"] in sheet


def test_ctrl_q_quits_and_about_opens(qtbot, window):
    w = window
    about = w.show_about()
    qtbot.waitUntil(about.isVisible, timeout=3000)
    assert "Thermocline" in about.findChildren(type(w.model_status))[0].text()
    about.reject()
    quits = [a for a in w.actions() if a.shortcut().toString() == "Ctrl+Q"]
    assert len(quits) == 1
    quits[0].trigger()
    qtbot.waitUntil(lambda: not w.isVisible(), timeout=5000)


def test_export_markdown_and_json(qtbot, window, tmp_path):
    w = window
    send(qtbot, w, "what is a thermocline?")
    wait_idle(qtbot, w)
    cid = w.chat.conversation.id
    answer = w.storage.messages(cid)[-1].content
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"
    w.export_conversation(cid, "md", str(md))
    w.export_conversation(cid, "json", str(js))
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# what is a thermocline?") and "## You" in text and answer.strip() in text
    data = json.loads(js.read_text(encoding="utf-8"))
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["content"] == answer
    # Through the file dialog, as a user does.
    dlg = w.export_conversation(cid, "md")
    qtbot.waitUntil(dlg.isVisible, timeout=3000)
    target = tmp_path / "picked.md"
    dlg.selectFile(str(target))
    dlg.accept()
    qtbot.waitUntil(target.exists, timeout=3000)
    assert target.read_text(encoding="utf-8") .startswith("# what is a thermocline?")
    # A folder that cannot be written: a dialog, nothing else.
    w.export_conversation(cid, "json", str(tmp_path / "missing" / "x.json"))
    assert w.last_error.objectName() == "errorDialog"
    w.last_error.accept()


def test_regenerate_keeps_versions_to_page_through(qtbot, window):
    w = window
    w.settings["chat.temperature"] = 1.5  # versions differ
    send(qtbot, w, "tell me a story")
    wait_idle(qtbot, w)
    first = w.chat.view.last()
    first_text = first.text()
    w.chat.regenerate(first.message_id)
    wait_idle(qtbot, w)
    second = w.chat.view.last()
    assert second.version_label.text() == "2/2" and second.prev_version.isVisible()
    second_text = second.text()
    second.prev_version.click()
    assert second.text() == first_text and second.version_label.text() == "1/2"
    stored = w.storage.messages(w.chat.conversation.id)
    assert [m.role for m in stored] == ["user", "assistant"] and stored[-1].content == first_text
    second.next_version.click()
    assert second.text() == second_text
    # A third version; all three survive a reopen.
    w.chat.regenerate(second.message_id)
    wait_idle(qtbot, w)
    cid = w.chat.conversation.id
    w.chat.new_conversation()
    w.chat.open_conversation(cid)
    assert w.chat.view.last().version_label.text() == "3/3"


def test_code_blocks_are_coloured_for_the_theme(qtbot):
    from app.gui.markdown_view import MarkdownView, set_code_theme

    view = MarkdownView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    view.show()
    view.set_markdown("Look:\n\n```python\ndef answer():\n    return 42  # the answer\n```\n")
    block = view.code_blocks()[0]
    light_def = block.token_colour(0, 0)
    assert light_def is not None  # `def` is a keyword
    assert block.token_colour(1, 11) != light_def  # `42`: a number, another colour
    set_code_theme(True)
    try:
        assert block.token_colour(0, 0) is not None and block.token_colour(0, 0) != light_def
    finally:
        set_code_theme(False)
    view.set_markdown("```\nplain text\n```")
    assert view.code_blocks()[0].token_colour(0, 0) is None  # no language: no guessing


# -- 7-9. words, the demo model, stale figures ---------------------------------------------
def test_readout_words_for_people():
    from app.gui.chat_page import ChatPage

    text = ChatPage.live_text({"new_tokens": 1, "decode_tok_s": 0.0, "ttft_s": 0.2, "mode": "hybrid",
                               "mem_device": "cpu", "mem_ram_bytes": 9 * 2**20, "ram_budget": 9 * 2**20,
                               "hot_hit_fraction": 1.0, "ffn_active_fraction": 0.3}, final=True)
    assert "1 token" in text and "1 tokens" not in text
    assert "0.0 tok/s" not in text and "GPU" not in text
    assert "of 9 MiB" not in text and "RAM 9 MiB" in text
    assert "30% of neurons used" in text


def test_download_errors_in_words(monkeypatch):
    import errno

    from app.gui.downloads import download_error_words
    from models_registry.hub import OfflineModeOn

    what, todo = download_error_words("bamboo-dpo", OSError(errno.ENOSPC, "No space left on device"))
    assert "disk is full" in what and "Errno" not in what
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    what, _ = download_error_words("x", OfflineModeOn("offline mode: x is not downloaded; turn offline mode off "
                                                      "(HF_HUB_OFFLINE / Settings) to download it"))
    assert "HF_HUB_OFFLINE" in what and "Settings" not in what


def test_new_chat_and_model_switch_reset_stale_figures(qtbot, tmp_path, llama_dir, monkeypatch):
    w = small_context_window(qtbot, tmp_path, llama_dir, monkeypatch, "stop")
    try:
        for i in range(8):
            send(qtbot, w, f"tell me about the sea and the ships number {i}")
            wait_idle(qtbot, w)
            if w.chat.banner.isVisible() and w.chat.banner.property("kind") == "error":
                break
        assert w.chat.banner.isVisible()
        assert "tok/s" in w.chat.readout.text() or "token" in w.chat.readout.text()
        # A bigger context (a reload): the "full" banner is gone, the count is new.
        w.settings["engine.ctx"] = 512
        w.load_active_model()
        qtbot.waitUntil(lambda: (w.client.model_info or {}).get("ctx") == 512, timeout=60_000)
        qtbot.waitUntil(lambda: not w.chat.banner.isVisible(), timeout=5000)
        # A new chat shows no figures of the previous one.
        w.new_chat()
        assert w.chat.readout.text().startswith("Ready")
        assert w.chat.context_label.text().startswith("0 / 512")
    finally:
        close_window(w)


def test_mode_box_shows_the_mode_that_runs(qtbot, tmp_path, llama_dir, monkeypatch):
    """The tiny model has no predictors: asked for hybrid, it runs dense, and the box says so;
    the context box offers nothing beyond the 512 tokens it was trained for."""
    w = make_window(qtbot, tmp_path, llama_dir, mode="hybrid", monkeypatch=monkeypatch)
    try:
        assert w.client.model_info["mode"] == "dense"
        assert w.panel.mode.currentData() == "dense"
        assert "predictors" in w.panel.mode.toolTip() and "thermocline " not in w.panel.mode.toolTip()
        offered = [w.panel.ctx.itemData(i) for i in range(w.panel.ctx.count())]
        assert max(offered) == 512
    finally:
        close_window(w)


def test_demo_model_is_explained_and_gets_no_assistant_prompt(qtbot, tmp_path, monkeypatch):
    w = make_window(qtbot, tmp_path, "demo", monkeypatch=monkeypatch)
    try:
        assert w.client.model_info["base_model"] is True
        w.new_chat()
        assert "Jane Austen" in w.chat.view.empty_label.text()
        send(qtbot, w, "It is a truth universally acknowledged")
        wait_idle(qtbot, w)
        assert all(m["role"] != "system" for m in w.chat._chat_messages())
    finally:
        close_window(w)


# -- 11. a desktop without Qt's X11 libraries ------------------------------------------------
def test_missing_x11_libraries_are_named_with_the_command_to_install(monkeypatch, capsys):
    from app.gui import main

    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(main, "XCB_LIBRARIES", {"libxcb-cursor.so.0": "libxcb-cursor0",
                                                "libthermocline-not-there.so.7": "libxcb-icccm4"})
    missing = main.missing_window_libraries()
    assert "libxcb-icccm4" in missing
    code = main.explain_missing_libraries(missing)  # no terminal here: no chat, exit code 2
    err = capsys.readouterr().err
    assert code == 2 and "sudo apt install libxcb-icccm4" in err and "thermocline chat" in err
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    assert main.missing_window_libraries() == []
