"""Preferences (Ctrl+,): built from the settings schema, one section per `Option.section`.

Adding a preference is one `Option(..., section=..., label=...)` in app/settings.py; the
widget follows from its type (choices: a list, bool: a check box, numbers: a spin box, text:
a line). A part that needs more than that (a server with a Start button, say) registers a
whole section with `register_section(title, factory)`; `factory(settings, parent)` returns
its widget, which saves its own changes.

Changes apply when the user presses OK or Apply; each value is validated by the schema first,
so nothing that cannot work is ever saved.
"""

from __future__ import annotations

from typing import Any, Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QValidator
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout,
                               QGroupBox, QLabel, QLineEdit, QScrollArea, QSizePolicy, QSpinBox, QVBoxLayout,
                               QWidget)

from app.settings import Option, Settings

SectionFactory = Callable[[Settings, QWidget], QWidget]
_EXTRA_SECTIONS: list[tuple[str, SectionFactory]] = []


def register_section(title: str, factory: SectionFactory) -> None:
    """Add a custom section (after the schema's) to every Preferences dialog opened later."""
    _EXTRA_SECTIONS[:] = [(t, f) for t, f in _EXTRA_SECTIONS if t != title] + [(title, factory)]


class UnsetSpinBox(QSpinBox):
    """A spin box over an option's `unset` value (shown as the special text) and then
    [minimum, maximum]: the gap between them (a 1-6 pt text size) cannot be chosen."""

    def __init__(self, opt: Option, parent: QWidget):
        super().__init__(parent)
        self.unset, self.low = int(opt.unset), int(opt.minimum)
        self.setRange(self.unset, int(opt.maximum))

    def stepBy(self, steps: int) -> None:  # noqa: N802 - Qt API
        value = self.value()
        if value == self.unset and steps > 0:
            self.setValue(self.low + steps - 1)
        elif value > self.unset and value + steps < self.low:
            self.setValue(self.unset)
        else:
            super().stepBy(steps)

    def validate(self, text: str, pos: int):
        state, text, pos = super().validate(text, pos)
        if state == QValidator.State.Acceptable and self.unset < self.valueFromText(text) < self.low:
            state = QValidator.State.Intermediate  # typing "1" on the way to "12" is fine; "1" alone is not
        return state, text, pos

    def fixup(self, text: str) -> str:
        return self.textFromValue(self.low)


class OptionField:
    """One option's editor: a widget, and the value it holds now."""

    def __init__(self, opt: Option, value: Any, parent: QWidget):
        self.option = opt
        if opt.choices:
            w = QComboBox(parent)
            labels = opt.choice_labels or tuple(str(c).capitalize() for c in opt.choices)
            for choice, text in zip(opt.choices, labels):
                w.addItem(text, choice)
            w.setCurrentIndex(max(0, w.findData(value)))
            w.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            w.setMinimumContentsLength(24)  # long choices shrink with the dialog instead of clipping
            self.get = w.currentData
        elif opt.type is bool:
            w = QCheckBox(opt.label or opt.name, parent)
            w.setChecked(bool(value))
            self.get = w.isChecked
        elif opt.type is int:
            w = UnsetSpinBox(opt, parent) if opt.unset is not None else QSpinBox(parent)
            if opt.unset is None:
                w.setRange(int(opt.minimum if opt.minimum is not None else -2**31),
                           int(min(opt.maximum if opt.maximum is not None else 2**31 - 1, 2**31 - 1)))
            if opt.name == "ui.font_size":
                w.setSpecialValueText("System size")
                w.setSuffix(" pt")
                w.setMinimumWidth(w.fontMetrics().horizontalAdvance("System size") + 48)
            w.setValue(int(value or 0))
            self.get = w.value
        elif opt.type is float:
            w = QDoubleSpinBox(parent)
            w.setDecimals(2)
            w.setRange(float(opt.minimum or 0), float(opt.maximum or 1e6))
            w.setValue(float(value or 0))
            self.get = w.value
        else:
            w = QLineEdit(str(value or ""), parent)
            w.setMinimumWidth(160)
            self.get = lambda: w.text().strip()
        if isinstance(w, (QComboBox, QLineEdit)):
            w.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        w.setObjectName(f"pref:{opt.name}")
        w.setToolTip(opt.help)
        self.widget = w


class PreferencesDialog(QDialog):
    applied = Signal(list)  # names of the settings that changed

    def __init__(self, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("preferences")
        self.setWindowTitle("Preferences")
        self.settings = settings
        self.fields: dict[str, OptionField] = {}
        outer = QVBoxLayout(self)
        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        inner = QWidget(scroll)
        col = QVBoxLayout(inner)
        sections: dict[str, QFormLayout] = {}
        for opt in settings.options():
            if not opt.section:
                continue
            form = sections.get(opt.section)
            if form is None:
                box = QGroupBox(opt.section, inner)
                box.setObjectName("prefSection")
                form = sections[opt.section] = QFormLayout(box)
                form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
                col.addWidget(box)
            field = OptionField(opt, settings[opt.name], box)
            self.fields[opt.name] = field
            if opt.type is bool and not opt.choices:
                form.addRow(field.widget)
            else:
                form.addRow(opt.label or opt.name, field.widget)
            hint = QLabel(opt.help, box)
            hint.setObjectName("hint")
            hint.setWordWrap(True)
            hint.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
            form.addRow("", hint)
        self.extra: dict[str, QWidget] = {}
        for title, factory in _EXTRA_SECTIONS:
            box = QGroupBox(title, inner)
            box.setObjectName("prefSection")
            lay = QVBoxLayout(box)
            widget = factory(settings, box)
            lay.addWidget(widget)
            self.extra[title] = widget
            col.addWidget(box)
        col.addStretch(1)
        scroll.setWidget(inner)
        outer.addWidget(scroll, 1)
        self.error = QLabel(self)
        self.error.setObjectName("prefError")
        self.error.setWordWrap(True)
        self.error.hide()
        outer.addWidget(self.error)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Apply
                                        | QDialogButtonBox.StandardButton.Cancel, self)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.buttons.button(QDialogButtonBox.StandardButton.Apply).clicked.connect(self.apply)
        outer.addWidget(self.buttons)
        self.resize(620, 580)

    def field(self, name: str) -> QWidget:
        return self.fields[name].widget

    def apply(self) -> bool:
        """Validate every field, then save the ones that changed; False (and a message) if one is wrong."""
        values = {}
        for name, field in self.fields.items():
            try:
                values[name] = field.option.validate(field.get())
            except ValueError as exc:
                self.error.setText(f"{field.option.label or name}: {exc}")
                self.error.show()
                field.widget.setFocus()
                return False
        self.error.hide()
        changed = [name for name, value in values.items() if self.settings.set(name, value)]
        if changed:
            self.applied.emit(changed)
        return True

    def accept(self) -> None:
        if self.apply():
            super().accept()


def open_preferences(settings: Settings, parent: QWidget, on_applied=None) -> PreferencesDialog:
    dlg = PreferencesDialog(settings, parent)
    dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
    if on_applied is not None:
        dlg.applied.connect(on_applied)
    dlg.open()
    return dlg
