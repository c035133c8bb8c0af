"""The declarative settings: validation, persistence, change listeners, damaged files."""

import json

import pytest

from app.settings import SCHEMA, Settings


def test_defaults_and_env_path(tmp_path, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "cfg"))
    s = Settings()
    assert s.path == tmp_path / "cfg" / "settings.json"
    for opt in SCHEMA:
        assert s[opt.name] == opt.default
        assert opt.validate(opt.default) == opt.default or opt.default is None


def test_set_persists_and_notifies(tmp_path):
    s = Settings(tmp_path / "s.json")
    seen = []
    unsubscribe = s.on_change(lambda name, value: seen.append((name, value)))
    assert s.set("engine.ctx", 4096) is True
    assert s.set("engine.ctx", 4096) is False  # unchanged: no save, no signal
    s["budget.vram_bytes"] = 3 * 2**30
    assert seen == [("engine.ctx", 4096), ("budget.vram_bytes", 3 * 2**30)]
    unsubscribe()
    s["engine.ctx"] = 1024
    assert len(seen) == 2

    again = Settings(tmp_path / "s.json")
    assert again["engine.ctx"] == 1024
    assert again["budget.vram_bytes"] == 3 * 2**30
    again.reset("budget.vram_bytes")
    assert Settings(tmp_path / "s.json")["budget.vram_bytes"] is None


def test_validation(tmp_path):
    s = Settings(tmp_path / "s.json")
    with pytest.raises(ValueError, match="at least"):
        s["engine.ctx"] = 5
    with pytest.raises(ValueError, match="one of"):
        s["engine.mode"] = "turbo"
    with pytest.raises(ValueError, match="whole number"):
        s["chat.top_k"] = 2.5
    with pytest.raises(ValueError, match="cannot be empty"):
        s["chat.temperature"] = None
    with pytest.raises(KeyError):
        s["no.such"] = 1
    s["chat.temperature"] = 1  # ints are fine for floats
    assert isinstance(s["chat.temperature"], float)


def test_damaged_file_falls_back_per_entry(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"engine.ctx": -3, "chat.top_k": 10, "from.the.future": 1}))
    s = Settings(path)
    assert s["engine.ctx"] == 2048  # bad value: default
    assert s["chat.top_k"] == 10
    path.write_text("{not json")
    assert Settings(path)["chat.top_k"] == 40


def test_listener_error_does_not_block_others(tmp_path):
    s = Settings(tmp_path / "s.json")
    seen = []
    s.on_change(lambda n, v: 1 / 0)
    s.on_change(lambda n, v: seen.append(n))
    s["ui.show_panel"] = False
    assert seen == ["ui.show_panel"]
    assert s.sampling_defaults()["top_k"] == 40
