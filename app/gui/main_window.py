"""The main window: sidebar (pages, conversations), the chat or models page, the budgets panel.

It wires the parts together and owns the model lifecycle: which model is active, loading it
in the worker (with progress in the status bar), and the error dialog when that fails.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QByteArray, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (QApplication, QButtonGroup, QFileDialog, QFrame, QHBoxLayout, QLabel, QMainWindow,
                               QProgressBar, QPushButton, QSizePolicy, QSplitter, QStackedWidget, QVBoxLayout)
from shiboken6 import isValid

from app.settings import Settings
from app.storage import Storage

from .budget_panel import BudgetPanel
from .chat_page import ChatPage
from .conversation_list import ConversationList
from . import export, theme
from .dialogs import AboutDialog, WelcomeDialog, show_error
from .preferences import open_preferences
from .worker import EngineClient

log = logging.getLogger(__name__)

NARROW_WIDTH = 1000  # below this the panel and the sidebar share the room: one of them folds away
PANEL_WIDTH = 320
SIDEBAR_WIDTH = 240
MIN_CHAT_WIDTH = 420  # narrower than this, a chat is hard to read


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
        self.sidebar = sidebar = QFrame(self)
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
        self.splitter.setSizes([SIDEBAR_WIDTH, 700, PANEL_WIDTH])
        # The panel and the sidebar may be folded away, so the window can shrink below sidebar +
        # chat + panel; _fit_side_parts decides which (see NARROW_WIDTH).
        self.splitter.setCollapsible(0, True)
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
        from .kernel_status import install_kernel_status

        self.kernel_status = install_kernel_status(self)

        # Wiring.
        self.chat_tab.clicked.connect(lambda: self.show_page("chat"))
        self.models_tab.clicked.connect(lambda: self.show_page("models"))
        self.conversations.selected.connect(self._open_conversation)
        self.conversations.new_requested.connect(self.new_chat)
        self.conversations.deleted.connect(self.chat.forget)
        self.conversations.renamed.connect(lambda *_: self.chat.refresh_title())
        self.conversations.export_requested.connect(self.export_conversation)
        self.chat.export_requested.connect(self.export_conversation)
        self.chat.models_page_requested.connect(lambda: self.show_page("models"))
        self.chat.sidebar_toggle_requested.connect(lambda: self.set_sidebar_visible(not self.sidebar_shown()))
        self.chat.conversations_changed.connect(self.conversations.select)
        self.panel.reload_requested.connect(self.load_active_model)
        self.models.activate_requested.connect(self.switch_model)
        self.models.reload_requested.connect(self.load_active_model)
        w = self.client
        w.loading.connect(self._on_loading)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        self._actions()

        # Restore state.
        if settings["ui.geometry"]:
            self.restoreGeometry(QByteArray.fromBase64(settings["ui.geometry"].encode()))
        else:
            self.resize(1280, 800)
        self._fit_screen()
        if settings["ui.splitter"]:
            self.splitter.restoreState(QByteArray.fromBase64(settings["ui.splitter"].encode()))
        self.apply_appearance()
        self._fit_side_parts()
        recovered = storage.recover_interrupted()
        if recovered:
            log.info("marked %d answers interrupted by the last exit", recovered)
        last = settings["ui.last_conversation"]
        if last is not None and storage.conversation(last) is None:
            last = None
        self.conversations.refresh(last)
        self.chat.open_conversation(last)
        self.show_page("chat")

    def _fit_screen(self) -> None:
        """Never larger than the screen: a first start (1280x800) or a geometry saved on a
        bigger monitor would put the input box and the conversation's right edge out of sight."""
        screen = self.screen() or QApplication.primaryScreen()
        if screen is None:
            return
        room = screen.availableGeometry()
        frame = self.frameGeometry().size() - self.geometry().size()  # the title bar and borders
        width = min(self.width(), room.width() - frame.width())
        height = min(self.height(), room.height() - frame.height())
        if (width, height) != (self.width(), self.height()):
            self.resize(max(width, self.minimumSizeHint().width()), max(height, 200))
            self.move(room.topLeft())

    def _nav_button(self, text: str, tip: str) -> QPushButton:
        b = QPushButton(text, self)
        b.setObjectName("navButton")
        b.setCheckable(True)
        b.setToolTip(tip)
        b.setCursor(Qt.CursorShape.PointingHandCursor)
        return b

    def _actions(self) -> None:
        """The menu bar: the usual desktop places for every command, with their shortcuts."""
        def add(menu, text, shortcut, slot, tip="", everywhere=False):
            act = QAction(text, self)
            if shortcut:
                act.setShortcut(QKeySequence(shortcut))
            if everywhere:  # also from the app's other windows (the welcome, a dialog left open)
                act.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
            if tip:
                act.setStatusTip(tip)
            act.triggered.connect(slot)
            if menu is not None:
                menu.addAction(act)
            self.addAction(act)  # the shortcut works while the menu is closed (and for unlisted keys)
            return act

        bar = self.menuBar()
        file = bar.addMenu("&File")
        add(file, "&New chat", "Ctrl+N", self.new_chat, everywhere=True)
        export = file.addMenu("&Export conversation")
        self.export_md_action = add(export, "As &Markdown…", "Ctrl+Shift+E", lambda: self._export_open("md"))
        self.export_json_action = add(export, "As &JSON…", "", lambda: self._export_open("json"))
        file.addSeparator()
        add(file, "&Preferences…", "Ctrl+,", self.show_preferences)
        file.addSeparator()
        add(file, "&Quit", "Ctrl+Q", self.close, everywhere=True)
        view = bar.addMenu("&View")
        add(view, "&Chat", "Ctrl+1", lambda: self.show_page("chat"))
        add(view, "&Models", "Ctrl+2", lambda: self.show_page("models"))
        view.addSeparator()
        add(view, "Conversation &list", "Ctrl+Shift+L", lambda: self.set_sidebar_visible(not self.sidebar_shown()))
        add(view, "&Budgets panel", "Ctrl+B", lambda: self.panel_button.toggle())
        view.addAction(self.server_panel.toggle_action)
        add(view, "&Search conversations", "Ctrl+F",
            lambda: (self.show_page("chat"), self.set_sidebar_visible(True), self.conversations.search.setFocus()))
        view.addSeparator()
        add(view, "&Dark theme", "", lambda: self._set_theme("light" if self.dark() else "dark"))
        add(view, "&Larger text", "Ctrl++", lambda: self._step_font(+1))
        add(None, "Larger text", "Ctrl+=", lambda: self._step_font(+1))  # Ctrl++ without Shift
        add(view, "S&maller text", "Ctrl+-", lambda: self._step_font(-1))
        add(view, "&Normal text size", "Ctrl+0", lambda: self.settings.set("ui.font_size", 0) and None)
        helpm = bar.addMenu("&Help")
        add(helpm, "&Welcome and the sliders", "F1", self.show_welcome)
        add(helpm, "&Keyboard shortcuts", "Ctrl+/", self.show_shortcuts)
        add(helpm, "&About Thermocline", "", self.show_about)
        self._unsubscribe = self.settings.on_change(self._setting_changed)

    # -- appearance ----------------------------------------------------------------------
    def dark(self) -> bool:
        return theme.resolve(self.settings["ui.theme"]) == "dark"

    def apply_appearance(self) -> None:
        app = QApplication.instance()
        if app is not None:
            theme.apply(app, self.settings["ui.theme"], self.settings["ui.font_size"])
        self.chat.set_dark(self.dark())
        # Sizes follow the text: once the new fonts have laid out, give the panel the width
        # its contents now need (they were cut off until a restart).
        QTimer.singleShot(0, self, lambda: self._fit_side_parts(refit=True))

    def _set_theme(self, name: str) -> None:
        self.settings["ui.theme"] = name

    def _step_font(self, step: int) -> None:
        current = self.settings["ui.font_size"] or round(QApplication.font().pointSizeF() or theme.BASE_POINT_SIZE)
        opt = self.settings.option("ui.font_size")
        self.settings["ui.font_size"] = int(max(opt.minimum, min(opt.maximum, current + step)))

    def _setting_changed(self, name: str, _value) -> None:
        if name in ("ui.theme", "ui.font_size"):
            self.apply_appearance()

    def show_preferences(self):
        def applied(names: list) -> None:
            if any(n in names for n in ("model.active", "engine.mode")):
                self.panel._select_mode(self.settings["engine.mode"])
                self.load_active_model()
            if "chat.context_policy" in names:
                self.chat.refresh_context()

        self.preferences = open_preferences(self.settings, self, applied)
        return self.preferences

    def show_shortcuts(self):
        from .shortcuts import ShortcutsDialog

        dlg = ShortcutsDialog(self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.open()
        self.shortcuts_dialog = dlg
        return dlg

    def show_about(self) -> AboutDialog:
        dlg = AboutDialog(self.client.model_info, self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.open()
        self.about = dlg
        return dlg

    # -- export --------------------------------------------------------------------------
    def _export_open(self, kind: str) -> None:
        conv = self.chat.conversation
        if conv is None:
            self.statusBar().showMessage("Nothing to export yet: this chat has no messages.", 4000)
            return
        self.export_conversation(conv.id, kind)

    def export_conversation(self, conversation_id: int, kind: str, path: str | None = None):
        """Save a conversation as Markdown or JSON; asks where (non-blocking) unless `path` is given."""
        conv = self.storage.conversation(conversation_id)
        if conv is None:
            return None
        if path is not None:
            self._write_export(conversation_id, kind, path)
            return None
        ext = "md" if kind == "md" else "json"
        dlg = QFileDialog(self, "Export conversation")
        dlg.setObjectName("exportDialog")
        dlg.setAcceptMode(QFileDialog.AcceptMode.AcceptSave)
        dlg.setOption(QFileDialog.Option.DontUseNativeDialog, True)  # the same on every desktop, and testable
        dlg.setNameFilter("Markdown (*.md)" if ext == "md" else "JSON (*.json)")
        dlg.setDefaultSuffix(ext)
        dlg.selectFile(export.file_name(conv.title, ext))
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        dlg.fileSelected.connect(lambda chosen: self._write_export(conversation_id, kind, chosen))
        dlg.open()
        self.export_dialog = dlg
        return dlg

    def _write_export(self, conversation_id: int, kind: str, path: str) -> None:
        conv = self.storage.conversation(conversation_id)
        if conv is None:
            return
        messages = self.storage.messages(conversation_id)
        text = export.to_markdown(conv, messages) if kind == "md" else export.to_json(conv, messages)
        try:
            from pathlib import Path

            target = Path(path)
            tmp = target.with_name(target.name + ".part")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
        except OSError as exc:
            self.last_error = show_error(self, "Could not export", f"Could not write {path}: {exc.strerror or exc}",
                                         "Choose another folder, one you can write to.")
            return
        self.statusBar().showMessage(f"Saved “{conv.title}” to {path}", 6000)

    # -- start-up ------------------------------------------------------------------------
    def start(self) -> None:
        """Load the active model and, on first start, explain the sliders."""
        self.load_active_model()
        if self._show_welcome and not self.settings["ui.welcome_shown"]:
            QTimer.singleShot(300, self, self.show_welcome)

    def show_welcome(self) -> None:
        dlg = WelcomeDialog(self)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)

        def finished(result: int) -> None:
            self.settings.set("ui.welcome_shown", True)
            if result == WelcomeDialog.get_model:
                self.get_recommended_model()
            else:
                self.focus_prompt()  # what the user types next goes to the chat

        dlg.finished.connect(finished)
        dlg.typed.connect(self._typed_on_welcome)
        # Not modal: the window's keys (Ctrl+N, Ctrl+Q) and the prompt box work while it is open.
        dlg.setModal(False)
        dlg.show()
        self.welcome = dlg

        def recommended() -> None:  # the Models page's choice for this machine, once it has looked
            if isValid(dlg) and self.models.recommended:
                dlg.set_recommended(self.models.recommended, self.models.rows.get(self.models.recommended, {}))

        self.models.when_scanned(recommended)

    def _typed_on_welcome(self, event) -> None:
        """Typing on the welcome: the user wants to chat. It closes; the keys go to the prompt box."""
        welcome = getattr(self, "welcome", None)
        if welcome is not None and isValid(welcome) and welcome.isVisible():
            welcome.accept()
        self.forward_typing(event)

    def get_recommended_model(self) -> None:
        """Start downloading the chat model recommended for this machine (the Models page's
        choice, the one the welcome names) and show it on the Models page."""
        self.show_page("models")

        def download() -> None:
            if self.models.recommended:
                self.models.start_download(self.models.recommended)

        self.models.when_scanned(download)

    # -- pages ---------------------------------------------------------------------------
    def show_page(self, name: str) -> None:
        page = self.chat if name == "chat" else self.models
        for other in (self.chat, self.models):
            # A hidden page's minimum width must not hold the shown one (the Models page's header
            # kept the chat from giving the panel room at 800 px).
            ignored = QSizePolicy.Policy.Ignored
            other.setSizePolicy(*(QSizePolicy.Policy.Preferred,) * 2 if other is page else (ignored, ignored))
        self.pages.setCurrentWidget(page)
        self.chat_tab.setChecked(name == "chat")
        self.models_tab.setChecked(name != "chat")
        self.conversations.setEnabled(True)
        if name == "models":
            self.models.refresh()

    def set_panel_visible(self, visible: bool) -> None:
        """The user's choice; in a narrow window the sidebar folds away to make room."""
        self.settings["ui.show_panel"] = visible
        self._narrow_choice = "panel" if visible else "sidebar"
        self._fit_side_parts()

    def sidebar_shown(self) -> bool:
        return not self.sidebar.isHidden()

    def set_sidebar_visible(self, visible: bool) -> None:
        self.settings["ui.show_sidebar"] = visible
        self._narrow_choice = "sidebar" if visible else "panel"
        self._fit_side_parts()

    def panel_width_needed(self) -> int:
        """The panel's width at which nothing in it is cut off (grows with the text size)."""
        inner = self.panel.widget()
        return (inner.minimumSizeHint().width() + self.panel.choices_extra_width()
                + self.panel.verticalScrollBar().sizeHint().width() + 2)

    def _fit_side_parts(self, refit: bool = False) -> None:
        """Show what the user asked for; when the chat would get too narrow for both the sidebar
        and the panel, keep the one asked for last (the other folds away, its toggle says why)."""
        want_panel, want_side = self.settings["ui.show_panel"], self.settings["ui.show_sidebar"]
        width = self.width()
        room = width - MIN_CHAT_WIDTH
        show_panel, show_side = want_panel, want_side
        if want_panel and want_side and room < PANEL_WIDTH + SIDEBAR_WIDTH:
            if getattr(self, "_narrow_choice", "sidebar") == "panel":
                show_side = False
            else:
                show_panel = False
        if show_panel and room < PANEL_WIDTH - 80:
            show_panel = False  # not even the panel alone fits: the button says so
        was = (not self.panel.isHidden(), not self.sidebar.isHidden())
        self.panel.setVisible(show_panel)
        self.sidebar.setVisible(show_side)
        need = self.panel_width_needed() if show_panel else 0
        if was != (show_panel, show_side) or (refit and show_panel) or (show_panel and self.panel.width() < need):
            side = min(SIDEBAR_WIDTH, max(180, width // 5)) if show_side else 0
            panel = min(max(PANEL_WIDTH, need), max(240, room - side)) if show_panel else 0
            self.splitter.setSizes([side, max(100, width - side - panel), panel])
        # The button shows what is on screen, so a click always changes something visible.
        self.panel_button.blockSignals(True)
        self.panel_button.setChecked(show_panel)
        self.panel_button.blockSignals(False)
        self.panel_button.setToolTip(
            "The window is too narrow for the panel; widen it to show the budgets" if room < PANEL_WIDTH - 80
            else "Show or hide the budgets and placement panel (Ctrl+B)")
        self.chat.set_sidebar_hidden(not show_side)

    def _fit_panel(self) -> None:  # kept for callers of the old name
        self._fit_side_parts()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._fit_side_parts()

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt API
        """Typing that reaches the window itself (no widget had the focus yet: the keys came
        while it was being brought forward) goes to the prompt box, not nowhere."""
        if self.forward_typing(event):
            return
        super().keyPressEvent(event)

    def forward_typing(self, event) -> bool:
        from PySide6.QtGui import QKeyEvent

        text = event.text()
        typing = (text and text.isprintable()) or event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter,
                                                                  Qt.Key.Key_Backspace)
        plain = not event.modifiers() & ~(Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.KeypadModifier)
        if not typing or not plain or self.pages.currentWidget() is not self.chat:
            return False
        edit = self.chat.input.edit
        edit.setFocus()
        QApplication.sendEvent(edit, QKeyEvent(event.type(), event.key(), event.modifiers(), text))
        return True

    def focus_prompt(self) -> None:
        """The window in front, the typing cursor in the prompt box (also where no window
        manager hands the focus back after a dialog, as under a bare Xvfb)."""
        self.raise_()
        self.activateWindow()
        self.chat.input.edit.setFocus()

    def new_chat(self) -> None:
        welcome = getattr(self, "welcome", None)
        if welcome is not None and isValid(welcome) and welcome.isVisible():
            welcome.accept()  # Ctrl+N on the welcome: the user has chosen to chat
        self.show_page("chat")
        self.conversations.list.clearSelection()
        self.conversations.list.setCurrentItem(None)
        self.chat.new_conversation()
        self.focus_prompt()

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
                         vram_budget=vram, ram_budget=ram, cpu_weights=self.settings.cpu_weights_for(spec))

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
        log.info("model ready: %s, %s mode, context %s tokens", info.get("model"), info.get("mode"), info.get("ctx"))
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
        unsubscribe = getattr(self, "_unsubscribe", None)
        if unsubscribe is not None:
            unsubscribe()
        self.chat.close_out()
        self.server_panel.shutdown()
        self.models.shutdown()
        self.engine_stopped = self.client.shutdown()
        super().closeEvent(event)
