"""What the terminal and the window say while a first start prepares the CPU kernels.

On a machine where the fast CPU kernels were never compiled (numba compiles them for this CPU,
minutes on 2 cores), the engine answers at once on slower paths and takes each kernel in as it
is compiled (engine.runtime.kernel_preparation). THERMOCLINE_KERNELS=wait makes a load wait for
them instead (the test suite does, so its comparisons run on one set of kernels).
"""

from __future__ import annotations

import os


def kernels_choice() -> str:
    """`Engine.load`'s `kernels` for the terminal chat, `generate`, `serve` and the window."""
    value = os.environ.get("THERMOCLINE_KERNELS", "").strip().lower()
    return "wait" if value == "wait" else "background"


def preparing_line(done: int, total: int) -> str:
    return f"preparing fast CPU kernels for this machine, first start only: {done} of {total}"


READY_LINE = "fast CPU kernels ready: answers are faster from now on"


class TerminalNote:
    """The terminal's line about the kernels: once after the load, again after each answer
    while they are still compiling, and once when they are all in."""

    def __init__(self, engine, stream):
        self._prep = getattr(engine, "kernel_preparation", None)
        self._engine, self._stream = engine, stream
        self.active = self._prep is not None

    def after_load(self) -> None:
        if self.active:
            self._write(f"{preparing_line(self._prep.compiled(), self._prep.total)}"
                        "; answers come meanwhile, more slowly")

    def after_answer(self) -> None:
        if not self.active:
            return
        if getattr(self._engine, "kernel_preparation", None) is None or self._prep.ready():
            self.active = False
            if self._prep.error is None:
                self._write(READY_LINE)
            return
        self._write(preparing_line(self._prep.compiled(), self._prep.total))

    def _write(self, text: str) -> None:
        self._stream.write(f"({text})\n")
        self._stream.flush()
