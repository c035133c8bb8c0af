"""Small widgets of the chat page: a title that elides instead of widening the window, and
the one-line banner above the prompt box."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget


class ElidedLabel(QLabel):
    """A one-line label that shortens its text with … instead of widening the window."""

    def __init__(self, text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._full = ""
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt API
        self._full = text
        self.setToolTip(text)
        self._elide()

    def text(self) -> str:
        return self._full

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = max(10, self.width())
        super().setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, width))


class Banner(QFrame):
    """A one-line notice above the prompt, with an optional action."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel(self)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.label, 1)
        self.action = QPushButton(self)
        self.action.setObjectName("bannerAction")
        layout.addWidget(self.action)
        self._slot = None
        self.action.clicked.connect(self._clicked)
        self.hide()

    def show_message(self, text: str, kind: str = "info", action: str = "", slot=None) -> None:
        self.label.setText(text)
        self.setProperty("kind", kind)
        self.style().unpolish(self)
        self.style().polish(self)
        self.action.setText(action)
        self.action.setVisible(bool(action))
        self._slot = slot
        self.show()

    def _clicked(self) -> None:
        if self._slot:
            self._slot()
