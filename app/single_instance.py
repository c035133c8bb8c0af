"""One window per data folder: a second launch brings the first window forward instead.

Two windows over one database would each take the other's live answer for a crash and mark
it *interrupted*. The first window holds `window.lock` in the data folder (QLockFile: a stale
lock left by a crash is taken over) and listens on a local socket named after that folder; a
second launch finds the lock taken, asks the first window to come forward, and exits.
`window_pid()` (no Qt) lets the terminal chat say that a window holds a model too.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "window.lock"
RAISE = b"raise\n"


def _data_dir() -> Path:
    from app.storage import data_dir

    return data_dir()


def server_name(folder: Path) -> str:
    digest = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    return f"thermocline-{digest}"


def window_pid(folder: Path | None = None) -> int | None:
    """The process id of a running window over this data folder, or None."""
    import psutil

    try:
        first = (Path(folder or _data_dir()) / LOCK_FILE).read_text(encoding="utf-8").split()[0]
        pid = int(first)
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid > 0 and psutil.pid_exists(pid) else None


class SingleInstance:
    """Held by the first window. `acquire()` is False when another window already runs (it was
    asked to come forward); `on_activate` is called when a later launch asks us to."""

    def __init__(self, folder: Path | None = None):
        from PySide6.QtCore import QLockFile

        self.folder = Path(folder or _data_dir())
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = server_name(self.folder)
        self.lock = QLockFile(str(self.folder / LOCK_FILE))
        self.lock.setStaleLockTime(0)  # stale only when its process is gone, however old
        self.server = None
        self.on_activate = None

    def acquire(self) -> bool:
        if not self.lock.tryLock(100):
            self.lock.removeStaleLockFile()
            if not self.lock.tryLock(100):
                self._ask_first_to_raise()
                return False
        self._listen()
        return True

    def _ask_first_to_raise(self) -> None:
        from PySide6.QtNetwork import QLocalSocket

        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if sock.waitForConnected(2000):
            sock.write(RAISE)
            sock.waitForBytesWritten(2000)
            sock.disconnectFromServer()
        else:
            log.warning("another Thermocline window holds %s but does not answer", self.folder / LOCK_FILE)

    def _listen(self) -> None:
        from PySide6.QtNetwork import QLocalServer

        QLocalServer.removeServer(self.name)  # a socket file left by a crash; we hold the lock
        self.server = QLocalServer()
        if not self.server.listen(self.name):
            log.warning("cannot listen on %s: %s", self.name, self.server.errorString())
            return
        self.server.newConnection.connect(self._on_connection)

    def _on_connection(self) -> None:
        while self.server.hasPendingConnections():
            sock = self.server.nextPendingConnection()

            def read(sock=sock):
                if bytes(sock.readAll()).startswith(RAISE.strip()):
                    log.info("a second launch asked this window to come forward")
                    if self.on_activate is not None:
                        self.on_activate()
                sock.deleteLater()

            if sock.bytesAvailable() >= len(RAISE.strip()):
                read()
            else:
                sock.readyRead.connect(read)

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
        self.lock.unlock()
