"""The status bar's item for a first start: the fast CPU kernels compiling for this machine.

The worker reports `kernels(compiled, total, finished)` (queued from the engine's compiling
thread); meanwhile the model already answers, on slower paths. The item shows the count and
goes away once they are all in; it never appears on a start whose kernels are in the cache.
"""

from __future__ import annotations

from PySide6.QtCore import Slot
from PySide6.QtWidgets import QLabel

from app.kernel_words import READY_LINE, preparing_line


class KernelStatus(QLabel):
    def __init__(self, window):
        super().__init__(window)
        self.setObjectName("kernelStatus")
        self._status_bar = window.statusBar()
        self.hide()

    @Slot(int, int, bool)
    def show_progress(self, done: int, total: int, finished: bool) -> None:
        if finished:
            if self.isVisible():
                self._status_bar.showMessage(READY_LINE[0].upper() + READY_LINE[1:], 8000)
            self.hide()
            return
        self.setText(f"Preparing fast CPU kernels: {done} of {total}")
        self.setToolTip(preparing_line(done, total)[0].upper() + preparing_line(done, total)[1:] + ".\n"
                        "The model answers meanwhile, more slowly; later starts load them at once.")
        self.show()


def install_kernel_status(window) -> KernelStatus:
    item = KernelStatus(window)
    window.statusBar().addPermanentWidget(item)
    window.client.kernels.connect(item.show_progress)
    return item
