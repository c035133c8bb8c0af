"""Run a short blocking function (hardware probe, fit estimates, folder scans) off the GUI
thread; its result or error comes back as a queued signal to a callback on the GUI thread."""

from __future__ import annotations

import logging
from typing import Any, Callable

from PySide6.QtCore import QObject, QRunnable, QThreadPool, Signal, Slot
from shiboken6 import isValid

from engine.errors import UserError

log = logging.getLogger(__name__)


class _Relay(QObject):
    """Lives on the GUI thread; its slots are the queued receivers of the task's signals."""

    done = Signal(object)
    failed = Signal(object)

    def __init__(self, on_done, on_error, owner):
        super().__init__()
        self.on_done, self.on_error, self.owner = on_done, on_error, owner
        self.done.connect(self._done)
        self.failed.connect(self._failed)

    def _owner_gone(self) -> bool:
        return self.owner is not None and not isValid(self.owner)

    @Slot(object)
    def _done(self, result) -> None:
        _alive.discard(self)
        if not self._owner_gone():  # the window may have closed while the task ran
            self.on_done(result)

    @Slot(object)
    def _failed(self, exc) -> None:
        _alive.discard(self)
        if self.on_error is not None and not self._owner_gone():
            self.on_error(exc)


class _Task(QRunnable):
    def __init__(self, fn: Callable[[], Any], relay: _Relay):
        super().__init__()
        self.fn, self.relay = fn, relay

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as exc:
            if isinstance(exc, UserError):  # expected (offline, bad input): the caller words it
                log.info("background task: %s", exc)
            else:
                log.exception("background task failed")
            self._deliver(self.relay.failed, exc)
            return
        self._deliver(self.relay.done, result)

    def _deliver(self, signal, value) -> None:
        # At exit Qt may delete the relay while a slow task (a Hub call timing out) still runs:
        # nobody is left to tell, so the result is dropped rather than raised on a pool thread.
        if not isValid(self.relay):
            return
        try:
            signal.emit(value)
        except RuntimeError:  # deleted between the check and the emit
            log.debug("background task finished after its receiver was deleted")


_alive: set[_Relay] = set()  # keep relays alive until their result has been delivered


def run_in_background(fn: Callable[[], Any], on_done: Callable[[Any], None],
                      on_error: Callable[[BaseException], None] | None = None,
                      owner: QObject | None = None) -> None:
    """Call `fn()` on the thread pool; then `on_done(result)` or `on_error(exc)` on the GUI thread,
    unless `owner` (the widget the callbacks update) has been destroyed by then."""
    relay = _Relay(on_done, on_error, owner)
    _alive.add(relay)
    QThreadPool.globalInstance().start(_Task(fn, relay))
