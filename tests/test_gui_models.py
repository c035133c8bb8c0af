"""The model manager against a local Hub stand-in: download with progress, pause, resume,
cancel, failure dialog, then use the downloaded model. Real HTTP, real files, no internet."""

from __future__ import annotations

import os
import threading

import pytest
from PySide6.QtWidgets import QApplication, QMessageBox

from gui_helpers import close_window, make_window
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401

pytestmark = pytest.mark.timeout(300)
REPO = "tiny/relu-llama"
WEIGHTS = "model.safetensors"


def error_dialogs() -> list[QMessageBox]:
    return [w for w in QApplication.topLevelWidgets()
            if isinstance(w, QMessageBox) and w.objectName() == "errorDialog" and w.isVisible()]


@pytest.fixture
def window(qtbot, tmp_path, llama_dir, local_hub, monkeypatch):
    files = {p.name: p.read_bytes() for p in llama_dir.iterdir() if p.is_file()}
    local_hub.add_repo(HubRepo(REPO, files))
    w = make_window(qtbot, tmp_path, llama_dir, monkeypatch=monkeypatch)
    w.show_page("models")
    qtbot.waitUntil(lambda: len(w.models.cards) > 3, timeout=30_000)
    yield w
    close_window(w)


def test_download_pause_resume_then_use(qtbot, window, local_hub):
    # the server holds the file at 20 kB until the test has paused and watched: a timed silence
    # ended before a loaded machine delivered the click, and the file finished unpaused
    held = threading.Event()
    local_hub.midway[WEIGHTS] = (20_000, lambda: held.wait(120) and False)  # then drops the connection
    events = []
    window.models._add_repo_id(REPO)
    assert REPO in window.models.jobs
    window.models.jobs[REPO].event.connect(lambda _s, ev: events.append(ev))
    qtbot.waitUntil(lambda: REPO in window.models.cards, timeout=30_000)
    card = window.models.cards[REPO]
    qtbot.waitUntil(lambda: card.state.text() == "Downloading…", timeout=10_000)
    qtbot.waitUntil(lambda: card.pause_button.isVisible() and card.cancel_button.isVisible(), timeout=5_000)
    assert card.total_bar.isVisible() and not card.download_button.isVisible()
    qtbot.waitUntil(lambda: any(e["kind"] == "file_start" and e["filename"] == WEIGHTS for e in events),
                    timeout=30_000)
    card.pause_button.click()
    assert card.state.text() == "Paused" and card.pause_button.text() == "Resume"
    held.set()  # the server lets go: a paused download must not reconnect
    qtbot.wait(3000)
    weights = [e for e in events if e["filename"] == WEIGHTS]
    assert weights[-1]["file_done"] < weights[-1]["file_total"] and REPO in window.models.jobs
    assert "of" in card.total_bar.format()  # bytes of total, shown as the download went
    card.pause_button.click()
    qtbot.waitUntil(lambda: REPO not in window.models.jobs, timeout=60_000)
    qtbot.waitUntil(lambda: card.state.text() == "Ready", timeout=30_000)
    assert events[-1]["kind"] == "done"
    assert not error_dialogs()
    qtbot.waitUntil(lambda: card.use_button.isVisible(), timeout=5_000)
    card.use_button.click()
    qtbot.waitUntil(lambda: (window.client.model_info or {}).get("model") == REPO, timeout=60_000)
    assert window.settings["model.active"] == REPO
    assert window.pages.currentWidget() is window.chat  # back to the chat, conversation kept
    window.show_page("models")
    qtbot.waitUntil(lambda: card.state.text() == "● In use", timeout=30_000)


def test_cancel_keeps_partial_and_failure_shows_dialog(qtbot, window, local_hub):
    reached, held = threading.Event(), threading.Event()  # the weights wait at 20 kB for the cancel
    local_hub.midway[WEIGHTS] = (20_000, lambda: reached.set() or held.wait(120) and False)
    window.models._add_repo_id(REPO)
    qtbot.waitUntil(lambda: REPO in window.models.cards, timeout=30_000)
    card = window.models.cards[REPO]
    qtbot.waitUntil(lambda: card.cancel_button.isVisible(), timeout=10_000)
    qtbot.waitUntil(reached.is_set, timeout=30_000)
    card.cancel_button.click()
    held.set()
    qtbot.waitUntil(lambda: REPO not in window.models.jobs, timeout=60_000)
    qtbot.waitUntil(lambda: card.state.text() == "Partly downloaded", timeout=30_000)
    assert card.download_button.text() == "Resume download"
    assert not error_dialogs()  # cancelling is not an error
    # Delete the partial download (confirmed in a dialog).
    folder = card.info["folder"]
    qtbot.waitUntil(lambda: card.delete_button.isVisible(), timeout=5_000)
    card.delete_button.click()
    confirm = next(b for b in QApplication.topLevelWidgets()
                   if isinstance(b, QMessageBox) and b.windowTitle() == "Delete model" and b.isVisible())
    confirm.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: card.state.text() == "Not downloaded", timeout=30_000)
    assert not os.path.exists(folder)

    window.models._add_repo_id("nobody/no-such-model")
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=60_000)
    [box] = error_dialogs()
    assert box.windowTitle() == "Download failed"
    assert "nobody/no-such-model" in box.text() and box.informativeText()
    box.accept()
    # Not a repo id at all: explained, nothing starts.
    window.models._add_repo_id("not a repo")
    assert "not a repo" not in window.models.jobs
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=5_000)
    assert error_dialogs()[0].windowTitle() == "Not a repository id"
    error_dialogs()[0].accept()


def test_add_file_imports_a_gguf_and_refuses_junk(qtbot, window, tmp_path, llama_dir):
    """The Models page's "GGUF file…": a PowerInfer GGUF becomes a local model card; a file
    that is not a GGUF gets an error dialog and leaves nothing behind."""
    import gguf_factory

    path = gguf_factory.write_gguf(llama_dir, tmp_path / "tiny.powerinfer.gguf", qtype="Q8_0")
    window.models.import_gguf_file(str(path))
    qtbot.waitUntil(lambda: "local/tiny" in window.models.cards, timeout=60_000)
    assert not error_dialogs()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    window.models.import_gguf_file(str(junk))
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=30_000)
    assert "not a GGUF" in error_dialogs()[0].text()
    for dialog in error_dialogs():
        dialog.close()
    assert "local/junk" not in window.models.cards


def test_cards_wrap_to_the_pane_with_no_sideways_scroll(qtbot, window):
    """A long title ("minicpm-s-1b · recommended first download · 1.2B") wraps: every card,
    its state and its verdict fit a pane under 700 px wide, with no sideways scroll."""
    from PySide6.QtWidgets import QScrollArea

    window.resize(1000, 720)
    # Cards are built a few at a time (one timer tick each): wait for the whole list, then
    # for Qt's deferred layout to place them.
    qtbot.waitUntil(lambda: not window.models._pending_rows and not window.models._scanning, timeout=30_000)
    scroll = window.models.findChild(QScrollArea, "modelsScroll")

    def misfits() -> list[str]:
        viewport = scroll.viewport().width()
        return [card.spec for card in window.models.cards.values()
                if card.width() > viewport or card.state.geometry().right() > card.width()
                or card.verdict.geometry().right() > card.state.geometry().left()]

    qtbot.waitUntil(lambda: not misfits(), timeout=5_000)
    assert not scroll.horizontalScrollBar().isVisible()
    assert scroll.viewport().width() < 700  # narrow enough that the longest title cannot sit on one line


def test_the_planned_download_size_shows_before_any_byte_moves(qtbot, window, local_hub):
    """Download on a card first asks the Hub's listing (planned_disk) and shows the bytes
    with a button that starts the download; "Not now" starts nothing; a repo the Hub does
    not answer for says the size is unknown and still lets the user try."""
    from app.gui import formatting as fmt
    from models_registry.download import planned_disk

    page = window.models
    page._add_custom(REPO)
    qtbot.waitUntil(lambda: REPO in page.cards and page.cards[REPO].download_button.isVisible(), timeout=30_000)
    card = page.cards[REPO]
    card.download_button.click()
    qtbot.waitUntil(lambda: card.confirm_button.isVisible(), timeout=30_000)
    plan = planned_disk(REPO)
    size = fmt.size(plan["bytes"])
    assert size in card.progress_label.text() and card.progress_label.isVisible()
    # the free disk it needs: the download's own check (download.disk_need: imports, margin)
    assert f"needs {fmt.size(plan['disk_need'])} free" in card.progress_label.text()
    assert card.confirm_button.text() == f"Download {size}"
    assert not card.download_button.isVisible() and not page.jobs
    card.not_now_button.click()
    assert not card.confirm_button.isVisible() and card.download_button.isVisible() and not page.jobs
    assert not local_hub.requests("GET", "/resolve/")  # listings only: no file was fetched
    card.download_button.click()
    qtbot.waitUntil(lambda: card.confirm_button.isVisible(), timeout=30_000)
    card.confirm_button.click()
    assert REPO in page.jobs
    qtbot.waitUntil(lambda: card.state.text() == "Ready", timeout=60_000)
    assert not card.confirm_button.isVisible() and not error_dialogs()

    page._add_custom("nobody/no-such-model")
    qtbot.waitUntil(lambda: "nobody/no-such-model" in page.cards, timeout=30_000)
    missing = page.cards["nobody/no-such-model"]
    missing.download_button.click()
    qtbot.waitUntil(lambda: missing.confirm_button.isVisible(), timeout=30_000)
    assert "size is not known" in missing.progress_label.text()
    assert missing.confirm_button.text() == "Download anyway" and not error_dialogs()
