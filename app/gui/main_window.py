"""The main window: sidebar (pages, conversations), the chat or models page, the budgets panel.

It wires the parts together and owns the model lifecycle: which model is active, loading it
in the worker (with progress in the status bar), and the error dialog when that fails.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QByteArray, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (QButtonGroup, QFrame, QHBoxLayout, QLabel, QMainWindow, QProgressBar,
                               QPushButton, QSizePolicy, QSplitter, QStackedWidget, QVBoxLayout)
from shiboken6 import isValid

from app.settings import Settings
from app.storage import Storage

from .budget_panel import BudgetPanel
from .chat_page import ChatPage
from .conversation_list import ConversationList
from .dialogs import WelcomeDialog, show_error
from .worker import EngineClient

log = logging.getLogger(__name__)

NARROW_WIDTH = 1000  # below this the budgets panel folds away so the chat keeps its room


class MainWindow(QMainWindow):
    def __init__(self, storage: Storage, settings: Settings, client: EngineClient | None = None,
                 show_welcome: bool = True):
        super().__init__()
        self.setObjectName("mainWindow")
        self.setWindowTitle("Thermocline")
        self.storage, self.settings = storage, settings
        self.client = client or EngineClient(self)
        self._show_welcome = show_welcome

        # Sidebar: page switcher above the conversation list.
        sidebar = QFrame(self)
        sidebar.setObjectName("sidebarFrame")
        side = QVBoxLayout(sidebar)
        side.setContentsMargins(0, 0, 0, 0)
        side.setSpacing(0)
        brand = QLabel("Thermocline", sidebar)
        brand.setObjectName("brand")
        side.addWidget(brand)
        nav = QHBoxLayout()
        nav.setContentsMargins(10, 0, 10, 0)
        nav.setSpacing(4)
        self.chat_tab = self._nav_button("Chat", "Conversations (Ctrl+1)")
        self.models_tab = self._nav_button("Models", "Download and choose models (Ctrl+2)")
        group = QButtonGroup(self)
        group.setExclusive(True)
        for b in (self.chat_tab, self.models_tab):
            group.addButton(b)
            nav.addWidget(b)
        side.addLayout(nav)
        self.conversations = ConversationList(storage, sidebar)
        side.addWidget(self.conversations, 1)

        # Pages.
        self.chat = ChatPage(storage, settings, self.client, self)
        from .models_page import ModelsPage  # imported here: it pulls in the registry

        self.models = ModelsPage(settings, self.client, self)
        self.pages = QStackedWidget(self)
        self.pages.addWidget(self.chat)
        self.pages.addWidget(self.models)
        self.panel = BudgetPanel(settings, self.client, self)

        self.splitter = QSplitter(Qt.Orientation.Horizontal, self)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)
        self.splitter.addWidget(sidebar)
        self.splitter.addWidget(self.pages)
        self.splitter.addWidget(self.panel)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes([240, 700, 340])
        # The panel may be squeezed to nothing, so the window can shrink below sidebar + chat +
        # panel; resizeEvent then folds it away (NARROW_WIDTH).
        self.splitter.setCollapsible(2, True)
        sidebar.setMinimumWidth(180)
        self.setCentralWidget(self.splitter)

        # Status bar: the model, and loading progress.
        self.model_status = QLabel(self)
        self.model_status.setObjectName("modelStatus")
        self.model_status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.load_bar = QProgressBar(self)
        self.load_bar.setObjectName("loadBar")
        self.load_bar.setRange(0, 1000)
        self.load_bar.setFixedWidth(180)
        self.load_bar.hide()
        self.panel_button = QPushButton("Budgets panel", self)
        self.panel_button.setObjectName("panelToggle")
        self.panel_button.setCheckable(True)
        self.panel_button.setToolTip("Show or hide the budgets and placement panel (Ctrl+B)")
        self.panel_button.toggled.connect(self.set_panel_visible)
        self.statusBar().addWidget(self.model_status, 1)
        self.build_status = QLabel(self)  # CPU or CUDA build of torch, filled once a model loads
        self.build_status.setObjectName("buildStatus")
        self.statusBar().addPermanentWidget(self.build_status)
        self.statusBar().addPermanentWidget(self.load_bar)
        self.statusBar().addPermanentWidget(self.panel_button)
        from .server_panel import install_server_panel

        self.server_panel = install_server_panel(self)

        # Wiring.
        self.chat_tab.clicked.connect(lambda: self.show_page("chat"))
        self.models_tab.clicked.connect(lambda: self.show_page("models"))
        self.conversations.selected.connect(self._open_conversation)
        self.conversations.new_requested.connect(self.new_chat)
        self.conversations.deleted.connect(self.chat.forget)
        self.conversations.renamed.connect(lambda *_: self.chat.refresh_title())
        self.chat.conversations_changed.connect(self.conversations.select)
        self.panel.reload_requested.connect(self.load_active_model)
        self.models.activate_requested.connect(self.switch_model)
        w = self.client.worker
        w.loading.connect(self._on_loading)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        self._actions()

        # Restore state.
        if settings["ui.geometry"]:
            self.restoreGeometry(QByteArray.fromBase64(settings["ui.geometry"].encode()))
        else:
            self.resize(1280, 800)
        if settings["ui.splitter"]:
            self.splitter.restoreState(QByteArray.fromBase64(settings["ui.splitter"].encode()))
        self.panel_button.setChecked(settings["ui.show_panel"])
        self.set_panel_visible(settings["ui.show_panel"])
        recovered = storage.recover_interrupted()
        if recovered:
            log.info("marked %d answers interrupted by the last exit", recovered)
        last = settings["ui.last_conversation"]
        if last is not None and storage.conversation(last) is None:
            last = None
        self.conversations.refresh(last)
        self.chat.open_conversation(last)
        self.show_page("chat")

    def _nav_button(self, text: str, tip: str) -> QPushButton:
        b = QPushButton(text, self)
        b.setObjectName("navButton")
        b.setCheckable(True)
        b.setToolTip(tip)
        b.setCursor(Qt.CursorShape.PointingHandCursor)
        return b

    def _actions(self) -> None:
        def add(shortcut, slot):
            act = QAction(self)
            act.setShortcut(QKeySequence(shortcut))
            act.triggered.connect(slot)
            self.addAction(act)

        add("Ctrl+N", self.new_chat)
        add("Ctrl+1", lambda: self.show_page("chat"))
        add("Ctrl+2", lambda: self.show_page("models"))
        add("Ctrl+B", lambda: self.panel_button.toggle())
        add("Ctrl+F", lambda: (self.show_page("chat"), self.conversations.search.setFocus()))

    # -- start-up ------------------------------------------------------------------------
    def start(self) -> None:
        """Load the active model and, on first start, explain the sliders."""
        self.load_active_model()
        if self._show_welcome and not self.settings["ui.welcome_shown"]:
            QTimer.singleShot(300, self, self.show_welcome)

    def show_welcome(self) -> None:
        dlg = WelcomeDialog(self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.finished.connect(lambda _r: self.settings.set("ui.welcome_shown", True))
        dlg.open()
        self.welcome = dlg

    # -- pages ---------------------------------------------------------------------------
    def show_page(self, name: str) -> None:
        page = self.chat if name == "chat" else self.models
        self.pages.setCurrentWidget(page)
        self.chat_tab.setChecked(name == "chat")
        self.models_tab.setChecked(name != "chat")
        self.conversations.setEnabled(True)
        if name == "models":
            self.models.refresh()

    def set_panel_visible(self, visible: bool) -> None:
        """The user's choice; a narrow window still folds the panel away (see resizeEvent)."""
        if self.panel_button.isChecked() != visible:
            self.panel_button.setChecked(visible)
        self.settings["ui.show_panel"] = visible
        self._fit_panel()

    def _fit_panel(self) -> None:
        wanted = self.settings["ui.show_panel"]
        narrow = self.width() < NARROW_WIDTH
        self.panel.setVisible(wanted and not narrow)
        self.panel_button.setToolTip(
            "The window is too narrow for the panel; widen it to show the budgets" if wanted and narrow
            else "Show or hide the budgets and placement panel (Ctrl+B)")

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._fit_panel()

    def new_chat(self) -> None:
        self.show_page("chat")
        self.conversations.list.clearSelection()
        self.conversations.list.setCurrentItem(None)
        self.chat.new_conversation()

    def _open_conversation(self, conversation_id: int) -> None:
        self.show_page("chat")
        self.chat.open_conversation(conversation_id)

    # -- models --------------------------------------------------------------------------
    def load_active_model(self) -> None:
        """Probe the suggested budgets for the model (a moment, off the GUI thread), then load it."""
        from . import formatting as fmt

        spec, ctx = self.settings["model.active"], self.settings["engine.ctx"]
        self.client.stop()  # the answer in progress ends before the switch
        self.client.model_info = None
        self.client.loading_model = spec
        self.model_status.setText(f"Loading {fmt.model_label(spec)}…")
        self.load_bar.setValue(0)
        self.load_bar.show()
        self.chat._sync_ready()
        self.panel.probe_then(spec, ctx, lambda: self._load(spec))

    def _load(self, spec: str) -> None:
        if spec != self.settings["model.active"]:
            return  # another switch came in meanwhile; its own probe will load it
        vram, ram = self.panel.budgets_for_load()
        self.client.load(spec, mode=self.settings["engine.mode"], ctx=self.panel.ctx_for_load(),
                         vram_budget=vram, ram_budget=ram, cpu_weights=self.settings["engine.cpu_weights"])

    def switch_model(self, spec: str) -> None:
        """Make `spec` the active model; the conversation stays open."""
        self.settings["model.active"] = spec
        self.load_active_model()
        self.show_page("chat")

    def _refresh_models_if_shown(self) -> None:
        if self.pages.currentWidget() is self.models:
            self.models.refresh()

    @Slot(float, str)
    def _on_loading(self, fraction: float, text: str) -> None:
        self.load_bar.show()
        self.load_bar.setValue(int(max(0.0, min(1.0, fraction)) * 1000))
        if text:
            self.model_status.setText(text)

    @Slot(dict)
    def _on_loaded(self, info: dict) -> None:
        self.load_bar.hide()
        mem = info.get("memory") or {}
        from . import formatting as fmt

        self.model_status.setText(f"Model: {fmt.model_label(info.get('model'))} · {info.get('mode')} mode · context "
                                  f"{info.get('ctx'):,} tokens · {fmt.device_name(mem.get('device'))}")
        build = info.get("build") or {}
        if build.get("summary"):  # which torch this is: CPU or CUDA build, and what to install for a GPU
            self.model_status.setToolTip(build["summary"])
            self.build_status.setText(build.get("flavour", "").upper() + " build")
            self.build_status.setToolTip(build["summary"])
        self._refresh_models_if_shown()

    @Slot(str, str)
    def _on_load_failed(self, what: str, todo: str) -> None:
        self.load_bar.hide()
        self.model_status.setText("No model loaded")
        self.chat._sync_ready()
        self._refresh_models_if_shown()
        welcome = getattr(self, "welcome", None)
        if welcome is not None and isValid(welcome) and welcome.isVisible():
            # First start: read the welcome first, then the problem.
            welcome.finished.connect(lambda _r: self._show_load_error(what, todo))
        else:
            self._show_load_error(what, todo)

    def _show_load_error(self, what: str, todo: str) -> None:
        self.last_error = show_error(self, "Could not load the model", what, todo)

    # -- shutdown ------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt API
        self.settings["ui.geometry"] = bytes(self.saveGeometry().toBase64()).decode()
        self.settings["ui.splitter"] = bytes(self.splitter.saveState().toBase64()).decode()
        self.chat.close_out()
        self.server_panel.shutdown()
        self.models.shutdown()
        self.engine_stopped = self.client.shutdown()
        super().closeEvent(event)
