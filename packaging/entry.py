"""Entry point of the frozen Thermocline bundle (PyInstaller runs this as `__main__`).

Same as the `thermocline` console script (`app.cli:main`), plus two packaging concerns:

- The numba CPU kernels take minutes to compile on 2 cores. In the bundle their cache lives
  in the user's cache folder (`<user cache>/Thermocline/numba`, via NUMBA_CACHE_DIR). The
  installers ship them compiled for two CPU tiers (AVX2, AVX-512: packaging/kernel_tiers.py,
  built by packaging/kernel_caches.py); each start sets numba's target to this CPU's tier and
  seeds the user's cache from the bundle, so an installed app's first start loads them as a
  second start does. A CPU of no tier compiles them in the background on its first start while
  the model already answers. With THERMOCLINE_PREPARE_KERNELS=1 the program prepares them into
  NUMBA_CACHE_DIR and exits (what kernel_caches.py runs for each tier).
- The Windows window build has no console: stdout/stderr go to a log file.
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


def _numba_cache() -> None:
    """Point numba at the user's cache folder, seeded with the bundle's kernels for this CPU's
    tier (packaging/kernel_tiers.py). Entries that do not fit (another numba, other sources)
    are compiled again by numba, in the background on a first start."""
    if not getattr(sys, "frozen", False):
        return
    # The cache keyed by each kernel's source file, not by this program's executable (the
    # Windows bundle has two): engine/kernels/numba_jit.py.
    os.environ.setdefault("NUMBA_CACHE_LOCATOR_CLASSES",
                          "engine.kernels.numba_jit.SourceStampCacheLocator,UserWideCacheLocator")
    if os.environ.get("NUMBA_CACHE_DIR"):
        return  # THERMOCLINE_PREPARE_KERNELS runs, or a user's own choice
    try:
        import platformdirs

        import kernel_tiers

        user = os.path.join(platformdirs.user_cache_dir("Thermocline", appauthor=False), "numba")
        os.makedirs(user, exist_ok=True)
        kernel_tiers.seed_user_cache(getattr(sys, "_MEIPASS", ""), user)
        os.environ["NUMBA_CACHE_DIR"] = user
    except OSError:
        pass  # numba falls back to its own per-user cache folder


def _prepare_kernels() -> int:
    """Every kernel the window, the terminal chat and `generate` run by default (the demo model
    in their modes, int8 CPU weights), prepared as a first start prepares them and stamped
    complete, into NUMBA_CACHE_DIR for the target numba is set to."""
    import time

    from engine.runtime.kernel_preparation import prepare_now
    from models_registry.resolve import demo_model_dir

    for mode in ("hybrid", "dense"):  # the window's and the chat's default; generate's
        t0 = time.perf_counter()
        done = prepare_now(demo_model_dir(), mode, "int8")
        print(f"thermocline: {mode} kernels prepared in {time.perf_counter() - t0:.1f} s ({done})", flush=True)
    return 0


if __name__ == "__main__":
    multiprocessing.freeze_support()
    _streams_for_windowed_app()
    _numba_cache()
    if os.environ.get("THERMOCLINE_PREPARE_KERNELS", "") == "1":
        sys.exit(_prepare_kernels())
    from app.cli import main

    sys.exit(main())
