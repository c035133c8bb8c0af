"""The numba kernels' shared state: the loaded kernel module, the launch lock and the thread count.

Every CPU kernel family (`cpu` fp32/int8, `cpu_quant`, `cpu_q4`) launches through this one
state, so a thread count set once applies to all of them and no two launches overlap.

    kern = numba_pool.kernels("ffn_rows")   # the cpu_numba module, or None (torch fallback)
    with numba_pool.lock:
        threads = numba_pool.use_threads(kern)
        kern.ffn_rows(..., threads)

A first start compiles the kernels on a thread while an engine answers on the torch paths
(engine.runtime.kernel_preparation): that engine computes under a `KernelGate`, set on the
calling thread for each of its computations (`gated`), and `kernels(names)` answers None there
for a kernel the gate has not taken in yet. The gate takes kernels in between tokens. Other
threads and other engines are not gated. A call that compiles gives up the launch lock while
numba compiles (`_compile_for_args` below), so a compiled kernel launched on another thread
never waits for the compiler, only for another launch.
"""

from __future__ import annotations

import os
import threading
import warnings


class LaunchLock:
    """numba's workqueue threading layer aborts on concurrent launches: one launch at a time.
    Knows its holder, so a first call may hand it on while it compiles."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holder: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._holder = threading.get_ident()
        return got

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_here(self) -> bool:
        return self._holder == threading.get_ident()

    def __enter__(self) -> "LaunchLock":
        self.acquire()
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


lock = LaunchLock()
_numba = None  # the cpu_numba module once imported; False when unavailable (tests set False)
_threads = None  # set_num_threads's value; numba's own setting is per calling thread
_applied = threading.local()  # .n: the count last applied on this calling thread
# .gate: the KernelGate this thread computes under (None: every kernel); .running: the threads
# the pool runs for this calling thread's launches when fewer than _threads (the decode's tuner,
# within its step: `running_threads`); None: _threads. Per calling thread and scoped, so one
# engine's reduced count never carries over to another engine, a batched decode or a prefill.
_local = threading.local()
_compiled_listeners: list = []  # called after each first call's compile, on the compiling thread
compiles_under_gate = 0  # compiles a gated computation ran itself (a kernel taken in too early)


class KernelGate:
    """The kernels one engine may launch while its first start compiles them. The compiling
    thread `mark`s each kernel once compiled; the engine takes the marked ones in at `refresh`
    (between tokens), so a token computes on the same kernels from its start to its end."""

    def __init__(self, dispatchers):
        self.tracked = list(dispatchers)
        self._marked: set[int] = set()
        self._ready: frozenset[int] = frozenset()
        self.taken = 0  # kernels taken in at the last refresh
        self.complete = False

    def mark(self, dispatcher) -> None:
        if any(d is dispatcher for d in self.tracked):
            self._marked.add(id(dispatcher))

    def marked(self) -> int:
        return len(self._marked)

    def refresh(self) -> int:
        """Take in every kernel marked by now; returns how many are in."""
        ready = frozenset(self._marked)
        self._ready, self.taken, self.complete = ready, len(ready), len(ready) == len(self.tracked)
        return self.taken

    def allows(self, dispatchers) -> bool:
        """Whether these kernels are in; no kernels named: whether all of them are."""
        if not dispatchers:
            return self.complete
        return all(id(d) in self._ready for d in dispatchers)


class gated:
    """`with gated(gate):` the calling thread launches only the kernels `gate` took in (None: all)."""

    def __init__(self, gate: KernelGate | None):
        self._gate = gate

    def __enter__(self) -> None:
        self._outer = getattr(_local, "gate", None)
        _local.gate = self._gate

    def __exit__(self, *_exc) -> None:
        _local.gate = self._outer


def _load():
    global _numba
    if _numba is None:
        if os.environ.get("THERMOCLINE_NO_NUMBA", "").strip() not in ("", "0"):
            _numba = False
        else:
            try:
                from engine.kernels import cpu_numba
                _install_compile_hook()
                _numba = cpu_numba
            except Exception as e:  # noqa: BLE001 - ImportError, or a broken numba/llvmlite install
                warnings.warn(f"numba CPU kernels unavailable ({e}); using the torch fallback",
                              RuntimeWarning, stacklevel=3)
                _numba = False
    return _numba or None


def kernels(*names: str):
    """The cpu_numba module, or None when numba is missing or disabled (THERMOCLINE_NO_NUMBA=1),
    or where the calling thread's gate has not taken in the kernels `names` (no names: all)."""
    kern = _load()
    if kern is None or not usable(*(getattr(kern, n) for n in names)):
        return None
    return kern


def usable(*dispatchers) -> bool:
    """Whether the calling thread may launch these jitted functions (no gate, or its gate took
    them in, and none of them compiles behind: `compiling_behind`); none named: whether it may
    launch every kernel."""
    if any(d in compiling_behind for d in dispatchers):
        return False
    gate = getattr(_local, "gate", None)
    return gate is None or gate.allows(dispatchers)


# Jitted functions a thread compiles that no computation waits for (engine.runtime.fused_decode:
# a disk tier's or a mixture's layer calls, whose first compile takes minutes): `usable` says
# no for them until that thread ends, and the callers take their unfused paths meanwhile.
compiling_behind: set = set()


class _WouldCompile(Exception):
    pass


def loads_without_compiling(dispatcher, *args) -> bool:
    """Whether `dispatcher(*args)` runs without numba compiling it: compiled in this process
    already, or in numba's disk cache, which this loads now (numba's own first step in
    `Dispatcher.compile`; only its compiler is refused here)."""
    from numba.core.compiler_lock import global_compiler_lock

    sig = tuple(dispatcher.typeof_pyval(a) for a in args)
    if sig in dispatcher.overloads:
        return True

    def refuse(*_args, **_kws):
        raise _WouldCompile

    compiler = dispatcher._compiler
    with global_compiler_lock:  # no other thread compiles this function meanwhile
        compiler.compile = refuse
        try:
            dispatcher.compile(sig)
            return True
        except _WouldCompile:
            misses = dispatcher._cache_misses  # counted before the compiler was asked: no compile ran
            misses[sig] -= 1
            if misses[sig] <= 0:
                del misses[sig]
            return False
        finally:
            del compiler.compile


def module():
    """The cpu_numba module (or None) whatever the calling thread's gate: what the kernels
    can do here (AVX2, block sizes), and where their cache lives."""
    return _load()


def _install_compile_hook() -> None:
    """numba compiles a kernel at its first call with new argument types, inside the launch
    lock the caller holds: hand the lock on while numba compiles (a compiled kernel on another
    thread then launches meanwhile) and take it back for the launch."""
    from numba.core.dispatcher import _DispatcherBase

    original = _DispatcherBase._compile_for_args
    if getattr(original, "thermocline_hook", False):
        return

    def _compile_for_args(self, *args, **kws):
        global compiles_under_gate
        if getattr(_local, "gate", None) is not None:
            compiles_under_gate += 1
        if not lock.held_here():
            result = original(self, *args, **kws)
        else:
            lock.release()
            try:
                result = original(self, *args, **kws)
            finally:
                lock.acquire()
        for listener in list(_compiled_listeners):
            listener(self)
        return result

    _compile_for_args.thermocline_hook = True
    _DispatcherBase._compile_for_args = _compile_for_args


def on_compiled(listener, add: bool = True) -> None:
    """listener(dispatcher) after each first call's compile (or load from the disk cache)."""
    if add:
        _compiled_listeners.append(listener)
    elif listener in _compiled_listeners:
        _compiled_listeners.remove(listener)


def use_threads(kern) -> int:
    """Applies the thread count on the calling thread; returns the count the kernels split
    their work for (set_num_threads's value).

    The pool may run fewer threads than that for this calling thread (`running_threads`: the
    decode's tuner, engine.kernels.thread_tuner): the kernels still split their work as for the
    set count, so a result never depends on how many threads computed it. Remembered per thread:
    numba's get/set calls cost tens of microseconds when the caches are cold, as they are
    between two layers' FFNs."""
    running = getattr(_local, "running", None)
    if running is not None and _threads is not None:
        running = min(running, _threads)  # set_num_threads lowered the split since
    want = _threads if running is None else running
    applied = getattr(_applied, "n", None)
    if applied is None or (want is not None and applied != want):
        if want is not None:
            kern.numba.set_num_threads(want)
        applied = _applied.n = kern.numba.get_num_threads()
    if running is None:
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
        _threads = max(1, min(int(n), k.numba.config.NUMBA_NUM_THREADS))


def set_running_threads(n: int | None) -> None:
    """Threads numba's pool runs for the calling thread's kernel calls from the next one on
    (1..set_num_threads's value), the work still split as for that value; None: all of them.
    Other calling threads are not affected."""
    global _threads
    k = module()
    if k is None:
        return
    if _threads is None:  # pin the split, so going back to all threads re-applies it
        _threads = k.numba.config.NUMBA_NUM_THREADS
    _local.running = None if n is None else max(1, min(int(n), _threads))


class running_threads:
    """`with running_threads(n):` the calling thread's kernel calls run on n threads (None: all),
    split as for all; the count it had before is back on leaving (a decode step's scope)."""

    def __init__(self, n: int | None):
        self._n = n

    def __enter__(self) -> None:
        self._outer = getattr(_local, "running", None)
        set_running_threads(self._n)

    def __exit__(self, *_exc) -> None:
        _local.running = self._outer


def configured_threads() -> int:
    """The thread count the kernels split their work for (1 on the torch fallback)."""
    k = module()
    if k is None:
        return 1
    return _threads if _threads is not None else k.numba.config.NUMBA_NUM_THREADS
