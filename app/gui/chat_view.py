"""The scrolling conversation: one `MessageWidget` per message, newest at the bottom.

The view sticks to the bottom while an answer streams, unless the user has scrolled up to
read, in which case it leaves them where they are.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMenu, QPushButton, QScrollArea, QSizePolicy,
                               QVBoxLayout, QWidget)

from app.storage import COMPLETE, FAILED, INTERRUPTED, STOPPED, STREAMING

from . import formatting as fmt
from .markdown_view import MarkdownView

COLUMN_MAX_WIDTH = 860

_STATUS_TEXT = {
    STREAMING: ("generating…", "streaming"),
    STOPPED: ("stopped", "stopped"),
    INTERRUPTED: ("interrupted: this answer did not finish", "interrupted"),
    FAILED: ("failed", "failed"),
}


class MessageWidget(QFrame):
    """One message: who, the Markdown body, stats and actions."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)
    version_requested = Signal(int, int)  # message id, version index
    delete_requested = Signal(int)        # this message and every one after it
    continue_requested = Signal(int)      # write on where this answer stopped

    def __init__(self, message_id: int, role: str, text: str, status: str = COMPLETE,
                 stats: dict | None = None, created_at: float | None = None, model: str = "",
                 parent: QWidget | None = None, tool_calls: list[dict] | None = None,
                 tool_call_id: str | None = None):
        super().__init__(parent)
        self.message_id = message_id
        self.role = role
        self.tool_calls = tool_calls or []
        # A tool's result, or an answer that called tools: shown as they are, never answered again.
        self.read_only = role == "tool" or bool(self.tool_calls)
        self.setObjectName({"user": "userMessage", "tool": "toolMessage"}.get(role, "assistantMessage"))
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 10, 16, 10)
        layout.setSpacing(6)

        header = QHBoxLayout()
        header.setSpacing(8)
        who = QLabel({"user": "You", "tool": _tool_result_title(tool_call_id)}.get(role, model or "Assistant"), self)
        who.setObjectName("messageRole")
        header.addWidget(who)
        when = QLabel(time.strftime("%H:%M", time.localtime(created_at or time.time())), self)
        when.setObjectName("messageTime")
        header.addWidget(when)
        self.status_label = QLabel(self)
        self.status_label.setObjectName("messageStatus")
        header.addWidget(self.status_label)
        header.addStretch(1)
        layout.addLayout(header)

        if role == "tool":  # a tool's output is data, not Markdown: shown as it came
            self.body = _PlainBody(self)
        else:
            self.body = MarkdownView(self)
        layout.addWidget(self.body)
        self.call_labels = [_tool_call_label(call, self) for call in self.tool_calls]
        for label in self.call_labels:
            layout.addWidget(label)

        footer = QHBoxLayout()
        footer.setSpacing(4)
        self.stats_label = QLabel(self)
        self.stats_label.setObjectName("messageStats")
        self.stats_label.setWordWrap(True)
        footer.addWidget(self.stats_label, 1)
        # Earlier versions of a regenerated answer, ‹ 2/3 ›: made when there are some (widgets cost
        # a style pass each, and most answers have one version).
        self._footer = footer
        self.prev_version = self.version_label = self.next_version = None
        self._version = (0, 1)
        self.copy_button = self._action("Copy", "Copy the whole message as Markdown", self._copy)
        self._pager_at = footer.count()  # the pager goes here, before Copy
        footer.addWidget(self.copy_button)
        self.edit_button = self._action("Edit", "Edit this message and send it again (answers after it are replaced)",
                                        lambda: self.edit_requested.emit(self.message_id))
        self.regen_button = self._action("Regenerate", "Answer this again",
                                         lambda: self.regenerate_requested.emit(self.message_id))
        # Continue: on the last answer, when it was stopped or cut off by its length limit.
        self.continue_button = self._action("Continue", "Write on from where this answer stopped",
                                            lambda: self.continue_requested.emit(self.message_id))
        footer.addWidget(self.edit_button)
        footer.addWidget(self.continue_button)
        footer.addWidget(self.regen_button)
        layout.addLayout(footer)
        self._can_edit = True
        self._is_last = False

        self.edit_button.setVisible(role == "user")
        self.regen_button.setVisible(False)
        self.continue_button.setVisible(False)
        self.set_text(text)
        self.set_status(status)
        self.set_stats(stats)

    def _action(self, text: str, tip: str, slot) -> QPushButton:
        b = QPushButton(text, self)
        b.setObjectName("messageAction")
        b.setToolTip(tip)
        b.setCursor(Qt.CursorShape.PointingHandCursor)
        b.clicked.connect(slot)
        return b

    def text(self) -> str:
        return self.body.text()

    def set_text(self, text: str) -> None:
        self.body.set_markdown(text)

    def set_status(self, status: str) -> None:
        self.status = status
        label, kind = _STATUS_TEXT.get(status, ("", ""))
        self.status_label.setText(label)
        self.status_label.setProperty("kind", kind)
        self.status_label.style().unpolish(self.status_label)
        self.status_label.style().polish(self.status_label)
        self.status_label.setVisible(bool(label))
        self.copy_button.setEnabled(status != STREAMING)

    def can_continue(self) -> bool:
        """An answer that did not end by itself: stopped, or cut off at the longest answer."""
        return self.role == "assistant" and bool(self.text()) and (
            self.status == STOPPED or (self.status == COMPLETE and self._finish == "length"))

    def set_stats(self, stats: dict | None) -> None:
        self._finish = (stats or {}).get("finish_reason", "")
        self.stats_label.setText(fmt.message_stats(stats) if self.role == "assistant" else "")
        versions = (stats or {}).get("versions") or []
        count = len(versions) + 1
        index = (stats or {}).get("version_index", len(versions))
        index = index if isinstance(index, int) and 0 <= index < count else count - 1
        self._version = (index, count)
        if count == 1 and self.version_label is None:
            return
        if self.version_label is None:
            self.prev_version = self._action("‹", "Previous version of this answer", lambda: self._page(-1))
            self.version_label = QLabel(self)
            self.version_label.setObjectName("messageStats")
            self.next_version = self._action("›", "Next version of this answer", lambda: self._page(+1))
            for i, w in enumerate((self.prev_version, self.version_label, self.next_version)):
                self._footer.insertWidget(self._pager_at + i, w)
        self.version_label.setText(f"{index + 1}/{count}")
        self.version_label.setToolTip(f"Version {index + 1} of {count}: Regenerate keeps the earlier answers")
        for w in (self.prev_version, self.version_label, self.next_version):
            w.setVisible(self.role == "assistant" and count > 1)
        self.prev_version.setEnabled(index > 0)
        self.next_version.setEnabled(index < count - 1)

    def _page(self, step: int) -> None:
        index, count = self._version
        if 0 <= index + step < count:
            self.version_requested.emit(self.message_id, index + step)

    def set_actions_enabled(self, can_regenerate: bool, can_edit: bool) -> None:
        # On a last message from the user (its answer failed or never started) it reads "Answer".
        can_regenerate = can_regenerate and not self.read_only
        self.regen_button.setVisible(can_regenerate)
        self.regen_button.setText("Regenerate" if self.role == "assistant" else "Answer")
        self.regen_button.setToolTip("Answer this again" if self.role == "assistant"
                                     else "Ask the model to answer this message")
        self.edit_button.setVisible(self.role == "user")
        self.edit_button.setEnabled(can_edit)
        self._can_edit, self._is_last = can_edit, can_regenerate
        self.continue_button.setVisible(can_regenerate and self.can_continue())
        index, count = self._version
        if self.prev_version is not None:  # no paging while an answer streams
            self.prev_version.setEnabled(can_edit and index > 0)
            self.next_version.setEnabled(can_edit and index < count - 1)

    def contextMenuEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.context_menu().popup(event.globalPos())

    def context_menu(self) -> QMenu:
        """Copy, and what the footer offers, plus Delete (this message and those after it)."""
        menu = QMenu(self)
        menu.setObjectName("messageMenu")
        menu.addAction("Copy", self._copy).setEnabled(self.copy_button.isEnabled())
        if self.role == "user":
            menu.addAction("Edit…", lambda: self.edit_requested.emit(self.message_id)).setEnabled(self._can_edit)
        if self.continue_button.isVisible():
            menu.addAction("Continue", lambda: self.continue_requested.emit(self.message_id))
        if self.regen_button.isVisible():
            menu.addAction(self.regen_button.text(), lambda: self.regenerate_requested.emit(self.message_id))
        menu.addSeparator()
        delete = menu.addAction("Delete" if self._is_last else "Delete, with the messages after it",
                                lambda: self.delete_requested.emit(self.message_id))
        delete.setEnabled(self._can_edit)  # not while an answer streams
        self.menu = menu
        return menu

    def copy_text(self) -> str:
        """The message as Copy puts it on the clipboard: its text, then each tool call."""
        return "\n\n".join([self.text()] * bool(self.text()) + [label.text() for label in self.call_labels])

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.copy_text())
        self.copy_button.setText("Copied ✓")
        QTimer.singleShot(1500, self.copy_button, lambda: self.copy_button.setText("Copy"))  # dies with it


def _tool_result_title(call_id: str | None) -> str:
    return f"Tool result · {call_id}" if call_id else "Tool result"


def tool_call_text(call: dict) -> str:
    """One call as the window shows it: the function, then its arguments (pretty JSON where
    they are JSON, as written where not)."""
    import json

    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    try:
        args = json.dumps(json.loads(args) if isinstance(args, str) else args, indent=2, ensure_ascii=False)
    except ValueError:
        pass
    return f"Called {fn.get('name', '?')}" + (f" · {call['id']}" if call.get("id") else "") + f"\n{args}"


def _tool_call_label(call: dict, parent: QWidget) -> QLabel:
    label = QLabel(tool_call_text(call), parent)
    label.setObjectName("toolCall")
    label.setTextFormat(Qt.TextFormat.PlainText)  # a model's arguments are never markup
    label.setWordWrap(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    label.setToolTip("A tool call the model made (read-only)")
    return label


class _PlainBody(QLabel):
    """A tool result's body: plain, selectable text (the MarkdownView's text/set_markdown)."""

    def __init__(self, parent: QWidget):
        super().__init__(parent)
        self.setObjectName("toolResult")
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setWordWrap(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

    def set_markdown(self, text: str) -> None:
        self.setText(text)


class ChatView(QScrollArea):
    """All messages of the open conversation."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)
    version_requested = Signal(int, int)
    delete_requested = Signal(int)
    continue_requested = Signal(int)
    show_earlier_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        canvas = QWidget(self)
        canvas.setObjectName("chatCanvas")
        outer = QHBoxLayout(canvas)
        outer.setContentsMargins(16, 16, 16, 16)
        self.column = QWidget(canvas)
        self.column.setMaximumWidth(COLUMN_MAX_WIDTH)
        self.column.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self._layout = QVBoxLayout(self.column)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(12)
        self.empty_label = QLabel(self.column)
        self.empty_label.setObjectName("emptyChat")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_label.setWordWrap(True)
        self.empty_label.setContentsMargins(0, 60, 0, 0)  # counted in its size hint, unlike a QSS margin
        self._layout.addWidget(self.empty_label)
        self.earlier_button = QPushButton(self.column)
        self.earlier_button.setObjectName("earlierButton")
        self.earlier_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.earlier_button.clicked.connect(self.show_earlier_requested)
        self.earlier_button.hide()
        self._layout.addWidget(self.earlier_button, 0, Qt.AlignmentFlag.AlignHCenter)
        self._layout.addStretch(1)
        outer.addStretch(0)
        outer.addWidget(self.column, 1)
        outer.addStretch(0)
        self.setWidget(canvas)
        self._messages: list[MessageWidget] = []
        self._stick = True
        self.verticalScrollBar().valueChanged.connect(self._on_scrolled)
        self.verticalScrollBar().rangeChanged.connect(self._on_range)
        self.set_empty_text("")

    # -- content -------------------------------------------------------------------------
    def set_empty_text(self, text: str) -> None:
        self.empty_label.setText(text)
        self.empty_label.setVisible(not self._messages and bool(text))

    def set_hidden_count(self, n: int) -> None:
        """Say that `n` older messages are not shown (long conversations open fast)."""
        self.earlier_button.setText(f"Show {n} earlier message{'s' if n != 1 else ''}")
        self.earlier_button.setVisible(n > 0)

    def clear(self) -> None:
        for w in self._messages:
            w.setParent(None)
            w.deleteLater()
        self._messages.clear()
        self._stick = True
        self.empty_label.setVisible(bool(self.empty_label.text()))

    def add_message(self, message_id: int, role: str, text: str, status: str = COMPLETE,
                    stats: dict | None = None, created_at: float | None = None, model: str = "",
                    tool_calls: list[dict] | None = None, tool_call_id: str | None = None) -> MessageWidget:
        w = MessageWidget(message_id, role, text, status, stats, created_at, model, self.column, tool_calls,
                          tool_call_id)
        w.edit_requested.connect(self.edit_requested)
        w.regenerate_requested.connect(self.regenerate_requested)
        w.version_requested.connect(self.version_requested)
        w.delete_requested.connect(self.delete_requested)
        w.continue_requested.connect(self.continue_requested)
        self._layout.insertWidget(self._layout.count() - 1, w)
        self._messages.append(w)
        self.empty_label.hide()
        self._stick = True
        return w

    def messages(self) -> list[MessageWidget]:
        return list(self._messages)

    def last(self) -> MessageWidget | None:
        return self._messages[-1] if self._messages else None

    def update_actions(self, busy: bool) -> None:
        """Regenerate only on the last answer, and nothing while an answer is streaming."""
        for i, w in enumerate(self._messages):
            w.set_actions_enabled(can_regenerate=(not busy and i == len(self._messages) - 1),
                                  can_edit=not busy)

    # -- scrolling -----------------------------------------------------------------------
    def _on_scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick = value >= bar.maximum() - 24

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick:
            self.verticalScrollBar().setValue(hi)

    def scroll_to_bottom(self) -> None:
        self._stick = True
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())
