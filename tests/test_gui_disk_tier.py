"""The window over the disk tier (issue #29): a RAM budget below the model's rows runs from
disk, the panel says what that costs and how low the RAM slider may go, and the readout
shows the cache's hit share and the disk reads per token."""

from __future__ import annotations

from gui_helpers import close_window, make_window, send, wait_idle
from test_beyond_ram import _budget, _model
from test_sparse import RAM


def test_a_budget_below_the_rows_runs_from_disk_and_says_so(qtbot, tmp_path, wide_llama_dir, monkeypatch):
    from engine import Engine

    model = _model(tmp_path, wide_llama_dir)
    probe = Engine.load(model, mode="sparse", ram_budget=RAM, cpu_weights="int4")  # writes the prepared file
    budget = _budget(probe, 0.3)
    probe.close()
    w = make_window(qtbot, tmp_path, model, mode="sparse", start=False, max_new_tokens=8, monkeypatch=monkeypatch)
    try:
        w.settings["engine.cpu_weights"] = "int4"
        w.settings["budget.ram_bytes"] = budget
        w.settings["budget.vram_bytes"] = 0
        w.start()
        qtbot.waitUntil(lambda: w.client.model_info is not None, timeout=120_000)
        p = w.panel
        qtbot.waitUntil(lambda: p.placement is not None and p.machine is not None, timeout=30_000)
        assert p.placement["verdict"] == "runs from disk", p.placement
        assert p.verdict.text() == "Runs from disk"
        facts = p.place_facts.text()
        assert "from disk per token" in facts and "words a second" in facts
        least = p.placement["min_ram_bytes"]
        assert 0 < least < budget
        assert p.ram.note.isVisible() and "Runs down to" in p.ram.note.text()
        assert p.ram.slider.minimum() <= least // (1024**2) <= p.ram.slider.maximum()  # the slider reaches it

        send(qtbot, w, "the quick brown fox")
        wait_idle(qtbot, w)
        text = w.chat.readout.text()
        assert "cache served" in text and "a token from disk" in text, text

        # below the resident minimum: the panel names the minimum, the engine keeps its placement
        p.ram.slider.setValue(max(0, least // (1024**2) - 2))
        qtbot.waitUntil(lambda: "cannot work" in p.verdict.text(), timeout=10_000)
        assert "at least" in p.verdict.text()
    finally:
        close_window(w)
