"""Model downloads on a background thread, reported to the GUI as queued signals.

`models_registry.download_model` calls its progress callback on the download thread; the
`DownloadJob` (a QObject living on the GUI thread) re-emits each event as a signal, which
Qt queues to the GUI thread. Pause, resume and cancel go through the registry's thread-safe
`DownloadControl`.
"""

from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


class DownloadJob(QObject):
    # Every signal carries the model name first, so receivers can be plain bound slots.
    event = Signal(str, dict)          # name, a models_registry.progress.DownloadEvent as a dict
    done = Signal(str, dict)           # name, DownloadResult as a dict
    failed = Signal(str, str, str)     # name, what happened, what to do
    cancelled = Signal(str)

    def __init__(self, name: str, parent: QObject | None = None):
        super().__init__(parent)
        from models_registry.progress import DownloadControl

        self.name = name
        self.control = DownloadControl()
        self.last_event: dict | None = None
        self._thread = threading.Thread(target=self._run, name=f"download-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def paused(self) -> bool:
        return self.control.paused

    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def cancel(self) -> None:
        self.control.cancel()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        from engine.errors import UserError
        from models_registry.download import download_model
        from models_registry.progress import DownloadCancelled

        def progress(ev) -> None:
            self.event.emit(self.name, ev.to_dict())

        try:
            result = download_model(self.name, progress=progress, control=self.control)
        except DownloadCancelled:
            self.cancelled.emit(self.name)
        except UserError as exc:
            self.failed.emit(self.name, f"Could not download {self.name}: {exc}",
                             "Check the network connection and the free disk space, then press Download "
                             "again: finished files are kept and the download resumes where it stopped.")
        except Exception as exc:  # noqa: BLE001 - any failure becomes a dialog
            log.exception("download of %s failed", self.name)
            self.failed.emit(self.name, f"Could not download {self.name}: {exc.__class__.__name__}: {exc}",
                             "Check the network connection, then press Download again; finished files "
                             "are kept.")
        else:
            self.done.emit(self.name, result.to_dict())
