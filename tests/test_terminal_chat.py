"""`thermocline chat`: commands stay out of the model, chats are saved with the window's,
and a long chat keeps going under the context policy. The real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def chat(tmp_path, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "THERMOCLINE_CONFIG_DIR": str(tmp_path / "cfg"),
           "THERMOCLINE_DATA_DIR": str(tmp_path / "data"), "THERMOCLINE_MODELS_DIR": str(tmp_path / "models")}
    return subprocess.run([sys.executable, "-m", "app.cli", "chat", *args], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, env=env, timeout=280)


def test_commands_are_not_sent_and_the_chat_is_saved(tmp_path, llama_dir):
    from app.storage import Storage

    out = chat(tmp_path, ["/help", "/nonsense", "hello there", "/quit"], "--model", str(llama_dir),
               "--mode", "dense", "--max-new-tokens", "5", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert "/new" in out.stdout and "unknown command /nonsense" in out.stdout
    assert out.stdout.count("bot>") == 1  # only the real message reached the model
    store = Storage(tmp_path / "data" / "conversations.db")
    try:
        [conv] = store.conversations()
        assert conv.title == "hello there"
        assert [m.role for m in store.messages(conv.id)] == ["user", "assistant"]
    finally:
        store.close()


def test_a_long_chat_forgets_the_oldest_messages(tmp_path, llama_dir):
    lines = [f"tell me about the sea and the ships number {i}" for i in range(8)] + ["/quit"]
    out = chat(tmp_path, lines, "--model", str(llama_dir), "--mode", "dense", "--ctx", "128",
               "--max-new-tokens", "16", "--temperature", "0", "--no-save")
    assert out.returncode == 0, out.stderr
    assert "forgets the oldest" in out.stdout
    assert out.stdout.count("bot>") == 8 and "conversation is full" not in out.stdout


def test_one_message_longer_than_the_model_reads_is_refused_before_sending(tmp_path, llama_dir):
    """A brand-new chat whose first message alone cannot fit: no /new, no Preferences, not sent."""
    long_line = " ".join(f"word{i} and the sea" for i in range(200))
    out = chat(tmp_path, [long_line, "a short one", "/quit"], "--model", str(llama_dir), "--mode", "dense",
               "--ctx", "128", "--max-new-tokens", "16", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert "not sent: this message is" in out.stdout and "reads at most 128 tokens" in out.stdout
    refusal = out.stdout.split("not sent:")[1].split(")")[0]
    assert "/new" not in refusal and "Preferences" not in refusal
    assert out.stdout.count("bot>") == 1  # only the short message reached the model
    from app.storage import Storage

    store = Storage(tmp_path / "data" / "conversations.db")
    try:
        [conv] = store.conversations()
        assert [m.content for m in store.messages(conv.id) if m.role == "user"] == ["a short one"]
    finally:
        store.close()
