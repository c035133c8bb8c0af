"""Save the whole X screen ($DISPLAY) as a PNG: `python tools/grab_screen.py OUT.png` (used by
tools/first_use.sh; no ImageMagick needed)."""

import sys

from PySide6.QtGui import QGuiApplication

app = QGuiApplication(["grab_screen"])
if not app.primaryScreen().grabWindow(0).save(sys.argv[1]):
    raise SystemExit(f"could not save {sys.argv[1]}")
