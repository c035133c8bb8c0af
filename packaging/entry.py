"""Entry point of the frozen Thermocline bundle (PyInstaller runs this as `__main__`).

Same as the `thermocline` console script (`app.cli:main`), plus two packaging concerns:

- The numba CPU kernels take ~30 s to compile. In the bundle their cache lives in the user's
  cache folder (`<user cache>/Thermocline/numba`, via NUMBA_CACHE_DIR). With
  THERMOCLINE_PREPARE_KERNELS=1 the program compiles them into the cache and exits: the Linux
  package's postinst runs it as root into `_internal/numba-cache` (on the installing machine,
  so for its CPU), and each user's first start copies that seed into their own cache; the
  Windows installer (a per-user install) runs it straight into the user's cache. Either way
  the first window opens without the compile.
- The Windows window build has no console: stdout/stderr go to a log file.
"""

import multiprocessing
import os
import shutil
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


def _numba_cache() -> None:
    """Point numba at the user's cache folder, seeded from the bundle's `numba-cache` (made
    by the Linux postinst for this machine's CPU). Entries that do not fit (another CPU, other
    sources) are simply recompiled by numba."""
    if not getattr(sys, "frozen", False) or os.environ.get("NUMBA_CACHE_DIR"):
        return
    try:
        import platformdirs

        user = os.path.join(platformdirs.user_cache_dir("Thermocline", appauthor=False), "numba")
        seed = os.path.join(getattr(sys, "_MEIPASS", ""), "numba-cache")
        for dirpath, _dirs, files in os.walk(seed):
            target = os.path.join(user, os.path.relpath(dirpath, seed))
            for name in files:
                src, dst = os.path.join(dirpath, name), os.path.join(target, name)
                if not os.path.exists(dst) or os.path.getmtime(src) > os.path.getmtime(dst):
                    os.makedirs(target, exist_ok=True)
                    shutil.copy2(src, dst)
        os.makedirs(user, exist_ok=True)
        os.environ["NUMBA_CACHE_DIR"] = user
    except OSError:
        pass  # numba falls back to its own per-user cache folder


def _prepare_kernels() -> int:
    """cpu.warmup(), then two tokens from the demo model in the modes the window offers, so
    that every kernel a first answer runs is compiled here and not during that answer."""
    import time

    from engine.kernels import cpu

    info = cpu.warmup()
    print(f"thermocline: CPU kernels ready in {info['seconds']:.1f} s "
          f"(compiled {info['compiled']}, from cache {info['cache_hits']}, numba {info['numba']})")
    t0 = time.perf_counter()
    try:
        from app.open_model import open_engine
        from engine import SamplingParams

        for mode in ("hybrid", "dense"):
            open_engine("demo", mode=mode, ctx=64).generate("Hello", SamplingParams(max_new_tokens=2, temperature=0))
        print(f"thermocline: demo model answered in both modes ({time.perf_counter() - t0:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - a missing demo model only means less is cached
        print(f"thermocline: demo model not run ({exc})")
    return 0


if __name__ == "__main__":
    multiprocessing.freeze_support()
    _streams_for_windowed_app()
    _numba_cache()
    if os.environ.get("THERMOCLINE_PREPARE_KERNELS", "") == "1":
        sys.exit(_prepare_kernels())
    from app.cli import main

    sys.exit(main())
