"""The numba decorator every kernel file compiles with (apart from the pool's state in
numba_pool, so the kernel modules and the pool that loads them import one way)."""

from __future__ import annotations

import os


def njit(**options):
    """`numba.njit(cache=True, **options)`, or without the disk cache when no cache directory
    is writable (read-only install and no writable user cache): then a kernel compiles in
    memory at each start instead of failing at import. A plain decorator, so sharing it
    across kernel files leaves numba's per-file cache tracking as it is."""
    import numba

    _lock_cache_saves()

    def decorate(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
    return decorate


def _lock_cache_saves() -> None:
    """One process at a time saves a new kernel into a function's cache files. numba's save
    reads the index, names the data file after the entries it found, writes the index, then
    the data: two processes saving two signatures of one function at once (the window and
    `thermocline serve` on a first start, the suite beside its prewarm) can pick the same
    file name, and the index can be left naming one signature's file holding the other's
    code. An advisory lock on a file beside the index makes the three steps one; where no
    lock can be taken the save goes on as numba's own."""
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return
    save = IndexDataCacheFile.save
    if getattr(save, "locked", False) or not hasattr(IndexDataCacheFile, "_load_index"):
        return

    def locked_save(self, key, data):
        path = getattr(self, "_index_path", None)
        try:
            lock = open(f"{path}.lock", "a+b") if path else None
        except OSError:
            lock = None
        if lock is None:
            return save(self, key, data)
        with lock:
            held = _lock_file(lock, True)
            try:
                return save(self, key, data)
            finally:
                if held:
                    _lock_file(lock, False)

    locked_save.locked = True
    IndexDataCacheFile.save = locked_save


def _lock_file(f, take: bool) -> bool:
    """Take (or give back) an exclusive lock on the open file f; False where none was taken."""
    try:
        if os.name == "nt":
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_LOCK if take else msvcrt.LK_UNLCK, 1)
        else:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX if take else fcntl.LOCK_UN)
        return True
    except OSError:
        return False


try:
    from numba.core.caching import UserProvidedCacheLocator, _hash_source_file
except Exception:  # noqa: BLE001 - no numba, or one without these: the bundle keeps numba's own locators
    UserProvidedCacheLocator = None

if UserProvidedCacheLocator is not None:
    class SourceStampCacheLocator(UserProvidedCacheLocator):
        """numba's NUMBA_CACHE_DIR locator, keyed by the kernel's source file even in a frozen
        bundle. numba keys a frozen program's cache by its executable's contents, so the Windows
        bundle's two programs (the window and the console one) would each find the other's
        kernels stale and compile them again, and no cache built for one build would fit
        another with the same sources. The bundle ships the sources (thermocline.spec);
        packaging/entry.py names this class in NUMBA_CACHE_LOCATOR_CLASSES."""

        def get_source_stamp(self):
            st = os.stat(self._py_file)
            return _hash_source_file(self._py_file, st.st_mtime, st.st_size)
