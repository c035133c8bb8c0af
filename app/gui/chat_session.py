"""One chat window's answer in progress, against storage: no widgets.

`ChatSession` owns the answer's state machine: it adds the streaming answer to SQLite, asks
the engine client for it, buffers the tokens and flushes them (to disk, then to whoever shows
them) about 25 times a second, and ends the answer as complete, stopped, interrupted or
failed, or removes it when nothing was said (stopped while the prompt was read, no room in
the context). A failed save never stops an answer: the fields wait in memory, are retried,
and `save_problem` is said once until saving works again.

`AnswerStats` is the worker's stats dict read once, with its fallbacks (live figures carry
`mem_*` keys, final ones the engine's own names), so the readout reads fields, not keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

from PySide6.QtCore import QObject, QTimer, Signal

from app.storage import COMPLETE, FAILED, INTERRUPTED, STOPPED, STREAMING, WRITE_ERRORS, Storage
from engine.runtime.chat_request import ChatRequest

log = logging.getLogger(__name__)

FLUSH_MS = 40
SAVE_RETRY_MS = 3000  # a failed save (full disk) is tried again this often until it succeeds


@dataclass
class AnswerStats:
    """What the worker says of an answer, live or final (`EngineWorker.generate`)."""
    new_tokens: int = 0
    prompt_tokens: int = 0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    ttft_s: float | None = None
    mode: str = ""
    ffn_active_fraction: float = 0.0
    hot_hit_fraction: float | None = None
    expected_hot_hit_fraction: float | None = None
    # the disk tier: the share of the cold neurons computed that the RAM cache served, and
    # the bytes read from disk per token (None: the model is all in memory)
    cache_hit_fraction: float | None = None
    disk_read_bytes_per_token: float | None = None
    device: str | None = None
    vram_bytes: int | None = None
    ram_bytes: int | None = None
    vram_budget: int | None = None
    ram_budget: int | None = None
    dropped_messages: int = 0
    finish_reason: str = "stop"
    error: str = ""
    ctx: int | None = None
    raw: dict = field(default_factory=dict, repr=False)  # as received: what is saved with the answer

    @classmethod
    def from_dict(cls, stats: dict | None) -> "AnswerStats":
        d = dict(stats or {})
        known = {f.name for f in fields(cls)} - {"raw", "device", "vram_bytes", "ram_bytes"}
        out = cls(**{k: d[k] for k in known if d.get(k) is not None}, raw=d)
        # Live figures name the memory readout mem_*; the engine's final stats name it plainly.
        out.device = d.get("mem_device") or d.get("device")
        out.vram_bytes = d["mem_vram_bytes"] if "mem_vram_bytes" in d else d.get("vram_bytes")
        out.ram_bytes = d["mem_ram_bytes"] if "mem_ram_bytes" in d else d.get("ram_bytes")
        out.new_tokens, out.dropped_messages = int(out.new_tokens or 0), int(out.dropped_messages or 0)
        return out

    @property
    def on_gpu(self) -> bool:
        return str(self.device or "").startswith("cuda")


class ChatSession(QObject):
    answer_started = Signal(object)         # the answer's storage Message (empty, streaming)
    text_changed = Signal(int, str)         # answer id, its whole text so far (already saved)
    live = Signal(object)                   # AnswerStats so far
    ended = Signal(int, str, object)        # answer id, status, AnswerStats (saved with the answer)
    dropped = Signal(int, object)           # conversation id, AnswerStats (None: the answer failed)
    failed = Signal(str, str)               # what happened, what to do
    busy_changed = Signal(bool)
    save_problem = Signal(object, str)      # the write error, what the user can do (once until it works)

    def __init__(self, storage: Storage, client, parent: QObject | None = None):
        super().__init__(parent)
        self.storage, self.client = storage, client
        self.request: int | None = None
        self.answer_id: int | None = None
        self.conversation_id: int | None = None  # of the answer: the user may open another chat meanwhile
        self.answer_text = ""
        self.earlier: list[dict] = []  # versions a regenerated answer can page back to
        self.model = ""                # the model writing the answer
        self.stopping = False          # Stop pressed; the worker has not answered yet
        self.stopped_before_text = False
        self._dirty = False
        self._save_warned = False
        self.flush_timer = QTimer(self, singleShot=True, interval=FLUSH_MS)
        self.flush_timer.timeout.connect(self.flush)
        self.save_retry = QTimer(self, interval=SAVE_RETRY_MS)
        self.save_retry.timeout.connect(self.retry_saves)
        client.token.connect(self._on_token)
        client.live_stats.connect(self._on_live_stats)
        client.finished.connect(self._on_finished)
        client.failed.connect(self._on_failed)

    @property
    def busy(self) -> bool:
        """An answer is in progress (until its last signal has been handled)."""
        return self.request is not None

    # -- the answer's life -----------------------------------------------------------------
    def start(self, conversation_id: int, request: ChatRequest, earlier: list[dict] | None = None,
              model: str = "") -> None:
        """Add the streaming answer and ask for it; a failed write raises (nothing was asked).
        `model` (the one answering) is kept with the answer, so it keeps its writer's name."""
        self.earlier = list(earlier or [])
        self.model = model
        stats = {"model": model} if model else {}
        if self.earlier:
            stats["versions"] = self.earlier
        answer = self.storage.add_message(conversation_id, "assistant", "", status=STREAMING, stats=stats or None)
        self.answer_id, self.answer_text, self._dirty = answer.id, "", False
        self.conversation_id = conversation_id
        self.stopping = self.stopped_before_text = False
        self.answer_started.emit(answer)
        self.request = self.client.generate(request)
        self.busy_changed.emit(True)

    def resume(self, conversation_id: int, message, request: ChatRequest, model: str = "") -> None:
        """Continue `message` (a stopped or cut-off answer, the last of its chat) where it ended:
        the new text is appended to it; `request.messages` are the ones before it."""
        old = dict(message.stats or {})
        self.earlier = [v for v in old.get("versions") or [] if isinstance(v, dict)]
        self.model = old.get("model") or model
        self.answer_id, self.answer_text, self._dirty = message.id, message.content, False
        self.conversation_id = conversation_id
        self.storage.update_message(message.id, status=STREAMING)
        self.stopping = self.stopped_before_text = False
        self.answer_started.emit(message)
        self.request = self.client.generate(replace(request, continue_text=message.content))
        self.busy_changed.emit(True)

    def stop(self) -> bool:
        """Ask the worker to stop; True when this began stopping the answer (not a second press)."""
        if self.client.busy and self.request is not None and not self.stopping:
            self.stopping = True
            self.stopped_before_text = not self.answer_text
            self.client.stop()
            return True
        if self.client.busy:
            self.client.stop()
        return False

    def close_out(self) -> None:
        """The window is closing: keep the partial answer as stopped, not interrupted."""
        self.stop()
        if self.answer_id is not None:
            # No dialog now: Storage.close tries once more, and quitting must work.
            self.storage.save_message(self.answer_id, content=self.answer_text, status=STOPPED)
            self._detach()
        self.save_retry.stop()

    def abandon(self) -> None:
        """Its conversation was deleted: forget the answer without writing it."""
        self._detach()

    def flush(self) -> None:
        if not self._dirty or self.answer_id is None:
            return
        self._dirty = False
        # The screen first: a failed save must not stop the answer showing.
        self.text_changed.emit(self.answer_id, self.answer_text)
        self.save(self.answer_id, content=self.answer_text)

    # -- client signals ----------------------------------------------------------------------
    def _on_token(self, request_id: int, text: str) -> None:
        if request_id != self.request:
            return
        self.answer_text += text
        self._dirty = True
        if not self.flush_timer.isActive():
            self.flush_timer.start()

    def _on_live_stats(self, request_id: int, stats: dict) -> None:
        if request_id == self.request:
            self.live.emit(AnswerStats.from_dict(stats))

    def _on_finished(self, request_id: int, stats: dict) -> None:
        if request_id != self.request:
            return
        self.flush()
        final = AnswerStats.from_dict(stats)
        reason = final.finish_reason
        stopped_early = reason == "cancelled" and (self.stopped_before_text or not self.answer_text)
        if stopped_early or (not self.answer_text and reason == "context_full"):
            # Nothing was said (stopped while reading the prompt, or no room): no empty answer
            # stays behind; a regenerated one goes back to the version it replaced.
            self._drop(final)
            return
        status = STOPPED if reason == "cancelled" else INTERRUPTED if reason == "interrupted" else COMPLETE
        saved = {**stats, "model": self.model} if self.model else dict(stats)
        if self.earlier:
            saved["versions"] = self.earlier
        final.raw = saved
        self._end(status, final)

    def _on_failed(self, request_id: int, what: str, todo: str) -> None:
        if request_id != self.request:
            return
        self.flush()
        if self.answer_text:
            kept = {k: v for k, v in (("model", self.model), ("versions", self.earlier)) if v}
            self._end(FAILED, AnswerStats.from_dict(kept or None))
        else:  # nothing was said: do not keep an empty answer around
            self._drop(None)
        self.failed.emit(what, todo)

    def _end(self, status: str, stats: AnswerStats) -> None:
        answer_id = self.answer_id
        self.save(answer_id, content=self.answer_text, status=status, stats=stats.raw or None)
        self.ended.emit(answer_id, status, stats)
        self._detach()

    def _drop(self, stats: AnswerStats | None) -> None:
        """Remove the answer in progress (nothing was said); a regenerated answer falls back to
        the version it was replacing."""
        conv_id = self.conversation_id
        if self.answer_id is not None and conv_id is not None and \
                self.try_write(self.storage.delete_messages_from, conv_id, self.answer_id):
            if self.earlier:
                last = self.earlier[-1]
                keep = dict(last.get("stats") or {})
                if len(self.earlier) > 1:
                    keep["versions"] = self.earlier[:-1]
                self.try_write(lambda: self.storage.add_message(conv_id, "assistant", last["content"],
                                                                status=last.get("status", COMPLETE),
                                                                stats=keep or None))
        self._detach()
        self.dropped.emit(conv_id, stats)

    def _detach(self) -> None:
        self.flush_timer.stop()
        self.stopping = False
        self.earlier = []
        self.request = None
        self.answer_id = None
        self.answer_text = ""
        self.busy_changed.emit(False)

    # -- saving when the disk fails ------------------------------------------------------------
    def save(self, message_id: int, **fields) -> None:
        """Write an answer's fields; on failure they stay in memory, are retried, and the user
        hears about it once."""
        if not self.storage.save_message(message_id, **fields):
            self.save_failed(self.storage.last_write_error,
                             "The answer stays on screen and in memory; Thermocline saves it by itself "
                             "as soon as there is room again. Free some disk space.")

    def save_failed(self, exc, todo: str) -> None:
        if self.storage.has_pending and not self.save_retry.isActive():
            self.save_retry.start()
        if self._save_warned:
            return
        self._save_warned = True
        log.warning("saving the conversation failed: %s", exc)
        self.save_problem.emit(exc, todo)

    def retry_saves(self) -> None:
        if self.storage.retry_pending():
            self.save_retry.stop()
            self._save_warned = False  # a later failure is news again
            log.info("the conversation is saved again")

    def try_write(self, write, *args) -> bool:
        try:
            write(*args)
            return True
        except WRITE_ERRORS as exc:
            self.save_failed(exc, "Free some disk space; the conversation on screen is kept.")
            return False
