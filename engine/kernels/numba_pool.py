"""The numba kernels' shared state: the loaded kernel module, the launch lock and the thread count.

Every CPU kernel family (`cpu` fp32/int8, `cpu_quant`, `cpu_q4`) launches through this one
state, so a thread count set once applies to all of them and no two launches overlap.

    kern = numba_pool.kernels()          # the cpu_numba module, or None (torch fallback)
    with numba_pool.lock:
        threads = numba_pool.use_threads(kern)
        kern.some_kernel(..., threads)
"""

from __future__ import annotations

import os
import threading
import warnings

lock = threading.Lock()  # numba's workqueue threading layer aborts on concurrent launches
_numba = None  # the cpu_numba module once imported; False when unavailable (tests set False)
_threads = None  # set_num_threads's value; numba's own setting is per calling thread
_applied = threading.local()  # .n: the count last applied on this calling thread
_running = None  # threads the pool runs now when fewer than _threads (the decode's tuner); None: _threads
# The thread compiling the kernels in the background on a first start (engine.kernels.preparation):
# meanwhile every other thread gets None from `kernels()` and computes on the torch paths, so no
# call waits for the compiler or for the launch lock the compiling thread holds.
_preparing: int | None = None


def kernels():
    """The cpu_numba module, or None when numba is missing or disabled (THERMOCLINE_NO_NUMBA=1),
    and to every thread but the compiling one while a first start compiles in the background."""
    global _numba
    if _numba is None:
        if os.environ.get("THERMOCLINE_NO_NUMBA", "").strip() not in ("", "0"):
            _numba = False
        else:
            try:
                from engine.kernels import cpu_numba
                _numba = cpu_numba
            except Exception as e:  # noqa: BLE001 - ImportError, or a broken numba/llvmlite install
                warnings.warn(f"numba CPU kernels unavailable ({e}); using the torch fallback",
                              RuntimeWarning, stacklevel=2)
                _numba = False
    if _preparing is not None and _preparing != threading.get_ident():
        return None
    return _numba or None


def module():
    """The cpu_numba module (or None) for any thread, withheld or not: for its cache's location."""
    kernels()
    return _numba or None


def withhold_for(ident: int | None) -> None:
    """Only thread `ident` gets the kernels until called with None (engine.kernels.preparation)."""
    global _preparing
    _preparing = ident


def use_threads(kern) -> int:
    """Applies the thread count on the calling thread; returns the count the kernels split
    their work for (set_num_threads's value).

    The pool may run fewer threads than that (`set_running_threads`: the decode's tuner,
    engine.kernels.thread_tuner): the kernels still split their work as for the set count,
    so a result never depends on how many threads computed it. Remembered per thread:
    numba's get/set calls cost tens of microseconds when the caches are cold, as they are
    between two layers' FFNs."""
    want = _threads if _running is None else _running
    applied = getattr(_applied, "n", None)
    if applied is None or (want is not None and applied != want):
        if want is not None:
            kern.numba.set_num_threads(want)
        applied = _applied.n = kern.numba.get_num_threads()
    if _running is None:
        return applied
    return _threads if _threads is not None else kern.numba.config.NUMBA_NUM_THREADS


def available() -> bool:
    """True when the numba kernels are importable and enabled."""
    return kernels() is not None


def num_threads() -> int:
    """Threads the kernels use (numba's pool; 1 on the torch fallback)."""
    k = kernels()
    return use_threads(k) if k is not None else 1


def set_num_threads(n: int) -> None:
    """Threads for every later kernel call, from any calling thread (1..cores)."""
    global _threads
    k = kernels()
    if k is not None:
        n = max(1, min(int(n), k.numba.config.NUMBA_NUM_THREADS))
        _threads = n


def set_running_threads(n: int | None) -> None:
    """Threads numba's pool runs from the next kernel call on (1..set_num_threads's value),
    the work still split as for that value; None: all of them."""
    global _running, _threads
    k = module()
    if k is None:
        return
    if _threads is None:  # pin the split, so going back to all threads re-applies it
        _threads = k.numba.config.NUMBA_NUM_THREADS
    _running = None if n is None else max(1, min(int(n), _threads))


def configured_threads() -> int:
    """The thread count the kernels split their work for (1 on the torch fallback)."""
    k = module()
    if k is None:
        return 1
    return _threads if _threads is not None else k.numba.config.NUMBA_NUM_THREADS
