"""Entry point of the frozen Thermocline bundle (PyInstaller runs this as `__main__`).

Same as the `thermocline` console script (`app.cli:main`), plus one packaging hook:
with THERMOCLINE_PREPARE_KERNELS=1 it compiles the numba CPU kernels into their on-disk
cache and exits. The Windows installer (a per-user install) runs it once after installing,
on the user's own CPU, so the first launch does not spend ~30 s compiling. numba keeps the
cache in the user's cache folder, so a system-wide .deb cannot prepare it for its users:
there the first start compiles (behind the splash screen) and later starts load the cache.
"""

import multiprocessing
import os
import sys


def _streams_for_windowed_app() -> None:
    """The Windows window build (no console) starts with sys.stdout/sys.stderr = None; code that
    writes to them (logging, progress bars) would fail. Send both to a log file instead."""
    if sys.stdout is not None and sys.stderr is not None:
        return
    try:
        import platformdirs

        folder = platformdirs.user_log_dir("Thermocline", appauthor=False)
        os.makedirs(folder, exist_ok=True)
        stream = open(os.path.join(folder, "thermocline.log"), "a", encoding="utf-8", buffering=1)
    except OSError:
        stream = open(os.devnull, "w", encoding="utf-8")
    sys.stdout = sys.stdout or stream
    sys.stderr = sys.stderr or stream


def _prepare_kernels() -> int:
    from engine.kernels import cpu

    info = cpu.warmup()
    print(f"thermocline: CPU kernels ready in {info['seconds']:.1f} s "
          f"(compiled {info['compiled']}, from cache {info['cache_hits']}, numba {info['numba']})")
    return 0


if __name__ == "__main__":
    multiprocessing.freeze_support()
    _streams_for_windowed_app()
    if os.environ.get("THERMOCLINE_PREPARE_KERNELS", "") == "1":
        sys.exit(_prepare_kernels())
    from app.cli import main

    sys.exit(main())
