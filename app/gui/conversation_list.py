"""The sidebar: New chat, search, and the conversations (rename, delete from the menu)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QMessageBox, QPushButton, QVBoxLayout, QWidget)

from app.gui.dialogs import show_error
from app.storage import WRITE_ERRORS, Storage

ID_ROLE = Qt.ItemDataRole.UserRole


class ConversationList(QFrame):
    selected = Signal(int)          # a conversation was chosen
    new_requested = Signal()
    deleted = Signal(int)
    renamed = Signal(int, str)
    export_requested = Signal(int, str)  # conversation id, "md" or "json"

    def __init__(self, storage: Storage, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("sidebar")
        self.storage = storage
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 10, 10, 10)
        layout.setSpacing(8)
        self.new_button = QPushButton("+  New chat", self)
        self.new_button.setObjectName("newChat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit(self)
        self.search.setObjectName("search")
        self.search.setPlaceholderText("Search conversations")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)
        self.list = QListWidget(self)
        self.list.setObjectName("conversations")
        self.list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed
                                  | QAbstractItemView.EditTrigger.DoubleClicked)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemChanged.connect(self._item_changed)
        layout.addWidget(self.list, 1)
        self.empty = QPushButton("No conversations match", self)
        self.empty.setObjectName("emptySearch")
        self.empty.setFlat(True)
        self.empty.setEnabled(False)
        self.empty.hide()
        layout.addWidget(self.empty)
        # Search as you type, without a database query per keystroke.
        self._debounce = QTimer(self, singleShot=True, interval=150)
        self._debounce.timeout.connect(lambda: self.refresh(self.current_id()))
        self.search.textChanged.connect(lambda _t: self._debounce.start())
        self._filling = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(ID_ROLE) if item else None

    def refresh(self, select_id: int | None = None) -> None:
        """Reload from the database, keeping (or setting) the selection without re-emitting it."""
        self._filling = True
        try:
            self.list.clear()
            query = self.search.text()
            for conv in self.storage.conversations(query):
                item = QListWidgetItem(conv.title)
                item.setData(ID_ROLE, conv.id)
                item.setToolTip(conv.title)
                item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
                self.list.addItem(item)
                if conv.id == select_id:
                    self.list.setCurrentItem(item)
            self.empty.setVisible(self.list.count() == 0 and bool(query.strip()))
        finally:
            self._filling = False

    def select(self, conversation_id: int | None) -> None:
        self.refresh(conversation_id)

    def rename(self, conversation_id: int) -> None:
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(ID_ROLE) == conversation_id:
                self.list.editItem(item)

    def confirm_delete(self, conversation_id: int) -> QMessageBox | None:
        """Ask before deleting (window-modal, not blocking); returns the question box."""
        conv = self.storage.conversation(conversation_id)
        if conv is None:
            return None
        box = QMessageBox(QMessageBox.Icon.Question, "Delete conversation",
                          f"Delete “{conv.title}” and all its messages? This cannot be undone.",
                          QMessageBox.StandardButton.NoButton, self)
        box.setObjectName("confirmDelete")
        # QMessageBox has no standard Delete button: a destructive-role button of our own.
        delete = box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole)
        cancel = box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(cancel)
        box.setEscapeButton(cancel)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        box.setWindowModality(Qt.WindowModality.WindowModal)

        def done() -> None:
            if box.clickedButton() is delete:
                self.delete(conversation_id)

        box.finished.connect(lambda _r: done())
        box.open()
        self.delete_box = box
        return box

    def delete(self, conversation_id: int) -> None:
        try:
            self.storage.delete_conversation(conversation_id)
        except WRITE_ERRORS as exc:  # a full disk: the conversation stays, and the user is told
            self._write_failed("Could not delete the conversation", exc,
                               "It is still there. Free some disk space, then delete it again.")
            return
        self.refresh(None)
        self.deleted.emit(conversation_id)

    def menu_for(self, conversation_id: int) -> QMenu:
        """The right-click menu of one conversation (built apart from showing it, for tests)."""
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.rename(conversation_id))
        export = menu.addMenu("Export")
        export.addAction("As Markdown…", lambda: self.export_requested.emit(conversation_id, "md"))
        export.addAction("As JSON…", lambda: self.export_requested.emit(conversation_id, "json"))
        menu.addSeparator()
        menu.addAction("Delete…", lambda: self.confirm_delete(conversation_id))
        return menu

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        menu = self.menu_for(item.data(ID_ROLE))
        menu.exec(self.list.viewport().mapToGlobal(pos))
        menu.deleteLater()

    def _current_changed(self, current: QListWidgetItem | None, _previous) -> None:
        if current is not None and not self._filling:
            self.selected.emit(current.data(ID_ROLE))

    def _item_changed(self, item: QListWidgetItem) -> None:
        if self._filling:
            return
        cid = item.data(ID_ROLE)
        title = " ".join(item.text().split())
        if not title:
            conv = self.storage.conversation(cid)
            self._filling = True
            item.setText(conv.title if conv else "Untitled")
            self._filling = False
            return
        try:
            self.storage.rename_conversation(cid, title)
        except WRITE_ERRORS as exc:  # the old title comes back: the list shows what is saved
            conv = self.storage.conversation(cid)
            self._filling = True
            item.setText(conv.title if conv else "Untitled")
            self._filling = False
            self._write_failed("Could not rename the conversation", exc,
                               "Free some disk space, then rename it again.")
            return
        self.renamed.emit(cid, title)

    def _write_failed(self, title: str, exc: BaseException, todo: str) -> None:
        self.write_error = show_error(self.window(), title, f"Writing to {self.storage.path} failed: {exc}", todo)
