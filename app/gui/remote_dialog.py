"""“Add remote…”: a model served by another machine over the OpenAI API, as `remote/NAME`.

The entry (name, URL, model id, the name of the key's environment variable) goes to the
registry; a key typed here goes to the OS keyring only, never to a file of ours.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit, QVBoxLayout

from .dialogs import show_error


class AddRemoteDialog(QDialog):
    added = Signal(str)  # the new model id, remote/NAME

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("addRemoteDialog")
        self.setWindowTitle("Add a remote model")
        layout = QVBoxLayout(self)
        layout.setSpacing(12)
        layout.setContentsMargins(18, 16, 18, 14)
        intro = QLabel("A model that runs on another server with an OpenAI-compatible API: vLLM, llama.cpp's "
                       "llama-server, Ollama or another Thermocline. It is used as remote/NAME.", self)
        intro.setWordWrap(True)
        layout.addWidget(intro)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)  # fields take the width
        form.setVerticalSpacing(8)
        form.setHorizontalSpacing(12)
        self.name = QLineEdit(self, placeholderText="bigbox")
        self.url = QLineEdit(self, placeholderText="http://gpu-box:8000/v1")
        self.model = QLineEdit(self, placeholderText="optional: the model id on that server")
        self.key_env = QLineEdit(self, placeholderText="optional: environment variable holding the key")
        self.key = QLineEdit(self, placeholderText="optional: stored in the OS keyring only")
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        for label, field in (("Name", self.name), ("URL", self.url), ("Model id", self.model),
                             ("Key variable", self.key_env), ("API key", self.key)):
            form.addRow(label, field)
        layout.addLayout(form)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel, self)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        # Wide enough that every placeholder reads whole (it was cut at the default width).
        longest = max(f.fontMetrics().horizontalAdvance(f.placeholderText()) for f in self.fields())
        self.setMinimumWidth(min(720, longest + 160))

    def fields(self) -> list[QLineEdit]:
        return [self.name, self.url, self.model, self.key_env, self.key]

    def accept(self) -> None:
        from engine.errors import UserError
        from models_registry.remotes import add_remote, store_key_in_keyring

        try:
            remote = add_remote(self.name.text().strip(), self.url.text(), self.model.text().strip() or None,
                                self.key_env.text().strip() or None)
            if self.key.text():
                store_key_in_keyring(remote, self.key.text())
        except UserError as exc:
            show_error(self, "Cannot add this remote model", str(exc),
                       "Correct the fields, then press OK again.")
            return
        self.added.emit(remote.id)
        super().accept()
