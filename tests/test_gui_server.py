"""The window's Local server switch and remote models in the window (pytest-qt, offscreen), with
the real engine, the real uvicorn on 127.0.0.1 and the official openai client."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from gui_helpers import close_window, make_window, send, wait_idle

from app.storage import INTERRUPTED

SYSTEM = "You are a helpful assistant. Answer clearly and concisely."


def test_local_server_switch_serves_the_loaded_model(qtbot, tmp_path, monkeypatch):
    w = make_window(qtbot, tmp_path, "demo", mode="hybrid", monkeypatch=monkeypatch)
    panel = w.server_panel
    try:
        w.server_panel.toggle_action.trigger()
        assert panel.dock.isVisible()
        panel.port.setValue(0)  # a free port
        panel.switch.setChecked(True)
        assert panel.server is not None and panel.url.text().startswith("http://127.0.0.1:")
        assert not panel.port.isEnabled()  # fixed while it runs
        panel.copy_url()
        from PySide6.QtGui import QGuiApplication

        assert QGuiApplication.clipboard().text() == panel.url.text()
        client = openai.OpenAI(base_url=panel.url.text(), api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["demo"]

        # The budget sliders re-place neurons while the server answers.
        qtbot.waitUntil(lambda: w.panel.placement is not None, timeout=60_000)
        reports, problems = [], []
        w.client.worker.placement.connect(reports.append)
        w.client.worker.placement_failed.connect(problems.append)
        pieces: list[str] = []
        first_piece = threading.Event()
        done = threading.Event()

        def ask() -> None:
            stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=120, temperature=0, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    first_piece.set()
            done.set()

        threading.Thread(target=ask, daemon=True).start()
        qtbot.waitUntil(first_piece.is_set, timeout=60_000)
        w.panel.vram.set_total(1024**3)  # no GPU here: the fast tier is the CPU; give it room
        w.panel.vram.slider.setValue(w.panel.vram.slider.maximum())
        qtbot.waitUntil(lambda: len(reports) + len(problems) >= 1, timeout=60_000)
        assert not problems
        qtbot.waitUntil(done.is_set, timeout=120_000)
        assert "".join(pieces)
        assert reports[-1]["vram_budget"] == 1024**3

        qtbot.waitUntil(lambda: "POST /v1/chat/completions 200" in panel.log_view.toPlainText(), timeout=10_000)
        log = panel.log_view.toPlainText().splitlines()
        assert any("GET /v1/models 200" in line for line in log)
        assert any("tokens" in line and "stream" in line for line in log)

        panel.switch.setChecked(False)
        assert panel.server is None and panel.url.text() == "" and panel.port.isEnabled()
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    finally:
        close_window(w)


def test_non_loopback_without_a_key_is_refused_with_a_dialog(qtbot, tmp_path, monkeypatch):
    w = make_window(qtbot, tmp_path, "demo", mode="dense", monkeypatch=monkeypatch)
    panel = w.server_panel
    try:
        panel.host.setText("0.0.0.0")
        panel.port.setValue(0)
        panel.switch.setChecked(True)
        assert panel.server is None and not panel.switch.isChecked()
        from PySide6.QtWidgets import QApplication, QMessageBox

        boxes = [b for b in QApplication.topLevelWidgets() if isinstance(b, QMessageBox) and b.isVisible()]
        assert any("API key" in b.text() for b in boxes)
        for b in boxes:
            b.close()
    finally:
        close_window(w)


@pytest.fixture
def remote_server():
    """Another Thermocline serving the demo model: the 'remote machine'."""
    from engine import Engine
    from models_registry.resolve import resolve_model

    from app.server.runner import ServerThread

    engine = Engine.load(resolve_model("demo"), mode="dense")
    srv = ServerThread(lambda: engine, lambda: "demo", port=0).start()
    yield srv, engine
    srv.stop()


def test_remote_model_in_the_window(qtbot, tmp_path, monkeypatch, remote_server):
    srv, engine = remote_server
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
    from models_registry.remotes import add_remote

    add_remote("box", srv.url)
    w = make_window(qtbot, tmp_path, "remote/box", mode="hybrid", max_new_tokens=12, monkeypatch=monkeypatch)
    try:
        assert w.client.model_info["mode"] == "remote"
        qtbot.waitUntil(lambda: "runs elsewhere" in w.panel.verdict.text(), timeout=10_000)
        send(qtbot, w, "hello there")
        wait_idle(qtbot, w)
        from engine import SamplingParams

        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
        expected = engine.generate(messages, SamplingParams(max_new_tokens=12, temperature=0)).text
        last = w.chat.view.last()
        assert last.status == "complete"
        assert w.storage.messages(w.chat.conversation.id)[-1].content == expected
        stats = w.storage.messages(w.chat.conversation.id)[-1].stats
        assert stats["ttft_s"] > 0 and stats["mode"] == "remote"

        # Regenerate asks the remote again and replaces the answer (greedy: the same text).
        first_id = last.message_id
        from PySide6.QtCore import Qt

        qtbot.mouseClick(last.regen_button, Qt.MouseButton.LeftButton)
        wait_idle(qtbot, w)
        stored = w.storage.messages(w.chat.conversation.id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[-1].id != first_id and stored[-1].content == expected

        # The Models page lists it, as running elsewhere.
        w.show_page("models")
        qtbot.waitUntil(lambda: "remote/box" in w.models.cards, timeout=30_000)
        assert w.models.cards["remote/box"].verdict.text() == "runs elsewhere"

        # "Remote…" (Add a model from) adds another; "Remove from list" forgets it again.
        w.models.add_remote_button.click()
        dlg = w.models.remote_dialog
        dlg.name.setText("other")
        dlg.url.setText(srv.url)
        dlg.model.setText("demo")
        dlg.key_env.setText("OTHER_KEY")
        dlg.accept()
        qtbot.waitUntil(lambda: "remote/other" in w.models.cards, timeout=30_000)
        saved = json.loads((tmp_path / "cfg" / "registry.json").read_text())["remotes"]
        assert saved["other"] == {"url": srv.url, "model": "demo", "api_key_env": "OTHER_KEY"}
        card = w.models.cards["remote/other"]
        assert card.remove_button.isVisibleTo(card) and not card.download_button.isVisibleTo(card)
        card.remove_button.click()
        qtbot.waitUntil(lambda: "remote/other" not in w.models.cards, timeout=30_000)
        assert "other" not in json.loads((tmp_path / "cfg" / "registry.json").read_text())["remotes"]
    finally:
        close_window(w)


def test_cut_remote_stream_keeps_the_partial_answer_marked_interrupted(qtbot, tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import uvicorn
    from test_remote import failing_app

    from app.server.runner import bind_socket, make_config

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(make_config(failing_app(), "127.0.0.1", sock.getsockname()[1]))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
    from models_registry.remotes import add_remote

    add_remote("flaky", f"http://127.0.0.1:{sock.getsockname()[1]}/v1", "abort")
    w = make_window(qtbot, tmp_path, "remote/flaky", monkeypatch=monkeypatch)
    try:
        send(qtbot, w, "tell me")
        wait_idle(qtbot, w)
        last = w.storage.messages(w.chat.conversation.id)[-1]
        assert last.content == "Once upon a time" and last.status == INTERRUPTED
        assert w.chat.view.last().status == INTERRUPTED
        from PySide6.QtWidgets import QApplication, QMessageBox

        def dialog():
            return next((b for b in QApplication.topLevelWidgets()
                         if isinstance(b, QMessageBox) and b.isVisible() and "interrupted" in b.windowTitle()), None)

        qtbot.waitUntil(lambda: dialog() is not None, timeout=5_000)
        box = dialog()
        assert "connection broke midway" in box.text() and "partial answer is kept" in box.informativeText()
        box.close()
    finally:
        close_window(w)
        server.should_exit = True
        thread.join(10)
