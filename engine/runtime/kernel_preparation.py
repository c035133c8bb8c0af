"""A first start on a machine: the CPU kernels compile in the background while the engine
answers on the torch paths, and come in between two tokens once they are ready.

numba compiles the kernels for this CPU at their first use (minutes on 2 cores) and keeps them
in its disk cache. `is_cached` says whether a preparation of this kind (dense or sparse modes,
CPU weight format) completed before for this CPU, numba and these kernel sources: a stamp
beside numba's cache, invalidated as numba invalidates its entries (source mtime and size).
Then `Engine.load` loads them while the weights load, as always. Otherwise, when the caller
asks for it (`Engine.load(..., kernels="background")`: the terminal chat, `generate`, the
window), `KernelPreparation` compiles them on a thread while every other thread sees no
kernels (`numba_pool.withhold_for`): the engine computes on the torch paths, which need no
compiling and give the same results within the kernels' tested bounds. `Engine` hands them
over at a token boundary (`Engine.swap_in_kernels`), all at once: one launch lock serialises
numba's launches and a compiling first call holds it, so a kernel in use beside a compiling
one would wait for the compiler mid-token.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from engine.kernels import numba_pool

# The files that define jitted code (numba's cache tracks each by its mtime and size).
_SOURCES = ("cpu_numba.py", "cpu_q4.py", "cpu_q4x8.py", "q4_tiles.py", "decode_layer.py")


def kind_of(mode: str, cpu_weights: str) -> str:
    return f"{'dense' if mode == 'dense' else 'sparse'}-{cpu_weights}"


def _stamp(kind: str) -> tuple[Path, dict] | None:
    """(stamp file, what it must hold) for this machine, or None where numba keeps no disk cache."""
    kern = numba_pool.module()
    cache = getattr(getattr(kern, "ffn_rows", None), "_cache", None)
    cache_dir = getattr(cache, "cache_path", None)  # None: numba's NullCache (no disk cache)
    if cache_dir is None:
        return None
    import numba
    from numba.core.registry import cpu_target

    here = Path(kern.__file__).parent
    sources = {}
    for name in _SOURCES:
        st = os.stat(here / name)
        sources[name] = [st.st_mtime, st.st_size]
    content = {"numba": numba.__version__, "target": [str(t) for t in cpu_target.target_context.codegen().magic_tuple()],
               "sources": sources}
    return Path(cache_dir) / f"thermocline-kernels-{kind}.json", content


def is_cached(kind: str) -> bool:
    """Whether a preparation of `kind` completed here before (its kernels are in numba's cache)."""
    stamp = _stamp(kind)
    if stamp is None:
        return False
    path, content = stamp
    try:
        return json.loads(path.read_text(encoding="utf-8")) == content
    except (OSError, ValueError):
        return False


def mark_cached(kind: str) -> None:
    stamp = _stamp(kind)
    if stamp is None:
        return
    path, content = stamp
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(content), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next start prepares in the background again


def _dispatchers(cpu_weights: str) -> list:
    """The jitted entry points of the kernel files this weight format runs (the progress count)."""
    from numba.core.dispatcher import Dispatcher

    from engine.kernels import cpu_numba, cpu_q4, cpu_q4x8, q4_tiles
    from engine.runtime import fused_decode

    modules = [cpu_numba] + ([cpu_q4, q4_tiles, cpu_q4x8] if cpu_weights == "int4" else [])
    fused = fused_decode.kernels() if fused_decode.enabled() else None
    if fused is not None:
        modules.append(fused)
    return [v for m in modules for name, v in vars(m).items()
            if isinstance(v, Dispatcher) and not name.startswith("_") and v.py_func.__module__ == m.__name__]


class KernelPreparation:
    """Compiles every kernel of a load's mode and weight format on a thread; meanwhile the
    other threads get none. `model_loaded` gives it the model (the fused decode compiles for
    its layers' storage); `ready()` is True once all are compiled; `release()` hands them over."""

    def __init__(self, mode: str, cpu_weights: str, run_prompt, run_all):
        self.mode, self.cpu_weights = mode, cpu_weights
        self._steps = (run_prompt, run_all)
        self._dispatchers = _dispatchers(cpu_weights)
        self.total = len(self._dispatchers)
        self.error: BaseException | None = None
        self._model = None
        self._model_given = threading.Event()
        self._done = threading.Event()
        numba_pool.withhold_for(-1)  # nobody until the thread holds them: its ident is not known yet
        self._thread = threading.Thread(target=self._run, name="thermocline-kernel-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        numba_pool.withhold_for(threading.get_ident())
        run_prompt, run_all = self._steps
        try:
            run_prompt(self.mode, self.cpu_weights)
            self._model_given.wait()
            if self._model is not None:
                from engine.runtime import fused_decode

                fused_decode.warm(*self._model, keep=False)
            run_all(self.mode, self.cpu_weights)
            mark_cached(kind_of(self.mode, self.cpu_weights))
        except BaseException as exc:  # noqa: BLE001 - the engine stays on the torch paths and says why
            self.error = exc
        finally:
            self._done.set()

    def model_loaded(self, model, scratch_cache) -> None:
        """The loaded model and a KV cache of its layers' kinds that nothing else reads (the
        fused decode's warm-up writes position 0); None: the load failed."""
        self._model = (model, scratch_cache) if model is not None else None
        self._model_given.set()

    def compiled(self) -> int:
        """Entry points compiled so far (of `total`)."""
        return sum(1 for d in self._dispatchers if d.overloads)

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def release(self) -> None:
        """Hand the kernels to every thread (call between tokens, once `ready()`); after an
        error they stay withheld: the torch paths go on."""
        if self.error is None:
            numba_pool.withhold_for(None)
