"""Help → Keyboard shortcuts: every shortcut of the window in one list, read from where each
is declared (the menus' actions, the pages' QShortcuts, the keys the prompt box handles
itself), so the list cannot fall behind the keys."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHeaderView, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from . import input_box


def _words(text: str) -> str:
    return text.replace("&&", "\0").replace("&", "").replace("\0", "&").rstrip("…").strip()


def declared_shortcuts(window: QWidget) -> list[tuple[str, str]]:
    """(keys, what they do) for every shortcut the window declares, in menu order first."""
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(seq: QKeySequence, what: str) -> None:
        keys = seq.toString(QKeySequence.SequenceFormat.NativeText)
        if keys and keys not in seen and what:
            seen.add(keys)
            rows.append((keys, what))

    for act in window.findChildren(QAction):
        for seq in act.shortcuts():
            add(seq, _words(act.text()))
    for sc in window.findChildren(QShortcut):
        add(sc.key(), sc.whatsThis())
    for keys, what in input_box.KEYS:
        rows.append((keys, what))
    return rows


class ShortcutsDialog(QDialog):
    def __init__(self, window: QWidget):
        super().__init__(window)
        self.setObjectName("shortcutsDialog")
        self.setWindowTitle("Keyboard shortcuts")
        layout = QVBoxLayout(self)
        rows = declared_shortcuts(window)
        self.table = QTableWidget(len(rows), 2, self)
        self.table.setHorizontalHeaderLabels(["Keys", "Does"])
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        for i, (keys, what) in enumerate(rows):
            self.table.setItem(i, 0, QTableWidgetItem(keys))
            self.table.setItem(i, 1, QTableWidgetItem(what))
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        layout.addWidget(self.table)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, self)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.resize(440, min(520, 80 + 28 * len(rows)))

    def rows(self) -> list[tuple[str, str]]:
        return [(self.table.item(i, 0).text(), self.table.item(i, 1).text()) for i in range(self.table.rowCount())]
