"""Dialogs: errors (what happened, what to do), per-conversation settings, the welcome."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QLabel,
                               QMessageBox, QPlainTextEdit, QSpinBox, QVBoxLayout, QWidget)

from app.settings import SAMPLING_KEYS, Settings


def show_error(parent: QWidget | None, title: str, what: str, todo: str) -> QMessageBox:
    """A non-blocking error dialog; the rest of the window keeps working behind it."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, what, QMessageBox.StandardButton.Ok, parent)
    box.setObjectName("errorDialog")
    box.setInformativeText(todo)
    box.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
    box.open()
    return box


SAMPLING_LABELS = {"top_p": "Top-p", "top_k": "Top-k", "min_p": "Min-p", "max_new_tokens": "Longest answer",
                   "presence_penalty": "Presence penalty", "frequency_penalty": "Frequency penalty",
                   "seed": "Seed", "stop": "Stop strings"}
RANDOM_SEED = -1  # the seed box's "Random" (a new seed each answer)
MAX_STOPS = 4     # the OpenAI API's limit, which the server and remote models follow


def sampling_field(key: str, opt, parent: QWidget) -> QWidget:
    """The widget for one sampling option: a number box, the seed (or Random), or the stop strings."""
    if key == "stop":
        box = QPlainTextEdit(parent)
        box.setPlaceholderText("one per line, at most 4 (\\n for a line break)")
        box.setTabChangesFocus(True)
        box.setFixedHeight(box.fontMetrics().lineSpacing() * 3 + 12)
    elif key == "seed":
        box = QSpinBox(parent)
        box.setRange(RANDOM_SEED, 2**31 - 1)
        box.setSpecialValueText("Random")  # shown at RANDOM_SEED
    elif opt.type is int:
        box = QSpinBox(parent)
        box.setRange(int(opt.minimum or 0), int(min(opt.maximum or 10**6, 2**31 - 1)))
    else:
        box = QDoubleSpinBox(parent)
        box.setDecimals(2)
        box.setSingleStep(0.01 if key == "min_p" else 0.05)
        box.setRange(float(opt.minimum if opt.minimum is not None else 0), float(opt.maximum or 100))
    box.setToolTip(opt.help)
    box.setObjectName(f"sampling_{key}")
    return box


def set_sampling_value(box: QWidget, key: str, value) -> None:
    if key == "stop":
        box.setPlainText("\n".join(s.replace("\n", "\\n") for s in value or []))
    elif key == "seed":
        box.setValue(RANDOM_SEED if value is None else min(int(value), box.maximum()))
    else:
        box.setValue(value)


def sampling_value(box: QWidget, key: str):
    if key == "stop":
        lines = [line.replace("\\n", "\n") for line in box.toPlainText().split("\n")]
        return [line for line in lines if line][:MAX_STOPS]
    if key == "seed":
        return None if box.value() == RANDOM_SEED else box.value()
    return box.value()


class ConversationSettingsDialog(QDialog):
    """System prompt and sampling for one conversation."""

    def __init__(self, title: str, system_prompt: str, sampling: dict, settings: Settings,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("conversationSettings")
        self.setWindowTitle(f"Settings for “{title}”")
        self.settings = settings
        layout = QVBoxLayout(self)
        intro = QLabel("These apply to this conversation only. New chats start from the defaults.", self)
        intro.setWordWrap(True)
        intro.setObjectName("hint")
        layout.addWidget(intro)
        form = QFormLayout()
        self.system_prompt = QPlainTextEdit(system_prompt, self)
        self.system_prompt.setPlaceholderText("How the assistant should behave (optional)")
        self.system_prompt.setMinimumHeight(90)
        form.addRow("System prompt", self.system_prompt)
        self.fields: dict[str, QWidget] = {}
        for key in SAMPLING_KEYS:
            opt = settings.option(f"chat.{key}")
            box = sampling_field(key, opt, self)
            set_sampling_value(box, key, sampling.get(key, settings[f"chat.{key}"]))
            self.fields[key] = box
            form.addRow(SAMPLING_LABELS.get(key, key.replace("_", " ").capitalize()), box)
        layout.addLayout(form)
        self.save_defaults = QCheckBox("Also use these for new conversations", self)
        layout.addWidget(self.save_defaults)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
                                   | QDialogButtonBox.StandardButton.RestoreDefaults, self)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(self._restore)
        layout.addWidget(buttons)
        self.resize(460, 560)

    def _restore(self) -> None:
        self.system_prompt.setPlainText(self.settings["chat.system_prompt"])
        for key, box in self.fields.items():
            set_sampling_value(box, key, self.settings[f"chat.{key}"])

    def values(self) -> tuple[str, dict]:
        sampling = {key: sampling_value(box, key) for key, box in self.fields.items()}
        return self.system_prompt.toPlainText().strip(), sampling

    def accept(self) -> None:
        if self.save_defaults.isChecked():
            prompt, sampling = self.values()
            self.settings["chat.system_prompt"] = prompt
            for key, value in sampling.items():
                self.settings[f"chat.{key}"] = value
        super().accept()


WELCOME_HTML = """
<h2>Welcome to Thermocline</h2>
<p>Thermocline chats with language models on your own machine, faster than their size
suggests: in these models most feed-forward <i>neurons</i> stay silent for each word, and a
small <b>hot</b> set fires almost always. Thermocline keeps the hot neurons in GPU memory,
computes the rarely used <b>cold</b> ones on the CPU, and predicts which will fire so it can skip
the rest.</p>
<p><b>The two sliders</b> in the panel on the right set how much <b>VRAM</b> (GPU memory) and
<b>RAM</b> Thermocline may use. Move one and the neurons are re-placed at once, even while an
answer is being written: the chart shows the hot share of every layer, and the verdict tells
you whether the model fits. <i>Restore suggested</i> goes back to what suits this machine.</p>
<p><b>The demo model</b> is ready with no download. It is tiny (5 million parameters) and
was trained only on Jane Austen's novels: it writes Austen-flavoured pastiche, not facts or
help. It is there to show the sliders at work. For a real assistant, download a chat model:
the button below fetches the one we recommend; the <b>Models</b> page lists the others, with
an estimate of how well each fits this machine.</p>
"""


class AboutDialog(QDialog):
    """Help → About: version, what runs where, the licence, and where things are kept."""

    def __init__(self, model_info: dict | None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("about")
        self.setWindowTitle("About Thermocline")
        from importlib import metadata

        from PySide6 import __version__ as qt_version

        from app.settings import config_dir
        from app.storage import data_dir

        try:
            version = metadata.version("thermocline")
        except metadata.PackageNotFoundError:
            version = "development copy"
        build = (model_info or {}).get("build") or {}
        rows = [f"<h2>Thermocline</h2><p>Version {version}</p>",
                "<p>Chat with language models on your own computer, computing only the neurons "
                "that fire. Nothing you write leaves this machine.</p>",
                f"<p><b>Engine:</b> {build.get('summary') or 'not loaded yet'}<br>"
                f"<b>Interface:</b> Qt {qt_version}<br>"
                f"<b>Conversations:</b> {data_dir()}<br><b>Settings:</b> {config_dir()}</p>",
                "<p>Licensed under the Apache License 2.0. The demo model is trained on Jane Austen's "
                "novels (public domain).</p>"]
        layout = QVBoxLayout(self)
        text = QLabel("".join(rows), self)
        text.setWordWrap(True)
        text.setTextFormat(Qt.TextFormat.RichText)
        text.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        layout.addWidget(text)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, self)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.setMinimumWidth(460)


class WelcomeDialog(QDialog):
    """First start: what the app does, what the demo model is, and one click to a real one."""

    get_model = 2  # done() code: download the recommended chat model
    typed = Signal(object)  # a key of typing (a QKeyEvent) pressed on the welcome: it is meant for the chat

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("welcome")
        self.setWindowTitle("Welcome")
        layout = QVBoxLayout(self)
        text = QLabel(WELCOME_HTML, self)
        text.setWordWrap(True)
        text.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(text)
        self.recommendation = QLabel("Looking at this machine to choose a chat model for it…", self)
        self.recommendation.setObjectName("hint")
        self.recommendation.setWordWrap(True)
        layout.addWidget(self.recommendation)
        buttons = QDialogButtonBox(self)
        self.download_button = buttons.addButton("Download the recommended chat model",
                                                 QDialogButtonBox.ButtonRole.ActionRole)
        self.download_button.setToolTip("Starts the download on the Models page")
        self.download_button.clicked.connect(lambda: self.done(self.get_model))
        start = buttons.addButton("Try the demo", QDialogButtonBox.ButtonRole.AcceptRole)
        start.setDefault(True)
        buttons.accepted.connect(self.accept)
        layout.addWidget(buttons)
        self.setMinimumWidth(520)
        self.resize(560, self.sizeHint().height())

    def keyPressEvent(self, event) -> None:  # noqa: N802 - Qt API
        text = event.text()
        if text and text.isprintable() and not text.isspace() and \
                not event.modifiers() & ~Qt.KeyboardModifier.ShiftModifier:
            self.typed.emit(event)  # the window closes the welcome and types it into the prompt box
            return
        super().keyPressEvent(event)

    def set_recommended(self, spec: str, row: dict) -> None:
        """Name the model the button downloads: the Models page's choice for this machine."""
        from . import formatting as fmt

        facts = [f"{fmt.size(row['size'])} to download" if row.get("size") else "",
                 row.get("speed", "")]
        facts_text = ", ".join(f for f in facts if f)
        self.recommendation.setText(f"For this machine: <b>{spec}</b>" + (f" ({facts_text})" if facts_text else "")
                                    + ". The Models page marks it too.")
        self.download_button.setToolTip(f"{spec}: starts the download on the Models page")
