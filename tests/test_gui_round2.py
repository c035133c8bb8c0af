"""The window's first hour, round 2 (issue 27): the real window on a tiny random model,
offscreen, driven through its widgets: download errors that name the real cause, one
recommended model, text sizes, old answers' model names, fit verdicts with a speed, and
the words of a forgetting chat."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QMessageBox

from gui_helpers import close_window, make_window, send, wait_idle
from hub_server import local_hub, registry_env  # noqa: F401

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
UNRESOLVABLE = "http://no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def error_dialogs() -> list[QMessageBox]:
    return [w for w in QApplication.topLevelWidgets()
            if isinstance(w, QMessageBox) and w.objectName() == "errorDialog" and w.isVisible()]


@pytest.fixture
def window(qtbot, tmp_path, llama_dir, registry_env, monkeypatch):
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=12, monkeypatch=monkeypatch)
    yield w
    close_window(w)


def scanned(qtbot, w) -> None:
    w.show_page("models")
    qtbot.waitUntil(lambda: bool(w.models.rows) and len(w.models.cards) == len(w.models.rows), timeout=60_000)


# -- 1. the offline download error -------------------------------------------------------
def welcome_recommending(qtbot, w):
    """The welcome, once it says which model it recommends for this machine: (dialog, model)."""
    w.show_welcome()
    dlg = w.welcome
    qtbot.waitUntil(lambda: "For this machine" in dlg.recommendation.text(), timeout=60_000)
    return dlg, w.models.recommended


def accept_dns_failure_naming(qtbot, name: str) -> None:
    """The one error dialog names `name` and the failed look-up, never the offline switch."""
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=60_000)
    [box] = error_dialogs()
    assert name in box.text() and "could not be looked up" in box.text(), box.text()
    assert "HF_HUB_OFFLINE" not in box.text() + box.informativeText()
    box.accept()


def test_a_dns_failure_is_named_as_such_and_logs_no_traceback(qtbot, window, monkeypatch, caplog):
    monkeypatch.setenv("HF_ENDPOINT", UNRESOLVABLE)
    caplog.set_level(logging.INFO)
    w = window
    scanned(qtbot, w)
    card = w.models.cards["minicpm-s-1b"]
    card.download_button.click()  # asks the Hub for the size first
    qtbot.waitUntil(lambda: "not known" in card.progress_label.text(), timeout=30_000)
    assert "looked up" in card.progress_label.text() and "HF_HUB_OFFLINE" not in card.progress_label.text()
    w.models.start_download("minicpm-s-1b")  # "Download anyway"
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=30_000)
    box = error_dialogs()[0]
    assert "could not be looked up" in box.text() and "HF_HUB_OFFLINE" not in box.text()
    assert "internet connection" in box.informativeText()
    box.accept()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an expected failure is no error"
    assert not [r for r in caplog.records if r.exc_info], "and carries no traceback"


def test_hf_hub_offline_is_named_only_when_it_is_set(qtbot, window, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    w = window
    scanned(qtbot, w)
    w.models.start_download("minicpm-s-1b")
    qtbot.waitUntil(lambda: bool(error_dialogs()), timeout=30_000)
    box = error_dialogs()[0]
    assert "HF_HUB_OFFLINE environment variable is set" in box.text()
    box.accept()


def test_download_words_do_not_read_offline_in_the_hubs_advice():
    from app.gui.downloads import download_error_words
    from models_registry.hub import HubUnreachable

    exc = HubUnreachable("cannot reach the Hub at x (ConnectError: timed out); check the connection, or use "
                         "offline mode for models already downloaded")
    what, todo = download_error_words("m", exc)
    assert "could not be reached" in what and "OFFLINE" not in what + todo


def test_the_welcome_and_a_typed_hub_id_name_the_dns_failure_too(qtbot, window, monkeypatch):
    """Item 1 names every download path: the catalogue's (above), the welcome's button, and a
    repository id typed into Add from the Hub. Each says the name could not be looked up."""
    from PySide6.QtWidgets import QInputDialog

    monkeypatch.setenv("HF_ENDPOINT", UNRESOLVABLE)
    w = window
    dlg, chosen = welcome_recommending(qtbot, w)
    dlg.download_button.click()
    accept_dns_failure_naming(qtbot, chosen)
    qtbot.waitUntil(lambda: not error_dialogs(), timeout=3000)
    w.models.add_repo()
    [ask] = [d for d in QApplication.topLevelWidgets() if isinstance(d, QInputDialog) and d.isVisible()]
    ask.setTextValue("acme/relu-tiny")
    ask.accept()
    accept_dns_failure_naming(qtbot, "acme/relu-tiny")


# -- 2. one recommended model -------------------------------------------------------------
def test_welcome_and_models_page_recommend_the_same_model(qtbot, window, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", UNRESOLVABLE)
    w = window
    dlg, chosen = welcome_recommending(qtbot, w)
    assert chosen and f"<b>{chosen}</b>" in dlg.recommendation.text()
    assert "words a second on this machine" in dlg.recommendation.text()
    # The Models page builds its cards one per event-loop turn after the scan that chose the
    # model, so the chosen one's card may come a little after the welcome's words.
    def marked() -> list[str]:
        return [spec for spec, card in w.models.cards.items() if "recommended for this machine" in card.title.text()]

    qtbot.waitUntil(lambda: marked() == [chosen], timeout=30_000)
    dlg.download_button.click()
    qtbot.waitUntil(lambda: chosen in w.models.jobs or bool(error_dialogs()), timeout=30_000)
    assert w.pages.currentWidget() is w.models
    for box in error_dialogs():  # no network here: the download itself fails, in words
        assert chosen in box.text()
        box.accept()


def test_the_recommendation_follows_the_machine():
    from models_registry.listing import recommend

    def row(spec, words, capability, verdict="fits with cold neurons on CPU", chat=True):
        return {"spec": spec, "chat": chat, "downloadable": True, "words_s": words, "capability": capability,
                "verdict": verdict}

    small, big = row("small", 14.0, 1e9), row("big", 9.0, 7e9)
    assert recommend([small, big]) == "big"                      # a fast machine: the larger one
    assert recommend([small, {**big, "words_s": 3.0}]) == "small"  # a slow one: the one that keeps pace
    assert recommend([{**small, "words_s": 2.0}, {**big, "words_s": 1.0}]) == "small"
    assert recommend([{**big, "verdict": "does not fit"}, small]) == "small"


# -- 3. text sizes stay readable -----------------------------------------------------------
def test_text_size_is_bounded_to_readable_sizes(qtbot, window):
    w = window
    dlg = w.show_preferences()
    qtbot.waitUntil(dlg.isVisible, timeout=3000)
    spin = dlg.field("ui.font_size")
    spin.setValue(0)
    assert spin.text() == "System size"
    spin.stepUp()
    assert spin.value() == 7  # from the system size straight to the smallest readable one
    spin.stepDown()
    assert spin.value() == 0
    spin.lineEdit().selectAll()
    qtbot.keyClicks(spin.lineEdit(), "3")
    spin.interpretText()
    spin.editingFinished.emit()
    assert spin.value() not in (1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError):
        w.settings["ui.font_size"] = 3
    dlg.reject()
    w.settings["ui.font_size"] = 7
    qtbot.keyClick(w, Qt.Key.Key_Minus, Qt.KeyboardModifier.ControlModifier)
    assert w.settings["ui.font_size"] == 7  # Ctrl+- stops at the smallest readable size
    w.settings.reset("ui.font_size")


def test_at_800x600_with_the_panel_open_a_cards_chips_go_under_its_title(qtbot, window):
    w = window
    scanned(qtbot, w)
    w.resize(800, 600)
    if not w.panel.isVisible():
        w.panel_button.click()
    qtbot.waitUntil(lambda: w.panel.isVisible() and w.width() == 800, timeout=5000)
    # A long id, on a card whose title has no "recommended for this machine": which model that is
    # follows the host's memory and bandwidth (CI's recommended turbosparse-mistral, whose title
    # then rightly takes two lines).
    spec = next(s for s in ("turbosparse-mistral", "turbosparse-mixtral") if s != w.models.recommended)
    card = w.models.cards[spec]
    qtbot.waitUntil(lambda: card.width() < card.NARROW, timeout=5000)
    qtbot.wait(50)
    # The title keeps the card's width (the id was broken at its hyphen), the chips below it.
    assert card.verdict.y() >= card.title.y() + card.title.height()
    line = card.title.fontMetrics().height()
    assert card.title.height() < 2 * line, "the title wraps"
    assert card.verdict.x() < card.width() // 2  # from the left, under the title
    w.resize(1280, 800)
    qtbot.waitUntil(lambda: card.width() >= card.NARROW, timeout=5000)
    qtbot.wait(50)
    assert abs(card.verdict.y() - card.title.y()) < line  # one row again


def test_at_800x600_the_models_page_leaves_the_panel_its_width(qtbot, window):
    """The Models page's header held the page at 517 px, so beside it the budgets panel was
    squeezed below the chat page's width and its Mode box read "Hybrid (CPU"."""
    from PySide6.QtWidgets import QStyle, QStyleOptionComboBox

    w = window
    w.resize(800, 600)
    if not w.panel.isVisible():
        w.panel_button.click()
    qtbot.waitUntil(lambda: w.panel.isVisible() and w.width() == 800, timeout=5000)
    qtbot.wait(50)
    on_chat = w.panel.width()
    scanned(qtbot, w)
    qtbot.wait(50)
    assert w.panel.width() >= min(on_chat, w.panel_width_needed()) and w.panel.width() == on_chat
    combo = w.panel.mode
    opt = QStyleOptionComboBox()
    combo.initStyleOption(opt)
    field = combo.style().subControlRect(QStyle.ComplexControl.CC_ComboBox, opt,
                                         QStyle.SubControl.SC_ComboBoxEditField, combo)
    assert combo.fontMetrics().horizontalAdvance(combo.currentText()) <= field.width(), combo.currentText()


# -- 4. old answers keep their model's name ------------------------------------------------
def test_old_answers_keep_the_name_of_the_model_that_wrote_them(qtbot, window, tmp_path):
    import shutil

    w = window
    send(qtbot, w, "hello there")
    wait_idle(qtbot, w)
    first = w.chat.view.messages()[-1]
    old_name = first.findChildren(type(w.model_status))[0].text()
    other = tmp_path / "other-model"
    shutil.copytree(w.settings["model.active"], other)
    w.switch_model(str(other))
    qtbot.waitUntil(lambda: (w.client.model_info or {}).get("model") == str(other), timeout=120_000)
    qtbot.waitUntil(lambda: not w.chat.busy, timeout=10_000)
    send(qtbot, w, "and again")
    wait_idle(qtbot, w)
    answers = [m for m in w.chat.view.messages() if m.role == "assistant"]
    names = [a.findChildren(type(w.model_status))[0].text() for a in answers]
    assert names[0] == old_name and names[-1] == "other-model" and old_name != "other-model"
    w.chat._reload_view()  # and after a reload from the database
    answers = [m for m in w.chat.view.messages() if m.role == "assistant"]
    assert answers[0].findChildren(type(w.model_status))[0].text() == old_name


# -- 5. fit verdicts agree with their reasons and say how fast ----------------------------
def test_every_verdict_agrees_with_its_reason_and_says_how_fast(qtbot, window):
    w = window
    scanned(qtbot, w)
    for spec, row in w.models.rows.items():
        if row.get("remote") or row["verdict"] == "unknown":
            continue
        card = w.models.cards[spec]
        if row["verdict"] == "does not fit":
            assert "needs" in row["reason"]
        else:
            assert "needs" not in row["reason"] or "free" not in row["reason"], row
        if spec != "demo":
            assert " a second on this machine" in card.facts.text()
        # One speed a card: a disk verdict's reason gave the placement's fixed-bandwidth speed
        # beside the measured one ("runs from disk at about 5.7 words a second · about 4 words a second").
        assert card.facts.text().count(" a second") <= 1, card.facts.text()
    assert "avx2" not in w.models.machine_label.text()  # features in words, not flags


def test_rough_fit_compares_with_the_ram_it_names():
    from types import SimpleNamespace

    from models_registry.listing import rough_fit

    GiB = 1024**3
    hw = SimpleNamespace(usable_vram_free=0, ram_available=int(20.7 * GiB))
    verdict, reason = rough_fit(int(39.4 * GiB), hw)  # 19.7 GiB of 8-bit rows
    assert verdict == "does not fit"
    assert "of the 20.70 GiB free can be used" in reason
    assert rough_fit(int(30 * GiB), hw)[0] != "does not fit"


def test_a_disk_verdict_gives_one_speed_and_no_gpu_is_not_named_without_one():
    from models_registry.catalogue import find_entry
    from models_registry.fit import VERDICT_DISK, VERDICT_NO, estimate_fit
    from models_registry.speed import measured_reason

    GiB = 1024**3
    entry = find_entry("turbosparse-mistral")
    est = estimate_fit(entry.config, ctx=2048, vram_budget=0, ram_budget=6 * GiB, sparsity=entry.sparsity)
    assert est.verdict == VERDICT_DISK
    assert "words a second" in est.reason  # `models fit` keeps the placement's estimate
    assert "a second" not in measured_reason(est) and "from disk per token" in measured_reason(est)
    big = find_entry("relullama-70b")
    est = estimate_fit(big.config, ctx=2048, vram_budget=0, ram_budget=2 * GiB, sparsity=big.sparsity)
    assert est.verdict == VERDICT_NO and "GPU" not in est.reason, est.reason
    on_gpu = estimate_fit(big.config, ctx=2048, vram_budget=1 * GiB, ram_budget=2 * GiB, sparsity=big.sparsity)
    assert on_gpu.verdict == VERDICT_NO and "beside the GPU" in on_gpu.reason


def test_speed_follows_bytes_per_token_and_measured_bandwidth():
    from models_registry.catalogue import find_entry
    from models_registry.fit import estimate_fit
    from models_registry.speed import read_bandwidth, speed_words, words_per_second

    entry = find_entry("bamboo-dpo")
    est = estimate_fit(entry.config, ctx=2048, vram_budget=0, ram_budget=64 * 1024**3, sparsity=entry.sparsity)
    slow = words_per_second(est, bandwidth=20e9)
    assert 2 < slow < 12  # DESIGN.md: 7B at about 10% active reads ~2.5 GB a token
    assert words_per_second(est, bandwidth=40e9) == pytest.approx(2 * slow)
    dense = estimate_fit(entry.config, ctx=2048, vram_budget=0, ram_budget=64 * 1024**3, sparsity=0.0)
    assert words_per_second(dense, bandwidth=20e9) < slow / 2  # dense reads every row
    assert 1e8 < read_bandwidth() < 1e13  # measured, in bytes a second
    assert speed_words(1.0) == "about 1 word a second on this machine"
    assert speed_words(12.4) == "about 12 words a second on this machine"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to one core (Linux)")
def test_the_bandwidth_probe_reads_the_memory_not_how_busy_the_cores_are():
    """Every verdict's speed divides by the measured bandwidth. On the wall clock the probe read
    1.1 GB/s here at a load of 20 (the cores read 15), and "under one word a second" stood on
    every model. Probe and busy loops share one core: the figure keeps most of its quiet value."""
    import subprocess
    import sys
    import time

    cpu = sorted(os.sched_getaffinity(0))[0]
    probe = (f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
             "from models_registry.speed import measure_read_bandwidth\nprint(measure_read_bandwidth())")

    def measure() -> float:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    quiet = measure()
    spin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    busy_loops = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(12)]
    try:
        time.sleep(0.5)  # they are running on that core
        busy = measure()
    finally:
        for p in busy_loops:
            p.kill()
            p.wait()
    assert busy > 0.6 * quiet, (busy, quiet)


# -- 6. words of a chat that forgets ------------------------------------------------------
def test_one_forgotten_message_is_said_in_the_singular():
    from app.gui import formatting as fmt

    assert fmt.oldest_forgotten(1) == "the oldest message is forgotten"
    assert fmt.oldest_forgotten(3) == "the oldest 3 messages are forgotten"
