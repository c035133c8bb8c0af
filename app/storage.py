"""Conversations and messages in SQLite (stdlib sqlite3, WAL) in the user data dir.

An answer being generated is saved as it is shown, with status `streaming`; a finished one
becomes `complete`, a stopped one `stopped`. If the app dies mid-answer, the next start
marks leftover `streaming` rows `interrupted` (`recover_interrupted`), so nothing that was
on screen is lost. WAL with synchronous=NORMAL keeps every committed write across a
process crash while making the per-flush commits cheap enough for the GUI thread.

Tool calls (schema 2): an assistant message may carry the tool calls the model made
(`tool_calls`, OpenAI's shape: id, type, function name and arguments as JSON text), and a
`tool` message carries a call's result (`tool_call_id` names the call). A schema-1 database
is migrated in place on open, in one transaction: every conversation and message is kept
with its id.

`THERMOCLINE_DATA_DIR` overrides the folder (tests and scripts).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

APP_NAME = "Thermocline"
DATA_DIR_ENV = "THERMOCLINE_DATA_DIR"
DB_FILE = "conversations.db"
SCHEMA_VERSION = 2

# Message status values.
COMPLETE = "complete"
STREAMING = "streaming"
STOPPED = "stopped"
INTERRUPTED = "interrupted"
FAILED = "failed"
STATUSES = (COMPLETE, STREAMING, STOPPED, INTERRUPTED, FAILED)
ROLES = ("system", "user", "assistant", "tool")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    title         TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling      TEXT NOT NULL DEFAULT '{}',
    model         TEXT NOT NULL DEFAULT '',
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: ids name widgets and requests
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'complete',
    stats           TEXT,
    created_at      REAL NOT NULL,
    tool_calls      TEXT,  -- an assistant's calls: a JSON list in OpenAI's shape
    tool_call_id    TEXT   -- a tool message: the call it answers
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""
# Schema 1 -> 2: SQLite cannot widen a CHECK, so the messages table is rebuilt with its rows
# and ids, and its AUTOINCREMENT counter, so that no id is ever reused.
_MIGRATE_1_TO_2 = """
CREATE TABLE messages_v2 (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'complete',
    stats           TEXT,
    created_at      REAL NOT NULL,
    tool_calls      TEXT,
    tool_call_id    TEXT
);
INSERT INTO messages_v2 (id, conversation_id, role, content, status, stats, created_at)
    SELECT id, conversation_id, role, content, status, stats, created_at FROM messages;
DROP TABLE messages;
ALTER TABLE messages_v2 RENAME TO messages;
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    sampling: dict
    model: str
    created_at: float
    updated_at: float


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = COMPLETE
    stats: dict | None = None
    created_at: float = field(default_factory=time.time)
    tool_calls: list[dict] | None = None  # an assistant's: [{"id", "type": "function", "function": {...}}]
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def as_chat(self) -> dict:
        """The form the engine renders with the chat template: role and content, and an
        assistant's tool calls or a tool result's call id where the message has them."""
        chat = {"role": self.role, "content": self.content}
        if self.tool_calls:
            chat["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            chat["tool_call_id"] = self.tool_call_id
        return chat


# A write that failed for a reason outside the program: a full disk, an I/O error, a folder
# made read-only. The window keeps the text in memory and writes it again later.
WRITE_ERRORS = (sqlite3.OperationalError, OSError)


class Storage:
    """All reads and writes of the conversation database (one connection, one thread)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else data_dir() / DB_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit; explicit txns
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=2000")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} was written by a newer Thermocline (schema {version}); update the app"
            )
        if version < 2 and self._has_table("messages") and not self._has_column("messages", "tool_calls"):
            self._migrate_1_to_2()
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self._pending: dict[int, dict] = {}  # message id -> fields a failed write still owes the disk
        self.last_write_error: Exception | None = None

    def _has_table(self, name: str) -> bool:
        return self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                (name,)).fetchone() is not None

    def _has_column(self, table: str, column: str) -> bool:
        return any(row["name"] == column for row in self._db.execute(f"PRAGMA table_info({table})"))

    def _migrate_1_to_2(self) -> None:
        """Add the tool role and the tool-call columns, keeping every message and its id; all
        or nothing (a failure leaves the schema-1 database as it was)."""
        db = self._db
        seq = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
        db.execute("PRAGMA foreign_keys=OFF")  # the rebuild drops the old table; conversations stay
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _MIGRATE_1_TO_2.split(";"):
                    if statement.strip():
                        db.execute(statement)
                if seq is not None:  # the counter of ids handed out, deleted messages' included
                    cur = db.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'messages'", (seq[0],))
                    if cur.rowcount == 0:  # no message left to carry it over
                        db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', ?)", (seq[0],))
                db.execute("PRAGMA user_version=2")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        finally:
            db.execute("PRAGMA foreign_keys=ON")

    def close(self) -> None:
        """Last try to write what is owed, then close; never raises (quitting must work)."""
        try:
            self.retry_pending()
            self._db.close()
        except (sqlite3.Error, OSError):
            pass

    # -- conversations -------------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", system_prompt: str = "",
                            sampling: dict | None = None, model: str = "") -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, sampling, model, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (title, system_prompt, json.dumps(sampling or {}), model, now, now),
        )
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """Most recently used first; `search` matches titles and message text (any case)."""
        if not search.strip():
            rows = self._db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC")
        else:
            pattern = "%" + _escape_like(search.strip()) + "%"
            rows = self._db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS ("
                " SELECT 1 FROM messages m WHERE m.conversation_id = c.id"
                " AND m.content LIKE ?1 ESCAPE '\\') ORDER BY updated_at DESC, id DESC",
                (pattern,),
            )
        return [_conversation(row) for row in rows]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split()) or "Untitled"
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def update_conversation(self, conversation_id: int, *, system_prompt: str | None = None,
                            sampling: dict | None = None, model: str | None = None) -> None:
        fields, values = [], []
        if system_prompt is not None:
            fields.append("system_prompt = ?")
            values.append(system_prompt)
        if sampling is not None:
            fields.append("sampling = ?")
            values.append(json.dumps(sampling))
        if model is not None:
            fields.append("model = ?")
            values.append(model)
        if fields:
            values.append(conversation_id)
            self._db.execute(f"UPDATE conversations SET {', '.join(fields)} WHERE id = ?", values)

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def touch(self, conversation_id: int) -> None:
        self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (time.time(), conversation_id))

    # -- messages ------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, status: str = COMPLETE,
                    stats: dict | None = None, *, tool_calls: list[dict] | None = None,
                    tool_call_id: str | None = None) -> Message:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        if tool_calls and role != "assistant":
            raise ValueError("only an assistant message carries tool calls")
        if (role == "tool") != (tool_call_id is not None):
            raise ValueError("a tool message, and only one, names the call it answers (tool_call_id)")
        now = time.time()
        with self._transaction():
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, stats, created_at, tool_calls,"
                " tool_call_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, status, _dump(stats), now,
                 json.dumps(tool_calls) if tool_calls else None, tool_call_id),
            )
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return Message(cur.lastrowid, conversation_id, role, content, status, stats, now, tool_calls or None,
                       tool_call_id)

    def update_message(self, message_id: int, *, content: str | None = None, status: str | None = None,
                       stats: dict | None = None) -> None:
        fields, values = [], []
        if content is not None:
            fields.append("content = ?")
            values.append(content)
        if status is not None:
            if status not in STATUSES:
                raise ValueError(f"unknown status {status!r}")
            fields.append("status = ?")
            values.append(status)
        if stats is not None:
            fields.append("stats = ?")
            values.append(_dump(stats))
        if fields:
            values.append(message_id)
            self._db.execute(f"UPDATE messages SET {', '.join(fields)} WHERE id = ?", values)

    def save_message(self, message_id: int, *, content: str | None = None, status: str | None = None,
                     stats: dict | None = None) -> bool:
        """`update_message` for the streaming answer, which never raises for a failed write:
        the fields wait in memory (newest wins) and go out with the next save or `retry_pending`.
        Returns whether everything owed is now on disk."""
        fields = {k: v for k, v in (("content", content), ("status", status), ("stats", stats)) if v is not None}
        self._pending.setdefault(message_id, {}).update(fields)
        return self.retry_pending()

    def retry_pending(self) -> bool:
        """Write what earlier saves could not; True when nothing is owed any more."""
        for message_id in list(self._pending):
            try:
                self.update_message(message_id, **self._pending[message_id])
            except WRITE_ERRORS as exc:
                self.last_write_error = exc
                return False
            del self._pending[message_id]
        self.last_write_error = None
        return True

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def message(self, message_id: int) -> Message | None:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        return self._with_pending(_message(row)) if row else None

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        return [self._with_pending(_message(row)) for row in rows]

    def _with_pending(self, message: Message) -> Message:
        """What the disk will hold once the owed writes succeed (the window shows that)."""
        for key, value in self._pending.get(message.id, {}).items():
            setattr(message, key, value)
        return message

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and everything after it (edit-and-resend, regenerate)."""
        self._db.execute(
            "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id)
        )

    def recover_interrupted(self) -> int:
        """Mark answers left `streaming` by a crash or kill as `interrupted`; returns how many."""
        cur = self._db.execute("UPDATE messages SET status = ? WHERE status = ?", (INTERRUPTED, STREAMING))
        return cur.rowcount

    # -- helpers -------------------------------------------------------------------------
    def _transaction(self):
        db = self._db

        class _Txn:
            def __enter__(self):
                db.execute("BEGIN")

            def __exit__(self, exc_type, exc, tb):
                db.execute("ROLLBACK" if exc_type else "COMMIT")
                return False

        return _Txn()


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _dump(stats: dict | None) -> str | None:
    return None if stats is None else json.dumps(stats)


def _load_json(text: str | None, fallback):
    if not text:
        return fallback
    try:
        return json.loads(text)
    except ValueError:
        return fallback


def _conversation(row: sqlite3.Row) -> Conversation:
    sampling = _load_json(row["sampling"], {})
    return Conversation(
        id=row["id"], title=row["title"], system_prompt=row["system_prompt"],
        sampling=sampling if isinstance(sampling, dict) else {}, model=row["model"],
        created_at=row["created_at"], updated_at=row["updated_at"],
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=row["id"], conversation_id=row["conversation_id"], role=row["role"], content=row["content"],
        status=row["status"], stats=_load_json(row["stats"], None), created_at=row["created_at"],
        tool_calls=_calls(_load_json(row["tool_calls"], None)), tool_call_id=row["tool_call_id"],
    )


def _calls(value) -> list[dict] | None:
    """The stored tool calls, as far as they are calls (a damaged row shows none, not a crash)."""
    if not isinstance(value, list):
        return None
    calls = [c for c in value if isinstance(c, dict) and isinstance(c.get("function"), dict)]
    return calls or None
