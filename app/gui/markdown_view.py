"""Markdown for chat messages: prose through Qt's own Markdown renderer, code blocks as
widgets with a language tag and a Copy button.

A message is split into prose and fenced code segments; each segment is one widget. While an
answer streams, only the last segment changes, so only that widget re-renders: the cost of
a flush stays flat however long the answer gets. An unclosed fence at the end is a code block
still being written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QFontDatabase, QGuiApplication, QTextOption
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSizePolicy,
                               QVBoxLayout, QWidget)

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")


@dataclass
class Segment:
    kind: str  # "prose" | "code"
    text: str
    lang: str = ""
    closed: bool = True


PROSE_CHUNK_CHARS = 1200  # long prose is cut into chunks so a streaming flush re-renders little


def chunk_prose(text: str, limit: int = PROSE_CHUNK_CHARS) -> list[str]:
    """Prose cut at blank lines into chunks of about `limit` characters.

    Cuts are greedy from the start, so as an answer grows the earlier chunks stay as they
    were and only the last one re-renders. A cut is made only before a block that starts at
    the margin (not an indented continuation of a list item, which alone would read as code).
    """
    blocks = text.split("\n\n")
    chunks: list[list[str]] = []
    size = 0
    for block in blocks:
        can_cut = bool(block) and not block[0].isspace()
        if chunks and (size + len(block) <= limit or not can_cut):
            chunks[-1].append(block)
            size += len(block) + 2
        else:
            chunks.append([block])
            size = len(block)
    return ["\n\n".join(c).strip("\n") for c in chunks if "".join(c).strip()]


def split_markdown(text: str) -> list[Segment]:
    """Prose (in chunks) and fenced code blocks, in order (code text without its fences)."""
    out: list[Segment] = []
    for seg in _split_fences(text):
        if seg.kind == "prose":
            out.extend(Segment("prose", chunk) for chunk in chunk_prose(seg.text))
        else:
            out.append(seg)
    return out


def _split_fences(text: str) -> list[Segment]:
    segments: list[Segment] = []
    prose: list[str] = []
    code: list[str] | None = None
    fence = ""
    lang = ""
    for line in text.split("\n"):
        if code is None:
            m = _FENCE.match(line)
            if m:
                if prose and "".join(prose).strip():
                    segments.append(Segment("prose", "\n".join(prose).strip("\n")))
                prose = []
                fence, lang, code = m.group(1), m.group(2), []
            else:
                prose.append(line)
        else:
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                segments.append(Segment("code", "\n".join(code), lang, True))
                code = None
            else:
                code.append(line)
    if code is not None:
        segments.append(Segment("code", "\n".join(code), lang, False))
    elif prose and "".join(prose).strip():
        segments.append(Segment("prose", "\n".join(prose).strip("\n")))
    return segments


def _monospace():
    return QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)


class ProseLabel(QLabel):
    """A selectable, word-wrapped block of Markdown prose."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("prose")
        self.setTextFormat(Qt.TextFormat.MarkdownText)
        self.setWordWrap(True)
        self.setOpenExternalLinks(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        # Ignored: the column decides the width; a long unbreakable word must not widen the chat.
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(40)
        self._source = None
        self._heights: dict[int, int] = {}

    def set_source(self, text: str) -> None:
        if text != self._source:
            self._source = text
            self._heights.clear()
            self.setText(text)

    def changeEvent(self, event) -> None:  # noqa: N802 - Qt API
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._heights.clear()  # the same text lays out differently now
        super().changeEvent(event)

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt API
        # Every layout pass of the chat asks every label; QLabel lays its rich text out anew
        # each time. Cached per width, a streaming flush costs one label's layout, not all.
        height = self._heights.get(width)
        if height is None:
            height = self._heights[width] = super().heightForWidth(width)
        return height


class CodeBlock(QFrame):
    """A code block: language tag, Copy button, monospace text that scrolls sideways."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        header = QFrame(self)
        header.setObjectName("codeHeader")
        hl = QHBoxLayout(header)
        hl.setContentsMargins(10, 3, 4, 3)
        self.lang_label = QLabel(header)
        self.lang_label.setObjectName("codeLang")
        self.copy_button = QPushButton("Copy", header)
        self.copy_button.setObjectName("codeCopy")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.setToolTip("Copy this code to the clipboard")
        self.copy_button.clicked.connect(self.copy)
        hl.addWidget(self.lang_label)
        hl.addStretch(1)
        hl.addWidget(self.copy_button)
        self.editor = QPlainTextEdit(self)
        self.editor.setObjectName("codeText")
        self.editor.setReadOnly(True)
        self.editor.setFont(_monospace())
        self.editor.setWordWrapMode(QTextOption.WrapMode.NoWrap)
        self.editor.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.editor.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.editor.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.editor.setFrameShape(QFrame.Shape.NoFrame)
        layout.addWidget(header)
        layout.addWidget(self.editor)
        self._code = None

    def set_code(self, code: str, lang: str) -> None:
        self.lang_label.setText(lang or "code")
        if code == self._code:
            return
        self._code = code
        self.editor.setPlainText(code)
        self._fit_height()

    def code(self) -> str:
        return self._code or ""

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code())
        self.copy_button.setText("Copied ✓")
        QTimer.singleShot(1500, self.copy_button, lambda: self.copy_button.setText("Copy"))  # dies with it

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        """Tall enough for every line; room for a scroll bar only when a line is too wide."""
        lines = max(1, self.editor.document().blockCount())
        metrics = self.editor.fontMetrics()
        widest = max((metrics.horizontalAdvance(line) for line in (self._code or "").split("\n")), default=0)
        too_wide = widest + 16 > self.editor.viewport().width()
        bar = self.editor.horizontalScrollBar().sizeHint().height() if too_wide else 0
        margins = int(self.editor.document().documentMargin() * 2) + 2
        self.editor.setFixedHeight(lines * metrics.lineSpacing() + margins + bar)


class MarkdownView(QWidget):
    """A message body: updates in place, re-rendering only the segments that changed."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(8)
        self._widgets: list[QWidget] = []
        self._text = ""

    def text(self) -> str:
        return self._text

    def set_markdown(self, text: str) -> None:
        if text == self._text and self._widgets:
            return
        self._text = text
        segments = split_markdown(text)
        for i, seg in enumerate(segments):
            want = ProseLabel if seg.kind == "prose" else CodeBlock
            if i < len(self._widgets) and not isinstance(self._widgets[i], want):
                for w in self._widgets[i:]:
                    w.deleteLater()
                del self._widgets[i:]
            if i >= len(self._widgets):
                w = want(self)
                self._layout.addWidget(w)
                self._widgets.append(w)
            w = self._widgets[i]
            if seg.kind == "prose":
                w.set_source(seg.text)
            else:
                w.set_code(seg.text, seg.lang)
        for w in self._widgets[len(segments):]:
            w.deleteLater()
        del self._widgets[len(segments):]

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self._widgets if isinstance(w, CodeBlock)]
