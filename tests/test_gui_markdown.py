"""Splitting Markdown into prose and code segments, and the in-place message body."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.gui.markdown_view import MarkdownView, split_markdown  # noqa: E402


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
