"""The numba decorator every kernel file compiles with (apart from the pool's state in
numba_pool, so the kernel modules and the pool that loads them import one way)."""

from __future__ import annotations


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
