"""Tool calls in the window: a conversation in which the model called a tool (stored with the
tool role and the assistant's tool_calls) is shown read-only, exported in Markdown and JSON,
and can be written on: the model reads the calls and results as plain turns."""

from __future__ import annotations

import json

import pytest

from gui_helpers import close_window, make_window, send, wait_idle

pytestmark = pytest.mark.timeout(300)

CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"C\"}"}}


def test_a_conversation_with_tool_calls_is_shown_read_only_and_exported(qtbot, tmp_path, llama_dir, monkeypatch):
    w = make_window(qtbot, tmp_path, llama_dir, max_new_tokens=6, monkeypatch=monkeypatch)
    try:
        conv = w.storage.create_conversation("Weather")
        w.storage.add_message(conv.id, "user", "Weather in Oslo?")
        w.storage.add_message(conv.id, "assistant", "Let me look.", tool_calls=[CALL])
        w.storage.add_message(conv.id, "tool", "{\"temp\": 21} <b>not markup</b>", tool_call_id="call_7")
        w.chat.open_conversation(conv.id)
        user, asked, result = w.chat.view.messages()
        assert asked.objectName() == "assistantMessage" and asked.text() == "Let me look."
        [label] = asked.call_labels
        qtbot.waitUntil(label.isVisible, timeout=5000)
        assert label.text().startswith("Called get_weather · call_7")
        assert json.loads(label.text().split("\n", 1)[1]) == {"city": "Oslo", "unit": "C"}
        assert result.objectName() == "toolMessage" and result.text() == "{\"temp\": 21} <b>not markup</b>"
        assert "call_7" in result.findChild(type(label), "messageRole").text()
        # read-only: neither is answered again nor edited, though the tool result is the last message
        assert not result.regen_button.isVisible() and not result.edit_button.isVisible()
        assert not asked.regen_button.isVisible() and not asked.edit_button.isVisible()
        assert "Called get_weather" in asked.copy_text()

        md, js = tmp_path / "chat.md", tmp_path / "chat.json"
        w.export_conversation(conv.id, "md", str(md))
        w.export_conversation(conv.id, "json", str(js))
        text = md.read_text(encoding="utf-8")
        assert "**Tool call** `get_weather` (call_7)" in text and '"city": "Oslo"' in text
        assert "## Tool result (call_7)" in text and "```\n{\"temp\": 21} <b>not markup</b>\n```" in text
        data = json.loads(js.read_text(encoding="utf-8"))["messages"]
        assert data[1]["tool_calls"] == [CALL] and data[2]["role"] == "tool" and data[2]["tool_call_id"] == "call_7"

        # Written on: the model reads the call and the result (as plain turns) and answers.
        send(qtbot, w, "Thanks!")
        wait_idle(qtbot, w)
        roles = [m.role for m in w.storage.messages(conv.id)]
        assert roles == ["user", "assistant", "tool", "user", "assistant"]
        plain = w.chat._chat_messages()
        assert [m["role"] for m in plain[:4]] == ["user", "assistant", "user", "user"]
        assert "get_weather" in plain[1]["content"] and "Result of tool call call_7" in plain[2]["content"]
    finally:
        close_window(w)
