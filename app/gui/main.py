"""Start the window: `run_window(argv) -> exit code` (called by `thermocline` with no subcommand)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

import resources

log = logging.getLogger(__name__)

RESOURCES = Path(resources.__file__).parent


def stylesheet() -> str:
    """The light sheet (the window applies the chosen theme and font size: app/gui/theme.py)."""
    from .theme import stylesheet as themed

    return themed("light")


def app_icon() -> QIcon:
    return QIcon(str(RESOURCES / "icons" / "thermocline.svg"))


def make_application(argv: list[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication(list(argv if argv is not None else sys.argv[:1]))
    app.setApplicationName("Thermocline")
    app.setOrganizationName("Thermocline")
    app.setApplicationDisplayName("Thermocline")
    app.setDesktopFileName("thermocline")
    app.setWindowIcon(app_icon())
    app.setStyle("Fusion")  # the stylesheet is written against Fusion on every platform
    app.setStyleSheet(stylesheet())
    return app


def build_window(storage=None, settings=None, show_welcome: bool = True):
    """The main window over the user's (or the given) database and settings, not yet shown."""
    from app.settings import Settings
    from app.storage import Storage

    from .main_window import MainWindow

    return MainWindow(storage or Storage(), settings or Settings(), show_welcome=show_welcome)


def _splash():
    """A small splash while the engine's libraries load (once, before the window exists)."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QColor, QPainter, QPixmap
    from PySide6.QtWidgets import QSplashScreen

    pix = QPixmap(360, 140)
    pix.fill(QColor("#f6f7f9"))
    p = QPainter(pix)
    app_icon().paint(p, 24, 38, 64, 64)
    font = p.font()
    font.setPointSizeF(16)
    font.setBold(True)
    p.setFont(font)
    p.setPen(QColor("#1d4e6b"))
    p.drawText(104, 66, "Thermocline")
    font.setPointSizeF(9.5)
    font.setBold(False)
    p.setFont(font)
    p.setPen(QColor("#5c6676"))
    p.drawText(104, 90, "Starting…")
    p.end()
    splash = QSplashScreen(pix, Qt.WindowType.WindowStaysOnTopHint)
    splash.show()
    return splash


def preload_engine() -> None:
    """Import the engine (torch) on the GUI thread before the window shows.

    Importing torch and numba runs for a second or two and loads large native libraries while
    holding the GIL; done later in the worker thread, it would freeze the visible window for
    100-700 ms at a time. Before the window exists, nobody is waiting on the event loop.

    The kernels `cpu.warmup` loads are a sparse int8 preparation's (the window's default), so
    they load here only where that preparation completed; otherwise (a first start, or only
    another kind prepared, as a dense `generate` leaves it) they are left to the model's load,
    which compiles what it needs in the background while the model already answers
    (app.kernel_words): compiling them here took minutes behind the splash.
    """
    try:
        import engine  # noqa: F401
        from app.kernel_words import kernels_choice
        from engine.kernels import cpu
        from engine.runtime import kernel_preparation as kp

        if kernels_choice() == "background" and not kp.is_cached(kp.kind_of("sparse", "int8")):
            log.info("CPU kernels not compiled for this machine yet: they compile while the model answers")
            return
        info = cpu.warmup()  # imports numba and loads the CPU kernels from numba's cache once, here
        log.info("CPU kernels ready in %.2f s (%s)", info["seconds"], info)
    except Exception:
        log.exception("could not import the engine")


# Libraries Qt's X11 (xcb) plugin loads that a fresh desktop may lack: soname -> Debian package.
XCB_LIBRARIES = {
    "libxcb-cursor.so.0": "libxcb-cursor0", "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1", "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0", "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxcb-xkb.so.1": "libxcb-xkb1", "libxcb-shape.so.0": "libxcb-shape0", "libxcb-randr.so.0": "libxcb-randr0",
}


def missing_window_libraries() -> list[str]:
    """Packages to install before Qt's X11 plugin can start (empty where it is not the one used)."""
    if not sys.platform.startswith("linux"):
        return []
    platform = os.environ.get("QT_QPA_PLATFORM", "").split(":")[0]
    if platform not in ("", "xcb") or (not platform and os.environ.get("WAYLAND_DISPLAY")):
        return []  # offscreen, wayland...: the xcb libraries are not needed
    import ctypes

    missing = []
    for soname, package in XCB_LIBRARIES.items():
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing.append(package)
    return missing


def explain_missing_libraries(missing: list[str]) -> int:
    """Say what to install; the exit code of a window that cannot open (the CLI, which
    alone decides the terminal fallback, offers the terminal chat where there is a terminal)."""
    print("error: the window cannot open: this desktop lacks X11 libraries Qt needs ("
          + ", ".join(missing) + "). Install them with:\n"
          f"  sudo apt install {' '.join(missing)}\n"
          "(the .deb package installs them for you). Meanwhile the terminal chat works: thermocline chat",
          file=sys.stderr)
    return 2


def run_window(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = make_application(argv)
    from app.single_instance import SingleInstance

    instance = SingleInstance()
    if not instance.acquire():
        # Two windows over one database would take each other's live answers for crashes.
        sys.stderr.write("Thermocline is already open: its window was brought forward\n")
        return 0
    splash = _splash()
    app.processEvents()
    preload_engine()
    try:
        window = build_window()
    except Exception as exc:
        from PySide6.QtWidgets import QMessageBox

        log.exception("could not start")
        splash.close()
        QMessageBox.critical(None, "Thermocline cannot start",
                             f"{exc}\n\nCheck that the data folder is writable, or set THERMOCLINE_DATA_DIR "
                             "to another folder.")
        instance.release()
        return 1
    window.show()
    splash.finish(window)

    def bring_forward() -> None:
        window.showNormal()
        window.raise_()
        window.activateWindow()

    instance.on_activate = bring_forward
    window.start()
    code = app.exec()
    window.storage.close()
    instance.release()
    from PySide6.QtCore import QThreadPool

    # A background task still running (a models scan, a Hub question: seconds on a busy machine)
    # would hold the exit, as Qt waits for the thread pool; none of them writes what the user made.
    tasks_done = QThreadPool.globalInstance().waitForDone(1000)
    if not getattr(window, "engine_stopped", True) or not tasks_done:
        # Closed mid-load: everything is saved, but Engine.load cannot be interrupted and Qt
        # aborts if a running QThread is destroyed; leave without tearing it down.
        log.info("quitting without waiting for %s", "the model load" if tasks_done else "background tasks")
        logging.shutdown()
        os._exit(code)
    return code
