"""Storage and settings faults in the terminal chat (issue 28), each in its own process.

Mid-chat, another process holds the database past the busy timeout: the chat must say so
once, keep going, and save everything once the database takes writes again. A settings.json
with values that cannot be used (1e400, NaN, out of range) must not stop the chat: each is
ignored with one warning naming settings.json and the key.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from hostile_cases import HANG_GUARD_S, Sandbox

pytestmark = pytest.mark.timeout(600)


class _Chat:
    """`thermocline chat` over pipes: `say(line)` waits for that answer (bounded)."""

    def __init__(self, box: Sandbox):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "chat", "--max-new-tokens", "3", "--temperature", "0"],
            cwd=box.root / "cwd", env=box.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _pump(stream, sink: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            sink.extend(chunk)

    def say(self, line: str) -> None:
        answers = self.out.count(b"tokens/s") + self.out.count(b"first word after")
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + HANG_GUARD_S
        while self.out.count(b"tokens/s") + self.out.count(b"first word after") <= answers:
            assert self.proc.poll() is None, f"the chat ended: {self.err.decode(errors='replace')[-2000:]}"
            assert time.monotonic() < deadline, "no answer: the chat hangs"
            time.sleep(0.05)

    def quit(self) -> int:
        self.proc.stdin.write(b"/quit\n")
        self.proc.stdin.close()
        return self.proc.wait(timeout=HANG_GUARD_S)


def test_a_database_locked_mid_chat_keeps_the_lines_and_saves_them_later(tmp_path):
    box = Sandbox(tmp_path)
    chat = _Chat(box)
    chat.say("Hello")
    db = sqlite3.connect(tmp_path / "data" / "conversations.db", isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")  # held past the chat's 2 s busy timeout
    chat.say("Second line")
    chat.say("Third line")
    db.execute("ROLLBACK")
    chat.say("Fourth line")
    rc = chat.quit()
    err = chat.err.decode(errors="replace")
    assert rc == 0 and "Traceback" not in err, err
    assert err.count("could not save this chat") == 1 and "saved again" in err
    assert chat.out.count(b"bot>") == 4
    rows = db.execute("SELECT role, content FROM messages ORDER BY id").fetchall()
    users = [content for role, content in rows if role == "user"]
    assert users == ["Hello", "Second line", "Third line", "Fourth line"]
    assert [role for role, _ in rows].count("assistant") == 4
    assert db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 1
    assert box.stray_files() == []


@pytest.mark.parametrize("value, key", [("1e400", "chat.max_new_tokens"), ("NaN", "chat.temperature"),
                                        ("-Infinity", "chat.top_p"), ("99999999", "chat.top_k"),
                                        ('"' + "x" * 100_000 + '"', "chat.temperature")])
def test_unusable_settings_are_ignored_with_one_warning(tmp_path, value, key):
    box = Sandbox(tmp_path)
    (tmp_path / "config" / "settings.json").write_text('{"%s": %s}' % (key, value))
    out = box.run("chat", "--max-new-tokens", "2", stdin=b"Hello\n/quit\n")
    out.assert_ok()
    warnings = [line for line in out.stderr.splitlines() if key in line]
    assert len(warnings) == 1 and "settings.json" in warnings[0] and len(warnings[0]) < 400, out.stderr
    assert "bot>" in out.stdout
