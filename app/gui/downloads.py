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
        except Exception as exc:
            if not isinstance(exc, UserError):
                log.exception("download of %s failed", self.name)
            what, todo = download_error_words(self.name, exc)
            self.failed.emit(self.name, what, todo)
        else:
            self.done.emit(self.name, result.to_dict())


RESUME = "Finished files are kept: press Download again and it goes on where it stopped."


def download_error_words(name: str, exc: BaseException) -> tuple[str, str]:
    """(what happened, what to do) for a failed download, in words rather than errno codes."""
    import errno
    import re

    text = str(exc)
    code = getattr(exc, "errno", None)
    if code is None:  # the registry wraps OS errors in its own; their text keeps "[Errno N]"
        m = re.search(r"\[Errno (\d+)\]", text)
        code = int(m.group(1)) if m else None
    if code == errno.ENOSPC:
        return (f"Could not download {name}: the disk is full.",
                "Free some space (or choose another models folder with THERMOCLINE_MODELS_DIR), "
                "then press Download again. " + RESUME)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"Could not download {name}: the models folder cannot be written to.",
                "Check the folder's permissions, or choose another one with THERMOCLINE_MODELS_DIR.")
    from models_registry.hub import HubUnreachable, OfflineModeOn, offline_switch

    switch = offline_switch() if isinstance(exc, OfflineModeOn) else None
    if switch == "settings":
        return (f"Could not download {name}: downloads are switched off in Thermocline's settings "
                "(offline mode).",
                "Turn offline mode off (`thermocline models ...` saved it), then press Download again.")
    if switch is not None:
        return (f"Could not download {name}: downloads are switched off on this computer "
                f"(the {switch} environment variable is set).",
                f"Start Thermocline without {switch} to download models.")
    if isinstance(exc, HubUnreachable) and exc.name_not_resolved:
        return (f"Could not download {name}: the name of the model server could not be looked up "
                "(no internet connection, or no DNS).",
                "Check the internet connection, then press Download again. " + RESUME)
    low = text.lower()
    network = isinstance(exc, (HubUnreachable, ConnectionError, TimeoutError)) or code in (
        errno.ECONNREFUSED, errno.ECONNRESET, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT) or any(
        w in low for w in ("connect", "timed out", "timeout", "name resolution", "network", "unreachable"))
    if network:
        return (f"Could not download {name}: the model server could not be reached.",
                "Check the internet connection, then press Download again. " + RESUME)
    clean = re.sub(r"\[Errno \d+\]\s*", "", text) or exc.__class__.__name__
    clean = clean.replace(" (HF_HUB_OFFLINE / Settings)", "").replace("(Settings, or THERMOCLINE_MODELS_DIR)",
                                                                    "(THERMOCLINE_MODELS_DIR)")
    return (f"Could not download {name}: {clean}",
            "Check the network connection and the free disk space, then press Download again. " + RESUME)
