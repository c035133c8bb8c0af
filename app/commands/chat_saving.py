"""The terminal chat's writes to the conversation database, which may fail mid-chat.

Another process can hold the database past the busy timeout, or it can turn read-only or
full. A failed write must not end the chat nor lose a line: each message waits in memory,
in order, is retried with the next one (and once more at the end), and the user hears about
the failure once, and again when saving works again. The window does the same through
`Storage.save_message` and a timer (app/gui/chat_session.py).
"""

from __future__ import annotations

import sqlite3
import sys
from dataclasses import dataclass, field

SAVE_ERRORS = (sqlite3.Error, OSError)


@dataclass
class _Conversation:
    title: str
    options: dict
    id: int | None = None


@dataclass
class ChatSaver:
    storage: object  # app.storage.Storage
    owed: list = field(default_factory=list)  # (conversation, role, text, extra) not written yet
    current: _Conversation | None = None
    warned: bool = False

    def new_conversation(self, title: str, **options) -> None:
        """The next message starts a new conversation (created with its first write)."""
        self.current = _Conversation(title, options)

    def add(self, role: str, text: str, **extra) -> bool:
        self.owed.append((self.current, role, text, extra))
        return self.flush()

    def flush(self) -> bool:
        """Write what is owed, in order; False (said once) when the database still refuses."""
        try:
            while self.owed:
                conversation, role, text, extra = self.owed[0]
                if conversation.id is None:
                    conversation.id = self.storage.create_conversation(conversation.title,
                                                                       **conversation.options).id
                self.storage.add_message(conversation.id, role, text, **extra)
                self.owed.pop(0)
        except SAVE_ERRORS as exc:
            if not self.warned:
                self.warned = True
                print(f"(could not save this chat: {str(exc)[:200]}; everything stays on screen, and saving "
                      "is tried again with the next message)", file=sys.stderr)
            return False
        if self.warned:
            self.warned = False
            print("(the chat is saved again)", file=sys.stderr)
        return True

    def close(self) -> None:
        self.flush()
        if self.owed:
            print(f"({len(self.owed)} message(s) of this chat could not be saved)", file=sys.stderr)
        self.storage.close()
