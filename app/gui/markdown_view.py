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
from PySide6.QtGui import (QColor, QFont, QFontDatabase, QGuiApplication, QSyntaxHighlighter, QTextCharFormat,
                           QTextOption)
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


# -- syntax highlighting (Pygments) ---------------------------------------------------------
CODE_STYLES = {False: "default", True: "github-dark"}  # light, dark
_code_dark = False
_live_blocks: "set[CodeBlock]" = set()


def set_code_theme(dark: bool) -> None:
    """Colour code for a light or dark background; re-colours the blocks on screen."""
    global _code_dark
    if dark == _code_dark:
        return
    _code_dark = dark
    for block in list(_live_blocks):
        block.rehighlight()


def _style(dark: bool):
    from pygments.styles import get_style_by_name
    from pygments.util import ClassNotFound

    try:
        return get_style_by_name(CODE_STYLES[dark])
    except ClassNotFound:  # an older Pygments
        return get_style_by_name("monokai" if dark else "default")


def _lexer(lang: str):
    from pygments.lexers import TextLexer, get_lexer_by_name
    from pygments.util import ClassNotFound

    try:
        return get_lexer_by_name(lang, stripnl=False, ensurenl=False) if lang else TextLexer()
    except ClassNotFound:
        return TextLexer()


class PygmentsHighlighter(QSyntaxHighlighter):
    """Colours a code block with Pygments: the whole text is lexed once per change (a lexer needs
    the context of earlier lines), and each line takes its spans from that."""

    def __init__(self, document):
        super().__init__(document)
        self.lang = ""
        self.dark = False
        self._spans: list[list[tuple[int, int, QTextCharFormat]]] = []
        self._formats: dict = {}

    def set_code(self, code: str, lang: str, dark: bool) -> None:
        if dark != self.dark:
            self._formats.clear()
        self.lang, self.dark = lang, dark
        self._spans = self._lex(code)

    def _format(self, style, ttype) -> QTextCharFormat:
        fmt = self._formats.get(ttype)
        if fmt is None:
            spec = style.style_for_token(ttype)
            fmt = QTextCharFormat()
            if spec.get("color"):
                fmt.setForeground(QColor("#" + spec["color"]))
            if spec.get("bold"):
                fmt.setFontWeight(QFont.Weight.Bold)
            if spec.get("italic"):
                fmt.setFontItalic(True)
            self._formats[ttype] = fmt
        return fmt

    def _lex(self, code: str) -> list[list[tuple[int, int, QTextCharFormat]]]:
        lines: list[list[tuple[int, int, QTextCharFormat]]] = [[]]
        if not self.lang:
            return lines  # plain text: the theme's own colour
        style = _style(self.dark)
        col = 0
        for ttype, value in _lexer(self.lang).get_tokens(code):
            fmt = self._format(style, ttype)
            parts = value.split("\n")
            for i, part in enumerate(parts):
                if i:
                    lines.append([])
                    col = 0
                styled = (fmt.foreground().style() != Qt.BrushStyle.NoBrush or fmt.fontItalic()
                          or fmt.fontWeight() > QFont.Weight.Normal)
                if part and styled:
                    lines[-1].append((col, len(part), fmt))
                col += len(part)
        return lines

    def highlightBlock(self, text: str) -> None:  # noqa: N802 - Qt API
        n = self.currentBlock().blockNumber()
        if n < len(self._spans):
            for start, length, fmt in self._spans[n]:
                if length:
                    self.setFormat(start, length, fmt)


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
        self._lang = ""
        self.highlighter = PygmentsHighlighter(self.editor.document())
        _live_blocks.add(self)
        self.destroyed.connect(lambda *_: _live_blocks.discard(self))

    def set_code(self, code: str, lang: str) -> None:
        self.lang_label.setText(lang or "code")
        if code == self._code and lang == self._lang:
            return
        self._code, self._lang = code, lang
        self.highlighter.set_code(code, lang, _code_dark)
        self.editor.setPlainText(code)  # highlights as it lays out
        self._fit_height()

    def rehighlight(self) -> None:
        self.highlighter.set_code(self._code or "", self._lang, _code_dark)
        self.highlighter.rehighlight()

    def token_colour(self, line: int, column: int) -> QColor | None:
        """The colour shown at a place in the code (None: the default text colour)."""
        block = self.editor.document().findBlockByNumber(line)
        for r in block.layout().formats():
            if r.start <= column < r.start + r.length and r.format.foreground().style() != Qt.BrushStyle.NoBrush:
                return r.format.foreground().color()
        return None

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
        pad = self.editor.contentsMargins()  # the stylesheet's padding: without it the last line lost 6 px
        self.editor.setFixedHeight(lines * metrics.lineSpacing() + margins + pad.top() + pad.bottom() + bar)


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
