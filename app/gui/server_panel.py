"""The window's "Local server": the loaded model over the OpenAI API, for editors and agents.

A switch starts or stops the server (uvicorn on its own thread, `app.server.runner`); host
and port are settings, the key is typed per session (and never written to a file or log).
The URL can be copied; each request adds one line to the log. Generations run on the
server's gate thread through the same engine the window uses (its lock keeps one generation
at a time), so the budget sliders keep re-placing neurons while the server answers: the
engine applies a new placement at the next token.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QDockWidget, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from .dialogs import show_error

log = logging.getLogger(__name__)

LOG_LINES = 500


class LocalServerPanel(QWidget):
    request_logged = Signal(str)  # emitted from the server's thread; queued to the GUI thread

    def __init__(self, settings, client, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("localServerPanel")
        self.settings, self.client = settings, client
        self.server = None
        layout = QVBoxLayout(self)
        self.switch = QCheckBox("Local server: serve the loaded model over the OpenAI API", self)
        self.switch.setObjectName("serverSwitch")
        self.switch.toggled.connect(self._toggled)
        layout.addWidget(self.switch)
        form = QFormLayout()
        self.host = QLineEdit(settings["server.host"], self)
        self.host.setToolTip("127.0.0.1 keeps it on this computer; any other address needs an API key")
        self.port = QSpinBox(self)
        self.port.setRange(0, 65535)
        self.port.setValue(settings["server.port"])
        self.port.setToolTip("0 picks a free port")
        self.key = QLineEdit(self)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional on 127.0.0.1; kept for this session only")
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        self.origins = QLineEdit(", ".join(settings["server.allowed_origins"]), self)
        self.origins.setObjectName("serverOrigins")
        self.origins.setPlaceholderText("none: web pages cannot call the server")
        self.origins.setToolTip("Origins of web pages (scheme://host:port, comma-separated, or *) whose "
                                "scripts may call the server; requests from any other page are refused")
        form.addRow("API key", self.key)
        form.addRow("Web pages allowed", self.origins)
        layout.addLayout(form)
        self.access = QLabel(self)
        self.access.setObjectName("serverAccess")
        self.access.setWordWrap(True)
        layout.addWidget(self.access)
        row = QHBoxLayout()
        self.url = QLineEdit(self)
        self.url.setObjectName("serverUrl")
        self.url.setReadOnly(True)
        self.url.setPlaceholderText("off")
        self.copy_button = QPushButton("Copy URL", self)
        self.copy_button.clicked.connect(self.copy_url)
        row.addWidget(self.url, 1)
        row.addWidget(self.copy_button)
        layout.addLayout(row)
        self.log_view = QPlainTextEdit(self)
        self.log_view.setObjectName("serverLog")
        self.log_view.setReadOnly(True)
        self.log_view.setMaximumBlockCount(LOG_LINES)
        self.log_view.setPlaceholderText("One line per request appears here.")
        layout.addWidget(self.log_view, 1)
        self.request_logged.connect(self.log_view.appendPlainText, Qt.ConnectionType.QueuedConnection)
        self._sync()

    # -- the engine, as the server sees it (called on the server's threads) --------------
    def _engine(self):
        return self.client.engine

    def _model_id(self) -> str | None:
        return self.client.model_spec

    # -- switching -----------------------------------------------------------------------
    def _toggled(self, on: bool) -> None:
        if on:
            self.start()
        else:
            self.stop()

    def start(self) -> bool:
        from engine.errors import UserError

        from app.server.guard import check_origins
        from app.server.runner import ServerThread

        if self.server is not None:
            return True
        host = self.host.text().strip() or "127.0.0.1"
        try:
            origins = check_origins(o for o in self.origins.text().split(",") if o.strip())
            server = ServerThread(self._engine, self._model_id, host=host, port=self.port.value(),
                                  api_key=self.key.text() or None, on_request=self.request_logged.emit,
                                  allowed_origins=tuple(origins))
            server.start()
        except UserError as exc:
            show_error(self.window(), "Could not start the local server", str(exc),
                       "Listen on 127.0.0.1, set an API key, or choose another port.")
            self.switch.blockSignals(True)
            self.switch.setChecked(False)
            self.switch.blockSignals(False)
            self._sync()
            return False
        self.server = server
        self.settings["server.host"] = host
        self.settings["server.allowed_origins"] = origins
        if self.port.value():
            self.settings["server.port"] = self.port.value()
        self.request_logged.emit(f"listening at {server.url}" + (" (API key required)" if self.key.text() else ""))
        self._sync()
        return True

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
            self.log_view.appendPlainText("stopped")
        if self.switch.isChecked():
            self.switch.blockSignals(True)
            self.switch.setChecked(False)
            self.switch.blockSignals(False)
        self._sync()

    def _sync(self) -> None:
        running = self.server is not None
        for w in (self.host, self.port, self.key, self.origins):
            w.setEnabled(not running)
        origins = [o.strip() for o in self.origins.text().split(",") if o.strip()]
        self.access.setText(
            "Programs on this computer can call it"
            + ("" if self.host.text().strip() in ("", "127.0.0.1", "localhost", "::1") else ", other machines with the key")
            + ". Web pages in a browser cannot, "
            + (f"except {', '.join(origins)}." if origins else "and none are allowed (add one above)."))
        self.url.setText(self.server.url if running else "")
        self.copy_button.setEnabled(running)

    def copy_url(self) -> None:
        if self.url.text():
            QGuiApplication.clipboard().setText(self.url.text())

    def shutdown(self) -> None:
        self.stop()


def install_server_panel(window) -> LocalServerPanel:
    """Add the panel to the window as a dock, shown and hidden by `toggle_action` (View menu).
    A menu entry, not a status bar button: the status bar must still fit an 800 px window."""
    panel = LocalServerPanel(window.settings, window.client, window)
    dock = QDockWidget("Local server", window)
    dock.setObjectName("localServerDock")
    dock.setWidget(panel)
    window.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, dock)
    dock.hide()
    action = dock.toggleViewAction()  # checkable, kept in step with the dock by Qt
    action.setText("Local &server")
    action.setToolTip("Serve the loaded model to other programs over the OpenAI API")
    panel.dock, panel.toggle_action = dock, action
    return panel
