"""Light and dark themes from one stylesheet: `@name@` in the QSS is a palette colour.

There is one `resources/styles/thermocline.qss`; a theme is only a palette (a dict of colour
roles), so a rule added once looks right in both. The font size preference scales every
`font-size: Npt` of the sheet together with the application font, so headings keep their
proportion to the text. `system` follows the desktop's colour scheme (Qt 6.5+).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import resources

log = logging.getLogger(__name__)

RESOURCES = Path(resources.__file__).parent
BASE_POINT_SIZE = 10.0  # the sheet's font sizes are written for a 10 pt body font

LIGHT = {
    "window": "#f6f7f9", "surface": "#ffffff", "sidebar": "#eef1f5", "hover": "#f2f4f7",
    "code_bg": "#f8f9fb", "code_header": "#eceff4", "track": "#e6eaf0", "divider": "#e3e7ed",
    "divider_side": "#dde2ea", "card_border": "#e0e5ec", "answer_border": "#e5e9ef", "code_border": "#d9dee6",
    "border": "#d6dce5", "control_border": "#cfd6df", "control_border_hover": "#b7c0cc",
    "dialog_border": "#c9d2dc", "banner_button_border": "#b9c6d3",
    "text": "#1f2630", "text_strong": "#2c3440", "code_text": "#24292f", "text_facts": "#3d4756",
    "nav_text": "#46505e", "text_readout": "#4c5766", "text_muted": "#5c6676", "text_hint": "#6f7989",
    "text_faint": "#7a8494", "text_empty": "#8a93a2", "text_time": "#9aa3b0", "text_disabled": "#a0a8b4",
    "accent": "#1d6a8c", "accent_hover": "#185b78", "accent_text": "#1d4e6b", "selected_text": "#123c54",
    "selected": "#d5e6f0", "user_bg": "#e4eff6", "user_border": "#d3e4ef", "streaming_bg": "#dcebf4",
    "banner_bg": "#e8f2f8", "nav_hover": "#e2e7ee", "item_hover": "#e3e8ef", "code_copy_hover": "#dfe5ec",
    "warn_banner": "#fdf3dc", "warn_bg": "#fdf0dc", "stopped_bg": "#fbeccc", "stopped_text": "#8a5a00",
    "warn_text": "#8a5200", "warn_border": "#f0dca8", "bad_bg": "#fbe5e2", "failed_bg": "#f8dcd8",
    "bad_text": "#9b2a20", "bad_border": "#f0c4be", "good_bg": "#e1f3e6", "good_text": "#1f6b35",
    "hot": "#e8743b", "cold": "#3b7dd8", "level_warn": "#e0a030", "level_full": "#d0463b",
    "stop": "#c8553d", "stop_hover": "#b04a34", "download_total": "#7fb3e6", "send_disabled": "#b7c4cf",
    "slider_disabled": "#c9d0d9", "groove": "#dfe4eb", "scroll_handle": "#c5ccd6", "toggle_border": "#b7cfde",
    "tooltip_bg": "#1f2630", "tooltip_text": "#ffffff", "on_accent": "#ffffff",
}

DARK = {
    "window": "#16191e", "surface": "#1f242b", "sidebar": "#1b1f25", "hover": "#2a3038",
    "code_bg": "#14171b", "code_header": "#232930", "track": "#2b323b", "divider": "#2b3139",
    "divider_side": "#2b3139", "card_border": "#2d343d", "answer_border": "#2d343d", "code_border": "#333b45",
    "border": "#38414c", "control_border": "#3d4651", "control_border_hover": "#56616e",
    "dialog_border": "#3d4651", "banner_button_border": "#4a5563",
    "text": "#e3e7ec", "text_strong": "#dde2e8", "code_text": "#e6e9ed", "text_facts": "#c3cad3",
    "nav_text": "#b9c1cb", "text_readout": "#aeb7c2", "text_muted": "#a3adb9", "text_hint": "#939daa",
    "text_faint": "#87919e", "text_empty": "#7c8693", "text_time": "#737d8a", "text_disabled": "#5f6874",
    "accent": "#2f86ad", "accent_hover": "#3995bd", "accent_text": "#8cc4e0", "selected_text": "#e6f3fa",
    "selected": "#24435a", "user_bg": "#1f3344", "user_border": "#2a4457", "streaming_bg": "#1f3a4d",
    "banner_bg": "#1d3140", "nav_hover": "#2a3038", "item_hover": "#262d35", "code_copy_hover": "#2f3740",
    "warn_banner": "#3a2f17", "warn_bg": "#3a2f17", "stopped_bg": "#3d3116", "stopped_text": "#f0c46a",
    "warn_text": "#f0c46a", "warn_border": "#5a4722", "bad_bg": "#3f2222", "failed_bg": "#472525",
    "bad_text": "#f3a397", "bad_border": "#663131", "good_bg": "#1d3a26", "good_text": "#8fd6a2",
    "hot": "#f08a52", "cold": "#5b98e6", "level_warn": "#e0a030", "level_full": "#e0584c",
    "stop": "#c8553d", "stop_hover": "#d8664d", "download_total": "#3f6f9e", "send_disabled": "#3a4550",
    "slider_disabled": "#3d4651", "groove": "#323a44", "scroll_handle": "#46505c", "toggle_border": "#3b5a70",
    "tooltip_bg": "#e3e7ec", "tooltip_text": "#16191e", "on_accent": "#ffffff",
}

PALETTES = {"light": LIGHT, "dark": DARK}
_VAR = re.compile(r"@([a-z_]+)@")
_FONT = re.compile(r"font-size:\s*([0-9.]+)pt")


def system_prefers_dark() -> bool:
    try:
        from PySide6.QtCore import Qt
        from PySide6.QtGui import QGuiApplication

        hints = QGuiApplication.styleHints()
        return hints.colorScheme() == Qt.ColorScheme.Dark
    except Exception:  # noqa: BLE001 - an older Qt: light
        return False


def resolve(theme: str) -> str:
    """`light` or `dark` for a theme setting (`system` asks the desktop)."""
    if theme == "system":
        return "dark" if system_prefers_dark() else "light"
    return theme if theme in PALETTES else "light"


def palette(theme: str) -> dict[str, str]:
    return PALETTES[resolve(theme)]


def stylesheet(theme: str = "light", font_size: float = 0) -> str:
    """The sheet with the theme's colours and fonts scaled to `font_size` pt (0: as written)."""
    try:
        qss = (RESOURCES / "styles" / "thermocline.qss").read_text(encoding="utf-8")
    except OSError:  # a missing style is ugly, not fatal
        log.warning("stylesheet missing; using the platform style")
        return ""
    qss = qss.replace("@ICONS@", (RESOURCES / "icons").as_posix())  # QSS urls need a real path
    colours = palette(theme)
    qss = _VAR.sub(lambda m: colours.get(m.group(1), m.group(0)), qss)
    if font_size:
        scale = font_size / BASE_POINT_SIZE
        qss = _FONT.sub(lambda m: f"font-size: {float(m.group(1)) * scale:.1f}pt", qss)
    missing = sorted(set(_VAR.findall(qss)))
    if missing:
        log.warning("stylesheet colours without a value: %s", ", ".join(missing))
    return qss


def apply(app, theme: str = "light", font_size: float = 0) -> None:
    """Style the whole application (every window and dialog) for a theme and font size."""
    from PySide6.QtGui import QColor, QFont, QPalette

    colours = palette(theme)
    pal = QPalette()  # the palette too: native dialogs, file pickers and menus follow it
    for role, key in ((QPalette.ColorRole.Window, "window"), (QPalette.ColorRole.Base, "surface"),
                      (QPalette.ColorRole.AlternateBase, "hover"), (QPalette.ColorRole.Button, "surface"),
                      (QPalette.ColorRole.WindowText, "text"), (QPalette.ColorRole.Text, "text"),
                      (QPalette.ColorRole.ButtonText, "text"), (QPalette.ColorRole.Highlight, "accent"),
                      (QPalette.ColorRole.HighlightedText, "on_accent"),
                      (QPalette.ColorRole.PlaceholderText, "text_hint"),
                      (QPalette.ColorRole.ToolTipBase, "tooltip_bg"), (QPalette.ColorRole.ToolTipText, "tooltip_text"),
                      (QPalette.ColorRole.Link, "accent_text")):
        pal.setColor(role, QColor(colours[key]))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text, QColor(colours["text_disabled"]))
    pal.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText, QColor(colours["text_disabled"]))
    app.setPalette(pal)
    system = app.property("thermoclineSystemFont")
    if system is None:  # the desktop's font, before any size of ours: what "System size" goes back to
        system = QFont(app.font())
        app.setProperty("thermoclineSystemFont", system)
    font = QFont(system)
    if font_size:
        font.setPointSizeF(font_size)
    app.setFont(font)  # also at 0: back to the system size, not the last size chosen
    app.setProperty("thermoclineTheme", resolve(theme))
    app.setStyleSheet(stylesheet(theme, font_size))
