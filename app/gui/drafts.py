"""What the user has typed and not sent: the prompt box's text kept per chat, and a long
message held back while its tokens are counted.

The prompt box is one widget shared by every chat; without this a half-written message
followed the user into the next chat they opened and was sent there.
"""

from __future__ import annotations

from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QPlainTextEdit

LONG_DRAFT_CHARS = 600  # a message this long is counted in tokens before it is sent
DRAFT_TAG = -2          # token-count tag of a draft (conversation ids are positive)


class Drafts:
    """Unsent text per conversation (None: the chat not yet started), and the long message
    whose token count is awaited (`pending`)."""

    def __init__(self, edit: QPlainTextEdit):
        self.edit = edit
        self._texts: dict[int | None, str] = {}
        self._shown: int | None = None  # the chat whose draft is in the box
        self.pending: str | None = None

    def switch(self, conversation_id: int | None, keep: bool = True) -> None:
        """Keep the box's text under the chat it was typed in (unless `keep` is false: an edit
        abandoned by leaving), and bring back the text last typed in `conversation_id`."""
        if conversation_id == self._shown:
            return
        text = self.edit.toPlainText()
        if keep and text.strip():
            self._texts[self._shown] = text
        else:
            self._texts.pop(self._shown, None)
        self._shown = conversation_id
        self.pending = None  # a count on its way belongs to the chat left
        self.edit.setPlainText(self._texts.pop(conversation_id, ""))
        self.edit.moveCursor(QTextCursor.MoveOperation.End)

    def adopt(self, conversation_id: int) -> None:
        """The new chat was created (its first message saved): its drafts are now its own."""
        if self._shown is None:
            self._shown = conversation_id

    def forget(self, conversation_id: int) -> None:
        """The conversation was deleted: its draft goes with it."""
        self._texts.pop(conversation_id, None)
        if self._shown == conversation_id:
            self._shown = None

    def saved(self, conversation_id: int | None) -> str:
        """The draft kept for a chat that is not shown ("" when none)."""
        if conversation_id == self._shown:
            return self.edit.toPlainText()
        return self._texts.get(conversation_id, "")

    # -- a long message, counted before it is sent ------------------------------------------
    def needs_counting(self, text: str) -> bool:
        return len(text) >= LONG_DRAFT_CHARS and self.pending != text

    def hold(self, text: str) -> None:
        self.pending = text

    def take(self) -> str | None:
        text, self.pending = self.pending, None
        return text

    def give_back(self, text: str) -> None:
        """A message that was not sent returns to the box, unless the user typed anew."""
        if not self.edit.toPlainText().strip():
            self.edit.setPlainText(text)
