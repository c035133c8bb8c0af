"""The conversation database: round trips, search, cascade deletes, crash recovery."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from app import storage
from app.storage import COMPLETE, INTERRUPTED, STREAMING, Storage


@pytest.fixture
def db(tmp_path):
    s = Storage(tmp_path / "c.db")
    yield s
    s.close()


def test_default_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("THERMOCLINE_DATA_DIR", str(tmp_path / "data"))
    s = Storage()
    assert s.path == tmp_path / "data" / storage.DB_FILE
    assert s.path.is_file()
    assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()


def test_conversation_and_messages_round_trip(db, tmp_path):
    conv = db.create_conversation("First", system_prompt="Be terse.", sampling={"temperature": 0.2})
    db.add_message(conv.id, "user", "Hello")
    answer = db.add_message(conv.id, "assistant", "Hi", status=STREAMING)
    db.update_message(answer.id, content="Hi there", status=COMPLETE,
                      stats={"decode_tok_s": 12.5, "new_tokens": 3})
    db.close()

    again = Storage(tmp_path / "c.db")
    [c] = again.conversations()
    assert (c.title, c.system_prompt, c.sampling) == ("First", "Be terse.", {"temperature": 0.2})
    msgs = again.messages(conv.id)
    assert [(m.role, m.content, m.status) for m in msgs] == [
        ("user", "Hello", COMPLETE), ("assistant", "Hi there", COMPLETE)]
    assert msgs[1].stats == {"decode_tok_s": 12.5, "new_tokens": 3}
    assert msgs[0].as_chat() == {"role": "user", "content": "Hello"}
    again.close()


def test_order_search_rename_delete(db):
    a = db.create_conversation("Rust lifetimes")
    b = db.create_conversation("Cooking")
    db.add_message(b.id, "user", "how long to boil 100% durum pasta?")
    db.add_message(a.id, "user", "explain borrowck")  # a becomes most recent
    assert [c.id for c in db.conversations()] == [a.id, b.id]
    assert [c.id for c in db.conversations("PASTA")] == [b.id]
    assert [c.id for c in db.conversations("rust")] == [a.id]
    assert [c.id for c in db.conversations("100%")] == [b.id]  # % is literal, not a wildcard
    assert db.conversations("zebra") == []
    db.rename_conversation(b.id, "  Pasta   timing ")
    assert db.conversation(b.id).title == "Pasta timing"
    db.delete_conversation(b.id)
    assert db.conversation(b.id) is None
    assert db.messages(b.id) == []  # cascade


def test_delete_messages_from(db):
    c = db.create_conversation()
    m1 = db.add_message(c.id, "user", "one")
    m2 = db.add_message(c.id, "assistant", "two")
    db.add_message(c.id, "user", "three")
    db.delete_messages_from(c.id, m2.id)
    assert [m.id for m in db.messages(c.id)] == [m1.id]


def test_rejects_bad_role_and_status(db):
    c = db.create_conversation()
    with pytest.raises(ValueError):
        db.add_message(c.id, "robot", "x")
    with pytest.raises(ValueError):
        db.add_message(c.id, "user", "x", status="weird")


def test_killed_mid_answer_keeps_partial_text(tmp_path):
    """A process killed while streaming loses nothing it had saved; next start marks it."""
    path = tmp_path / "k.db"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from app.storage import Storage, STREAMING
        s = Storage({str(path)!r})
        c = s.create_conversation("Kill me")
        s.add_message(c.id, "user", "count")
        m = s.add_message(c.id, "assistant", "", status=STREAMING)
        text = ""
        for word in ["one", " two", " three"]:
            text += word
            s.update_message(m.id, content=text)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    s = Storage(path)
    assert s.recover_interrupted() == 1
    [conv] = s.conversations()
    msgs = s.messages(conv.id)
    assert msgs[-1].content == "one two three"
    assert msgs[-1].status == INTERRUPTED
    assert s.recover_interrupted() == 0
    s.close()


def test_refuses_newer_schema(tmp_path):
    s = Storage(tmp_path / "n.db")
    s._db.execute("PRAGMA user_version=99")
    s.close()
    with pytest.raises(RuntimeError, match="newer Thermocline"):
        Storage(tmp_path / "n.db")


# Schema 1 as release 1 wrote it (app/storage.py before the tool role): the migration's input.
SCHEMA_1 = """
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}', model TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL,
    updated_at REAL NOT NULL);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')), content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'complete', stats TEXT, created_at REAL NOT NULL);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
PRAGMA user_version=1;
"""

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}


def test_a_schema_1_database_is_migrated_keeping_every_chat_and_id(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(SCHEMA_1)
    old.execute("INSERT INTO conversations VALUES (1, 'Old chat', 'terse', '{\"temperature\": 0.3}', 'demo', 1, 2)")
    old.executemany("INSERT INTO messages (conversation_id, role, content, status, stats, created_at)"
                    " VALUES (1, ?, ?, 'complete', ?, 1)", [("user", "Hello", None), ("assistant", "Hi", '{"x": 1}'),
                                                            ("user", "gone", None)])
    old.execute("DELETE FROM messages WHERE id = 3")  # its id must not come back
    old.commit()
    old.close()

    db = Storage(path)
    assert db._db.execute("PRAGMA user_version").fetchone()[0] == storage.SCHEMA_VERSION == 2
    [conv] = db.conversations()
    assert (conv.title, conv.system_prompt, conv.sampling, conv.model) == ("Old chat", "terse", {"temperature": 0.3},
                                                                          "demo")
    msgs = db.messages(1)
    assert [(m.id, m.role, m.content, m.stats) for m in msgs] == [(1, "user", "Hello", None), (2, "assistant", "Hi",
                                                                                              {"x": 1})]
    call = db.add_message(1, "assistant", "", tool_calls=[CALL])
    result = db.add_message(1, "tool", "{\"temp\": 21}", tool_call_id="call_1")
    assert call.id == 4 and result.id == 5  # past the deleted one
    db.delete_conversation(1)  # the rebuilt table still cascades
    assert db.messages(1) == []
    db.close()


def test_tool_calls_and_results_round_trip(db, tmp_path):
    c = db.create_conversation()
    db.add_message(c.id, "user", "Weather?")
    db.add_message(c.id, "assistant", "Let me look.", tool_calls=[CALL])
    db.add_message(c.id, "tool", "{\"temp\": 21}", tool_call_id="call_1")
    db.close()
    again = Storage(tmp_path / "c.db")
    _, call, result = again.messages(c.id)
    assert call.tool_calls == [CALL] and call.as_chat() == {"role": "assistant", "content": "Let me look.",
                                                            "tool_calls": [CALL]}
    assert result.as_chat() == {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"}
    with pytest.raises(ValueError):
        again.add_message(c.id, "user", "x", tool_calls=[CALL])
    with pytest.raises(ValueError):
        again.add_message(c.id, "tool", "no call named")
    again.close()
