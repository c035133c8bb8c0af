"""The prompt box: Enter sends, Shift+Enter starts a new line, it grows with its text."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

MAX_LINES = 8
PLACEHOLDER = "Message the model  (Enter sends)"
# The keys the prompt box handles itself (keyPressEvent below); Help → Keyboard shortcuts lists them.
KEYS = (("Enter", "Send the message"), ("Shift+Enter", "Start a new line in the message"))


class PromptEdit(QPlainTextEdit):
    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setTabChangesFocus(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.document().contentsChanged.connect(self._fit)
        self._fit()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt API
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            if not mods & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.AltModifier):
                self.submitted.emit()
                return
            self.insertPlainText("\n")
            return
        super().keyPressEvent(event)

    def _fit(self) -> None:
        lines = min(MAX_LINES, max(1, int(self.document().size().height())))
        line = self.fontMetrics().lineSpacing()
        margins = int(self.document().documentMargin() * 2) + self.contentsMargins().top() + \
            self.contentsMargins().bottom() + 4
        self.setFixedHeight(lines * line + margins)


class InputBar(QFrame):
    """Prompt box plus one button that reads Send, or Stop while an answer streams."""

    send_requested = Signal(str)
    stop_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("inputBar")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(12, 8, 8, 8)
        row = QHBoxLayout()
        row.setSpacing(8)
        self.edit = PromptEdit(self)
        self.edit.setPlaceholderText(PLACEHOLDER)
        self.edit.setToolTip("Enter sends; Shift+Enter starts a new line")
        self.edit.submitted.connect(self._submit)
        self.button = QPushButton("Send", self)
        self.button.setObjectName("sendButton")
        self.button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.button.clicked.connect(self._clicked)
        row.addWidget(self.edit, 1)
        row.addWidget(self.button, 0, Qt.AlignmentFlag.AlignBottom)
        outer.addLayout(row)
        self._busy = False
        self._ready = True
        self._can_wait = False  # a model is loading: Enter keeps the message and sends it once loaded
        self.waiting = False    # a message waits for the model
        self._sync()

    def set_busy(self, busy: bool) -> None:
        self._busy = busy
        self._sync()

    def set_stopping(self) -> None:
        """Stop was pressed: say so until the answer has ended (no second click needed)."""
        if self._busy:
            self.button.setText("Stopping…")
            self.button.setEnabled(False)
            self.button.setToolTip("Stopping: the model finishes the piece it is reading")

    def set_ready(self, ready: bool, why: str = "", can_wait: bool = False) -> None:
        """Whether a model is loaded; `why` replaces the placeholder when it is not. `can_wait`:
        one is loading, so Enter keeps the message and sends it when the model is ready."""
        self._ready, self._can_wait = ready, can_wait and not ready
        if not ready and not can_wait:
            self.waiting = False  # nothing will load: the message stays in the box, unsent
        self.edit.setPlaceholderText(
            PLACEHOLDER if ready else why)
        self.edit.viewport().update()
        self._sync()
        if ready and self.waiting:
            self.waiting = False
            self._submit()

    def cancel_waiting(self) -> bool:
        """Esc before the model was ready: the message stays in the box, not sent."""
        if not self.waiting:
            return False
        self.waiting = False
        self._sync()
        return True

    def _sync(self) -> None:
        waiting = self.waiting and not self._busy
        self.button.setText("Stop" if self._busy else "Sends when loaded" if waiting else "Send")
        self.button.setProperty("stop", self._busy)
        self.button.style().unpolish(self.button)
        self.button.style().polish(self.button)
        self.button.setToolTip("Stop the answer (Esc)" if self._busy else
                               "The message is sent as soon as the model has loaded; Esc keeps it unsent"
                               if waiting else "Send (Enter)")
        self.button.setEnabled(self._busy or self._ready or self._can_wait)

    def _clicked(self) -> None:
        if self._busy:
            self.stop_requested.emit()
        elif self.waiting:
            self.cancel_waiting()
        else:
            self._submit()

    def _submit(self) -> None:
        if self._busy:
            return
        if not self._ready:
            if self._can_wait and self.edit.toPlainText().strip():
                self.waiting = True  # sent by set_ready(True)
                self._sync()
            return
        text = self.edit.toPlainText().strip()
        if text:
            self.edit.clear()
            self.send_requested.emit(text)
