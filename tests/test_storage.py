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
