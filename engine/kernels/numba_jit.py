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

    def decorate(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
    return decorate


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
