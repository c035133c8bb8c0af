"""Splitting Markdown into prose and code segments, and the in-place message body."""

from __future__ import annotations

from app.gui.markdown_view import MarkdownView, split_markdown


def kinds(text):
    return [(s.kind, s.lang, s.text, s.closed) for s in split_markdown(text)]


def test_prose_and_fenced_code():
    text = "Intro **bold**\n\n```python\nx = 1\n\nprint(x)\n```\nAfter."
    assert kinds(text) == [("prose", "", "Intro **bold**", True), ("code", "python", "x = 1\n\nprint(x)", True),
                           ("prose", "", "After.", True)]


def test_tilde_fences_longer_fences_and_inner_backticks():
    text = "~~~\nraw ``` inside\n~~~\n````md\n```\nnested\n```\n````"
    assert kinds(text) == [("code", "", "raw ``` inside", True), ("code", "md", "```\nnested\n```", True)]


def test_unclosed_fence_is_code_still_streaming():
    assert kinds("Here:\n```js\nlet a") == [("prose", "", "Here:", True), ("code", "js", "let a", False)]
    assert kinds("") == []
    assert kinds("\n\n") == []


def test_view_updates_in_place(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("Hello")
    first = view._widgets[0]
    view.set_markdown("Hello world")
    assert view._widgets[0] is first  # same widget, new text: streaming re-renders only the tail
    view.set_markdown("Hello world\n```py\nx")
    assert len(view.code_blocks()) == 1 and view._widgets[0] is first
    view.set_markdown("Hello world\n```py\nx = 2\n```")
    assert view.code_blocks()[0].code() == "x = 2"
    view.set_markdown("plain")
    assert view.code_blocks() == [] and view.text() == "plain"


def test_long_streaming_answer_flushes_lay_out_only_the_tail(qtbot, monkeypatch):
    """A flush of a growing 10k-character answer sets and lays out at most the last two prose
    chunks, not every chunk: the cost of a flush stays flat as the answer grows.

    Counted, not timed (CI timed 57 ms against a 50 ms bound on a loaded host). Without the
    per-width height cache every chunk is laid out again at each flush (16 here).
    """
    from PySide6.QtWidgets import QApplication, QLabel

    from app.gui.chat_view import ChatView
    from app.gui.main import stylesheet
    from app.gui.markdown_view import ProseLabel

    laid_out: set[int] = set()
    set_text: set[int] = set()
    label_height_for_width, prose_set_text = QLabel.heightForWidth, ProseLabel.setText

    def counting_height_for_width(self, width):
        laid_out.add(id(self))
        return label_height_for_width(self, width)

    def counting_set_text(self, text):
        set_text.add(id(self))
        return prose_set_text(self, text)

    monkeypatch.setattr(QLabel, "heightForWidth", counting_height_for_width)
    monkeypatch.setattr(ProseLabel, "setText", counting_set_text)
    QApplication.instance().setStyleSheet(stylesheet())
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(800, 600)
    view.show()
    msg = view.add_message(1, "assistant", "")
    words = "the quick brown fox jumps over the lazy dog with **bold** and `code` words".split()
    text, most_laid_out, most_set = "", 0, 0
    for i in range(2000):
        text += words[i % len(words)] + (" " if i % 120 else "\n\n")
        if i % 8 == 0:
            laid_out.clear()
            set_text.clear()
            msg.set_text(text)
            QApplication.processEvents()
            most_laid_out, most_set = max(most_laid_out, len(laid_out)), max(most_set, len(set_text))
    assert len(text) > 10_000 and len(msg.body._widgets) > 5
    assert most_set <= 2 and most_laid_out <= 2, (most_set, most_laid_out, len(msg.body._widgets))


def test_a_code_blocks_last_line_is_shown_whole_with_and_without_a_scroll_bar(qtbot):
    """The stylesheet pads the code 4 px above and below; the height left that out, so the
    last line's descenders were cut ("Bingley" in the 800x600 screenshots), and the sideways
    scroll bar sat over them when a line was too wide."""
    from app.gui.main import make_application
    from app.gui.markdown_view import CodeBlock

    make_application()  # the app's style and stylesheet
    code = 'suitors = {"Darcy": "proud, or only shy?",  # first ball\n           "Bingley": "all ease"}'
    for width, bar in ((760, False), (260, True)):
        block = CodeBlock()
        qtbot.addWidget(block)
        block.set_code(code, "python")
        block.resize(width, 300)
        block.show()
        qtbot.waitExposed(block)
        editor = block.editor
        qtbot.waitUntil(lambda: editor.horizontalScrollBar().isVisible() == bar, timeout=3000)
        qtbot.wait(20)
        last = editor.blockBoundingGeometry(editor.document().lastBlock()).translated(editor.contentOffset())
        assert last.bottom() <= editor.viewport().height(), (width, last.bottom(), editor.viewport().height())
