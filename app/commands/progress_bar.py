"""A one-line progress bar on stderr for the long-running commands (profile, train, eval).

The engine reports `progress(fraction, text)`; this draws it. On a terminal the line is
redrawn in place; otherwise (logs, CI) a line is printed at most every few seconds.
"""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, stream=None, width: int = 28, quiet: bool = False):
        self.label, self.width, self.quiet = label, width, quiet
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, fraction: float, text: str = "") -> None:
        if self.quiet:
            return
        fraction = min(max(fraction, 0.0), 1.0)
        now = time.monotonic()
        if not self.tty and fraction < 1.0 and now - self._last < 5.0:
            return
        self._last = now
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {fraction * 100:5.1f}% {text}"
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
