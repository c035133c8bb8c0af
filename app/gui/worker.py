"""The engine's worker: one QObject on its own QThread, the only code that touches the engine.

The pattern is napari's `thread_worker` / GPT4All's chat worker: the GUI thread talks to
`EngineWorker` only through queued signals (load, generate, count tokens, apply budgets) and
hears back only through queued signals (progress, tokens, live stats, results, errors). The
stop flag is a `threading.Event` the GUI sets directly; the engine checks it before every
token and between chunks of the prompt, so a stop lands within one token or one chunk.

Budget changes have one subtlety: while the worker is inside a generation its event loop is
busy, so a queued call would wait for the answer to end. Instead the GUI drops the newest
budgets into a mailbox (latest wins, so a dragged slider coalesces into one solve) and
also queues `apply_budgets`; the generation loop drains the mailbox between tokens, which is
exactly when the engine applies a re-placement ("applied at the next token"), and an idle
worker drains it from the queued call. Either way the answer keeps streaming.

`app/` never touches tensors: everything crossing a signal is plain Python data.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from .formatting import model_label

log = logging.getLogger(__name__)

LIVE_STATS_INTERVAL_S = 0.25
DENSE_NOTE = ("Dense mode: every neuron is computed on one device, so there is nothing to place. "
              "Hybrid mode splits hot and cold neurons.")
REMOTE_NOTE = ("This model runs elsewhere, on the server at {url}: its memory and speed are that "
               "machine's, so the budgets here do not apply to it.")


def to_plain(obj: Any) -> Any:
    """A dataclass or attribute object (stats, placement report) as plain dicts and lists."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if hasattr(obj, "tolist"):  # a numpy array or scalar that slipped into a report
        return obj.tolist()
    if hasattr(obj, "__dict__"):
        return {k: to_plain(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return str(obj)


def explain_error(exc: BaseException, doing: str) -> tuple[str, str]:
    """(what happened, what to do) for an exception raised while `doing` something."""
    from engine.errors import BudgetError, ContextFullError, ModelFormatError, UserError

    text = str(exc) or exc.__class__.__name__
    if isinstance(exc, ModelFormatError):
        return (f"Could not {doing}: {text}",
                "The model folder is incomplete or damaged. Delete it in Models and download it "
                "again, or choose another model.")
    if isinstance(exc, BudgetError):
        return (f"Could not {doing}: {text}", "Raise the budgets in the panel, or choose a smaller model.")
    if isinstance(exc, ContextFullError):
        return (f"Could not {doing}: {text}",
                "Start a new chat, or raise the context length in the panel.")
    from engine.errors import RemoteError

    if isinstance(exc, RemoteError):
        return (f"Could not {doing}: {text}",
                "The model runs on another server: check that it is running and reachable, its URL "
                "and the API key (Models page), then try again.")
    if isinstance(exc, UserError):
        return f"Could not {doing}: {text}", "Check the model and settings, then try again."
    if isinstance(exc, MemoryError) or "out of memory" in text.lower():
        return (f"Ran out of memory while trying to {doing}.",
                "Lower the VRAM or RAM budget, shorten the context length, close other programs, "
                "or choose a smaller model.")
    if isinstance(exc, (OSError, ValueError)):
        return (f"Could not {doing}: {text}",
                "The model files may be damaged or unreadable. Delete the model in Models and "
                "download it again, or choose another model.")
    return (f"Unexpected error while trying to {doing}: {exc.__class__.__name__}: {text}",
            "This is a bug in Thermocline. Try again; if it repeats, restart the app and report "
            "the message above.")


def dense_fallback_words(mode: str, exc: BaseException) -> str:
    """Why a model runs dense, for people (the engine's text, with its command line, goes to the log)."""
    text = str(exc).lower()
    if "swiglu" in text:
        return ("Every neuron is computed (dense): this is a SwiGLU model, whose neurons never output zero. "
                "A ReLU-family (sparse) model of its size computes only the 10-30% that fire, up to about "
                "twice as fast on this computer.")
    if "predictor" in text:
        return ("Every neuron is computed (dense): this model has no predictors yet, the small helper "
                "networks that guess which neurons will fire. It works, only slower than it could.")
    if "cuda" in text or "triton" in text or "gpu" in text:
        return ("Every neuron is computed (dense): the sparse mode needs parts this computer or this "
                "build does not have.")
    return f"Every neuron is computed (dense): {mode} mode could not start for this model."


class EngineWorker(QObject):
    """Owns the engine. Lives on the worker thread; every slot runs there."""

    # Out (queued to the GUI thread).
    loading = Signal(float, str)            # fraction 0..1, what is happening
    loaded = Signal(dict)                   # model info
    load_failed = Signal(str, str)          # what happened, what to do
    token = Signal(int, str)                # request id, new text
    live_stats = Signal(int, dict)          # request id, stats so far
    finished = Signal(int, dict)            # request id, final stats (with finish_reason)
    failed = Signal(int, str, str)          # request id, what happened, what to do
    placement = Signal(dict)                # placement report, as a dict
    placement_failed = Signal(str)          # why the budgets cannot work (says the minimum)
    placement_unavailable = Signal(str)     # the engine cannot re-place (yet)
    token_count = Signal(int, int, int)     # tag, tokens the model reads, context length
    context_report = Signal(int, dict)      # tag, {tokens, ctx, dropped, fits, total}
    kernels = Signal(int, int, bool)        # a first start's CPU kernels: compiled, of, finished

    def __init__(self):
        super().__init__()
        self.engine = None
        self.model_spec = ""
        self._budget_lock = threading.Lock()
        self._pending_budgets: tuple[int | None, int | None] | None = None
        self._last_placement: dict | None = None
        self._budgets: tuple[int | None, int | None] = (None, None)
        self._dropped: dict[int, int] = {}  # conversation -> oldest messages left out last time

    # -- model ---------------------------------------------------------------------------
    def close_engine(self) -> None:
        """Unload: the engine ends its own threads (a mixture's prefetcher) and is dropped."""
        old, self.engine = self.engine, None
        close = getattr(old, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the previous engine failed")

    @Slot(str, dict)
    def load_model(self, spec: str, options: dict) -> None:
        self.loading.emit(0.0, f"Loading {model_label(spec)}…")
        self.close_engine()  # free the previous model's memory (and threads) before the new one arrives
        self._last_placement = None
        mode = options.get("mode", "hybrid")
        sparse_note = budget_note = ""
        try:
            from app.open_model import open_engine  # heavy (torch): the engine is imported off the GUI thread
            from engine.errors import BudgetError

            def progress(fraction: float, text: str = "") -> None:
                self.loading.emit(float(fraction), str(text))

            vram, ram = options.get("vram_budget"), options.get("ram_budget")
            self._budgets = (vram, ram)
            def kernel_progress(done: int, total: int, finished: bool) -> None:  # on the compiling thread
                self.kernels.emit(int(done), int(total), bool(finished))

            kwargs = dict(ctx=int(options.get("ctx", 2048)), vram_budget=vram, ram_budget=ram, progress=progress,
                          cpu_weights=options.get("cpu_weights", "int8"))
            if not str(spec).startswith("remote/"):  # a first start answers while the kernels compile
                from app.kernel_words import kernels_choice

                kwargs.update(kernels=kernels_choice(), kernel_progress=kernel_progress)
            try:
                try:
                    eng = open_engine(spec, mode=mode, **kwargs)
                except BudgetError as exc:
                    if vram is None and ram is None:
                        raise
                    # Saved budgets too small for this model: load with the engine's own, and say so.
                    budget_note = f"The saved budgets cannot work for this model ({exc}); using the defaults."
                    kwargs.update(vram_budget=None, ram_budget=None)
                    self._budgets = (None, None)
                    eng = open_engine(spec, mode=mode, **kwargs)
            except Exception as exc:
                from engine.errors import RemoteError

                if mode == "dense" or isinstance(exc, RemoteError):  # a remote model has no modes to fall back on
                    raise
                # No predictors, or no sparse runtime in this build: run dense and say why.
                log.warning("loading %s in %s mode failed (%s); trying dense", spec, mode, exc)
                eng = open_engine(spec, mode="dense", **kwargs)
                sparse_note = dense_fallback_words(mode, exc)
        except Exception as exc:
            log.exception("loading %s failed", spec)
            what, todo = explain_error(exc, f"load the model “{model_label(spec)}”")
            self.load_failed.emit(what, todo)
            return
        self.engine, self.model_spec = eng, spec
        info = {"model": spec, "ctx": int(getattr(eng, "ctx", options.get("ctx", 2048))),
                "mode": str(getattr(eng, "mode", options.get("mode", ""))), "memory": self._memory()}
        trained = getattr(getattr(eng, "config", None), "max_positions", None)
        if isinstance(trained, int):
            info["max_positions"] = trained  # the context length the model was trained for
        info["note"] = sparse_note or budget_note
        info["fallback"] = bool(sparse_note)  # loaded dense because the chosen mode could not run
        info["budgets_reset"] = bool(budget_note)  # the saved budgets could not work: defaults used
        tok = getattr(eng, "tokenizer", None)
        # A base model (the demo, or one without a chat template) continues text: an assistant
        # system prompt would only take room from its context.
        info["base_model"] = spec == "demo" or not getattr(tok, "has_chat_template", True)
        info["remote"] = bool(eng.remote)
        info["cpu_weights"] = options.get("cpu_weights", "int8")  # the format the model was loaded in
        from engine.runtime.runtime_info import torch_build

        info["build"] = torch_build()  # CPU or CUDA build of torch, and whether a GPU is usable
        self.loading.emit(1.0, "Ready")
        self.loaded.emit(info)
        prep = getattr(eng, "kernel_preparation", None)
        if prep is not None:
            self.kernels.emit(prep.compiled(), prep.total, prep.ready())
        self._initial_placement(sparse_note)
        if budget_note:
            self.placement_failed.emit(budget_note)

    def _initial_placement(self, note: str) -> None:
        eng = self.engine
        if eng.remote:
            self.placement_unavailable.emit(REMOTE_NOTE.format(url=getattr(eng, "url", "another machine")))
        elif self._dense():
            self.placement_unavailable.emit(note or DENSE_NOTE)
        else:
            with self._budget_lock:
                if self._pending_budgets is None:
                    self._pending_budgets = self._budgets
            self.apply_budgets()

    # -- budgets -------------------------------------------------------------------------
    def request_budgets(self, vram: int | None, ram: int | None) -> None:
        """Called on the GUI thread: leave the newest budgets for the worker (latest wins)."""
        with self._budget_lock:
            self._pending_budgets = (vram, ram)

    @Slot()
    def apply_budgets(self) -> None:
        with self._budget_lock:
            pending, self._pending_budgets = self._pending_budgets, None
        if pending is None or self.engine is None:
            if pending is not None:
                self._budgets = pending  # remembered for the next load
            return
        self._budgets = pending
        if self.engine.remote:
            self.placement_unavailable.emit(REMOTE_NOTE.format(url=getattr(self.engine, "url", "another machine")))
            return
        if self._dense():
            self.placement_unavailable.emit(DENSE_NOTE + " The budgets are kept for the next load.")
            return
        try:
            report = self.engine.set_budgets(vram=pending[0], ram=pending[1])
        except Exception as exc:
            from engine.errors import UserError

            if isinstance(exc, UserError):
                self.placement_failed.emit(str(exc))
            else:
                log.exception("re-placement failed")
                self.placement_failed.emit(explain_error(exc, "re-place the neurons")[0])
            return
        self._emit_placement(report)

    def _dense(self) -> bool:
        eng = self.engine
        return getattr(eng, "sparse", None) is None and str(getattr(eng, "mode", "")) == "dense"

    def _emit_placement(self, report: Any) -> None:
        plain = to_plain(report)
        if not isinstance(plain, dict):
            return
        plain["vram_budget"], plain["ram_budget"] = self._budgets
        self._last_placement = plain
        self.placement.emit(plain)

    # -- generation ----------------------------------------------------------------------
    def _fit(self, tag: int | None, messages: list, policy: str, max_new_tokens: int | None):
        """What the model will read under the chat's context policy (`engine.fit`: the engine's
        own count, the one the terminal chat and the server use; a remote engine counts nothing)."""
        fitted = self.engine.fit(messages, policy, max_new_tokens,
                                 self._dropped.get(tag, 0) if tag is not None else 0)
        if tag is not None:
            self._dropped[tag] = fitted.dropped
        return fitted

    @Slot(int, list, dict)
    def count_tokens(self, tag: int, messages: list, options: dict) -> None:
        if self.engine is None:
            return
        try:
            fitted = self._fit(tag if tag >= 0 else None, messages, options.get("context_policy", "truncate"),
                               options.get("max_new_tokens"))
            total = fitted.tokens if not fitted.dropped else None
        except Exception:
            log.exception("token count failed")
            return
        if fitted.tokens is None:
            return  # a remote model's tokenizer is on its server
        ctx = int(getattr(self.engine, "ctx", 0))
        self.token_count.emit(tag, fitted.tokens, ctx)
        self.context_report.emit(tag, {"tokens": fitted.tokens, "ctx": ctx, "dropped": fitted.dropped,
                                       "fits": fitted.fits, "total": total})

    @Slot(int, object, object)
    def generate(self, request_id: int, request, cancel: threading.Event) -> None:
        """One answer to `request` (engine.runtime.chat_request.ChatRequest), token by token."""
        eng = self.engine
        if eng is None:
            self.failed.emit(request_id, "No model is loaded.",
                             "Choose a model on the Models page, or wait for the current one to load.")
            return
        start = time.perf_counter()
        stats: dict[str, Any] = {"new_tokens": 0}
        messages, prefix = request.messages, request.continue_text
        try:
            if prefix:
                messages = [*messages, {"role": "assistant", "content": prefix}]
            fitted = self._fit(request.conversation_id, messages, request.context_policy, request.max_new_tokens)
            messages = fitted.messages
            if prefix:  # the answer's turn is left open, so the model writes on inside it
                tok = eng.tokenizer
                messages = tok.encode(tok.render_chat(messages[:-1]) + prefix, add_special_tokens=False)
            stats["dropped_messages"] = fitted.dropped
            sampling = request.sampling_params()
            last_emit = 0.0
            first = None
            for ev in eng.stream(messages, sampling, cancel=cancel):
                now = time.perf_counter()
                if first is None:
                    first = now
                stats["new_tokens"] += 1
                if cancel.is_set():
                    break  # stopped: what arrives after the stop is not shown
                if ev.text:
                    self.token.emit(request_id, ev.text)
                if self._pending_budgets is not None:
                    self.apply_budgets()  # between tokens: the engine applies it at the next one
                if now - last_emit >= LIVE_STATS_INTERVAL_S:
                    last_emit = now
                    self.live_stats.emit(request_id, self._live(stats, start, first, now))
                if cancel.is_set():
                    break
        except Exception as exc:
            from engine.errors import ContextFullError

            if isinstance(exc, ContextFullError):
                final = {**stats, "finish_reason": "context_full", "error": str(exc),
                         "ctx": int(getattr(eng, "ctx", 0))}
                self.finished.emit(request_id, final)
                return
            from engine.errors import RemoteInterrupted

            if isinstance(exc, RemoteInterrupted) and stats["new_tokens"]:
                # A remote stream broke off: keep what arrived, marked interrupted, and say why.
                final = {**(to_plain(getattr(eng, "last_stats", None)) or {}), **stats,
                         "finish_reason": "interrupted", "error": str(exc)}
                self.finished.emit(request_id, final)
                return
            log.exception("generation failed")
            what, todo = explain_error(exc, "generate an answer")
            self.failed.emit(request_id, what, todo)
            return
        final = to_plain(getattr(eng, "last_stats", None)) or {}
        if not isinstance(final, dict):
            final = {}
        final.setdefault("new_tokens", stats["new_tokens"])
        final["dropped_messages"] = stats.get("dropped_messages", 0)
        if cancel.is_set():
            final["finish_reason"] = "cancelled"
        final.setdefault("finish_reason", "stop")
        final.update(self._memory_fields())
        final["elapsed_s"] = time.perf_counter() - start
        self.finished.emit(request_id, final)

    def _live(self, stats: dict, start: float, first: float | None, now: float) -> dict:
        live = {"new_tokens": stats["new_tokens"], "elapsed_s": now - start,
                "dropped_messages": stats.get("dropped_messages", 0),
                "mode": str(getattr(self.engine, "mode", ""))}
        if first is not None:
            live["ttft_s"] = first - start
            if stats["new_tokens"] > 1 and now > first:
                live["decode_tok_s"] = (stats["new_tokens"] - 1) / (now - first)
        # The engine fills last_stats as it goes: prompt figures are exact once prefill is done.
        current = getattr(self.engine, "last_stats", None)
        for key in ("prompt_tokens", "cached_tokens", "ttft_s", "prefill_tok_s"):
            value = getattr(current, key, None)
            if value:
                live[key] = value
        sparse = getattr(self.engine, "sparse", None)
        if sparse is not None and hasattr(sparse, "generation_fractions"):
            try:  # share of firing neurons so far, and how many the hot tier served
                live["ffn_active_fraction"], live["hot_hit_fraction"] = sparse.generation_fractions()
                if getattr(sparse, "neuron_cache", None) is not None:  # the disk tier: cache hits, disk reads
                    tokens = (live.get("prompt_tokens", 0) - live.get("cached_tokens", 0)) + stats["new_tokens"]
                    live["cache_hit_fraction"], live["disk_read_bytes_per_token"] = sparse.disk_fractions(tokens)
            except Exception:  # noqa: BLE001 - a readout, never worth failing an answer
                pass
        if self._last_placement and "hot_hit_fraction" not in live:
            live["expected_hot_hit_fraction"] = self._last_placement.get("hot_hit_fraction")
        live.update(self._memory_fields())
        return live

    def _memory(self) -> dict:
        try:
            return to_plain(self.engine.memory()) if self.engine is not None else {}
        except Exception:  # noqa: BLE001 - memory readout is advisory
            return {}

    def _memory_fields(self) -> dict:
        mem = self._memory()
        out = {f"mem_{k}": v for k, v in mem.items()}
        out["vram_budget"], out["ram_budget"] = self._budgets
        return out


# Engine threads still running when their client shut down (a model load cannot be cut short):
# Qt aborts the process where a running QThread is destroyed, and the client that held it may be
# collected at any time once its window is gone. Kept here until the thread has ended; then its
# engine is closed. The next shutdown or client sweeps them, and the process waits at exit.
_PARKED: list[tuple[QThread, EngineWorker]] = []


def _park(thread: QThread, worker: EngineWorker) -> None:
    _sweep_parked()
    _PARKED.append((thread, worker))


def _sweep_parked() -> None:
    for entry in list(_PARKED):
        thread, worker = entry
        if thread.isFinished():
            _PARKED.remove(entry)
            worker.close_engine()  # its thread has ended: nothing else touches the engine now


@atexit.register
def _wait_parked() -> None:
    for thread, _worker in list(_PARKED):
        thread.wait()
    _sweep_parked()


class EngineClient(QObject):
    """The GUI thread's handle on the worker: starts the thread, forwards calls as signals, and
    re-emits the worker's signals on the GUI thread (widgets connect here, never to the worker),
    after its own bookkeeping (busy, model_info) has seen them."""

    loading = Signal(float, str)
    loaded = Signal(dict)
    load_failed = Signal(str, str)
    token = Signal(int, str)
    live_stats = Signal(int, dict)
    finished = Signal(int, dict)
    failed = Signal(int, str, str)
    placement = Signal(dict)
    placement_failed = Signal(str)
    placement_unavailable = Signal(str)
    token_count = Signal(int, int, int)
    context_report = Signal(int, dict)
    kernels = Signal(int, int, bool)

    _load = Signal(str, dict)
    _generate = Signal(int, object, object)
    _count = Signal(int, list, dict)
    _apply_budgets = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        _sweep_parked()
        self.thread = QThread()
        self.thread.setObjectName("thermocline-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        # Cross-thread connections are queued: the slots run on the worker thread.
        self._load.connect(self.worker.load_model)
        self._generate.connect(self.worker.generate)
        self._count.connect(self.worker.count_tokens)
        self._apply_budgets.connect(self.worker.apply_budgets)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.load_failed.connect(self._on_load_failed)
        self.worker.finished.connect(self._on_done)
        self.worker.failed.connect(self._on_done)
        for name in ("loading", "loaded", "load_failed", "token", "live_stats", "finished", "failed", "placement",
                     "placement_failed", "placement_unavailable", "token_count", "context_report", "kernels"):
            getattr(self.worker, name).connect(getattr(self, name))  # queued to this (GUI) thread
        self.thread.start()
        self._next_request = 0
        self._cancel: threading.Event | None = None
        self.current_request: int | None = None
        self.loading_model: str | None = None
        self.model_info: dict | None = None

    @property
    def busy(self) -> bool:
        return self.current_request is not None

    @property
    def engine(self):
        """The loaded engine (the local server shares it), or None."""
        return self.worker.engine

    @property
    def model_spec(self) -> str | None:
        """What the loaded engine was loaded from, or None when none is loaded."""
        return self.worker.model_spec if self.worker.engine is not None else None

    def load(self, spec: str, *, mode: str, ctx: int, vram_budget: int | None, ram_budget: int | None,
             cpu_weights: str = "int8") -> None:
        self.stop()  # a model switch ends the answer in progress first
        self.loading_model = spec
        self.model_info = None
        self._load.emit(spec, {"mode": mode, "ctx": ctx, "vram_budget": vram_budget, "ram_budget": ram_budget,
                               "cpu_weights": cpu_weights})

    def generate(self, request) -> int:
        """Start an answer to `request` (engine.runtime.chat_request.ChatRequest, built by the
        chat); its id, which the token, stats and end signals carry."""
        self._next_request += 1
        self.current_request = self._next_request
        self._cancel = threading.Event()
        self._generate.emit(self.current_request, request, self._cancel)
        return self.current_request

    def stop(self) -> None:
        if self._cancel is not None:
            self._cancel.set()  # atomic; the worker sees it before the next token

    def count_tokens(self, tag: int, messages: list[dict], options: dict | None = None) -> None:
        """How many tokens the model reads of `messages` (after the context policy in `options`);
        answered by `token_count` and `context_report` with the same tag (a conversation id, or
        a negative tag for a draft)."""
        self._count.emit(tag, messages, dict(options or {}))

    def set_budgets(self, vram: int | None, ram: int | None) -> None:
        self.worker.request_budgets(vram, ram)
        self._apply_budgets.emit()

    def shutdown(self, timeout_ms: int = 5000) -> bool:
        """Stop the answer, end the thread; False when it is still busy (a model load in progress)."""
        self.stop()
        self.thread.quit()
        if not self.thread.wait(timeout_ms):
            log.warning("engine thread did not stop within %d ms", timeout_ms)
            _park(self.thread, self.worker)
            return False
        self.worker.close_engine()  # its thread has ended: nothing else touches the engine now
        return True

    @Slot(dict)
    def _on_loaded(self, info: dict) -> None:
        self.loading_model = None
        self.model_info = info

    def _on_load_failed(self, *_args) -> None:
        self.loading_model = None

    def _on_done(self, request_id: int, *_args) -> None:
        if request_id == self.current_request:
            self.current_request = None
            self._cancel = None
