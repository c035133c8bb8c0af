"""A first start on a machine: the CPU kernels compile in the background while the engine
answers on the torch paths, and each comes in between two tokens once it is ready.

numba compiles the kernels for this CPU at their first use (minutes on 2 cores) and keeps them
in its disk cache. `is_cached` says whether a preparation of this kind (dense or sparse modes,
CPU weight format) completed before for this CPU (numba's code generation target), numba and
these kernel sources (their contents, as numba's own cache checks them): a stamp beside
numba's cache. Then `Engine.load` loads them while the weights load, as always. Otherwise,
when the caller asks for it (`Engine.load(..., kernels="background")`: the terminal chat,
`generate`, the window), `KernelPreparation` compiles them on a thread while that engine
computes under a kernel gate (`numba_pool.KernelGate`): a kernel not taken in yet is computed
on its torch path, which needs no compiling and gives the same results within the kernels'
tested bounds. `Engine` refreshes the gate at every token boundary (`Engine.swap_in_kernels`),
so each kernel comes in at the first boundary after it compiled, never within a token. While
numba compiles, the compiling call gives up the launch lock (numba_pool), so a kernel already
taken in launches meanwhile without waiting for the compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from engine.kernels import numba_pool

# The files that define jitted code (numba's cache tracks each by its mtime and size).
_SOURCES = ("cpu_numba.py", "cpu_q4_numba.py", "q4_quantize.py", "cpu_q4x8.py", "q4_tiles.py", "decode_layer.py")


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
    # contents, not modification times: an installer's copy of the sources keeps its cache
    sources = {name: hashlib.sha256((here / name).read_bytes()).hexdigest() for name in _SOURCES}
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

    from engine.kernels import cpu_numba
    from engine.runtime import fused_decode

    modules = [cpu_numba]
    if cpu_weights == "int4":
        from engine.kernels import cpu_q4_numba, cpu_q4x8, q4_quantize, q4_tiles

        modules += [cpu_q4_numba, q4_quantize, q4_tiles, cpu_q4x8]
    fused = fused_decode.module() if fused_decode.enabled() else None
    if fused is not None:
        modules.append(fused)
    # A mixture's layer function compiles in fused_decode.warm on this thread where the model is
    # one; the gate does not wait for it (a dense model never runs it): its decode stays unfused
    # until the preparation ends.
    return [v for m in modules for name, v in vars(m).items()
            if isinstance(v, Dispatcher) and not name.startswith("_") and v.py_func.__module__ == m.__name__
            and name not in fused_decode.UNTRACKED]


class KernelPreparation:
    """Compiles every kernel of a load's mode and weight format on a thread. The engine computes
    under `gate` meanwhile; `model_loaded` gives the thread the model (the fused decode compiles
    for its layers' storage); `on_progress(compiled, total, finished)` is called on the compiling
    thread after each kernel and once at the end; `ready()` is True once all are compiled (or the thread failed: `error`)."""

    def __init__(self, mode: str, cpu_weights: str, run_prompt, run_all, on_progress=None):
        self.mode, self.cpu_weights = mode, cpu_weights
        self._steps = (run_prompt, run_all)
        self._dispatchers = _dispatchers(cpu_weights)  # imports the kernel modules here, not on the thread
        self.total = len(self._dispatchers)
        self.gate = numba_pool.KernelGate(self._dispatchers)
        self.on_progress = on_progress
        self.error: BaseException | None = None
        self._model = None
        self._model_given = threading.Event()
        self._done = threading.Event()
        self._reported = -1
        numba_pool.on_compiled(self._compiled)
        self._thread = threading.Thread(target=self._run, name="thermocline-kernel-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        run_prompt, run_all = self._steps
        try:
            # Each step marks a kernel as soon as its compile returns (`_compiled`), and at its
            # end every kernel it ran (some were compiled already: another engine, a callee).
            run_prompt(self.mode, self.cpu_weights)
            self._mark_compiled()
            self._model_given.wait()
            if self._model is not None:
                from engine.runtime import fused_decode

                fused_decode.warm(*self._model, keep=False)
                self._mark_compiled()
            run_all(self.mode, self.cpu_weights)
            self._mark_compiled()
            mark_cached(kind_of(self.mode, self.cpu_weights))
        except BaseException as exc:  # noqa: BLE001 - the engine stays on the torch paths and says why
            self.error = exc
        finally:
            numba_pool.on_compiled(self._compiled, add=False)
            self._done.set()
            self._report(final=True)

    def _compiled(self, dispatcher) -> None:
        if threading.current_thread() is self._thread:
            self.gate.mark(dispatcher)
            self._report()

    def _mark_compiled(self) -> None:
        for d in self._dispatchers:
            if d.overloads:
                self.gate.mark(d)
        self._report()

    def _report(self, final: bool = False) -> None:
        done = self.compiled()
        if self.on_progress is not None and (done != self._reported or final):
            self._reported = done
            try:
                self.on_progress(done, self.total, final)
            except Exception:  # noqa: BLE001 - a progress display never stops the compile
                pass

    def model_loaded(self, model, scratch_cache) -> None:
        """The loaded model and a KV cache of its layers' kinds that nothing else reads (the
        fused decode's warm-up writes position 0); None: the load failed."""
        self._model = (model, scratch_cache) if model is not None else None
        self._model_given.set()

    def compiled(self) -> int:
        """Entry points this preparation has compiled so far (of `total`)."""
        return self.gate.marked()

    def taken_in(self) -> int:
        """Entry points the engine computes with now (of `total`): the gate's last refresh."""
        return self.gate.taken

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def prepare_now(model_dir, mode: str, cpu_weights: str) -> str:
    """Compile and stamp every kernel of `mode` and `cpu_weights` now, as a first start does in
    the background, over the model at `model_dir` (an installer's build runs this for each CPU
    tier it ships). Returns "compiled" or "already cached"; raises what the compile raised."""
    from engine import Engine

    engine = Engine.load(model_dir, mode=mode, cpu_weights=cpu_weights, kernels="background")
    prep = engine.kernel_preparation
    if prep is None:
        return "already cached"
    prep.wait()
    if prep.error is not None:
        raise prep.error
    return "compiled"
