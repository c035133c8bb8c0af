"""Generations batched on the engine, a bounded queue in front of them, cancellation.

Requests arrive on uvicorn's event loop; the engine runs on this gate's own thread, one batch
step after another (engine.runtime.batching). Each job carries an asyncio queue that the gate thread
feeds through `loop.call_soon_threadsafe`, and a `threading.Event` the request sets when its
client goes away: the engine checks it after every token, so a disconnect ends the
generation within one token, and a job cancelled while it waits never runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass
class Job:
    prompt: Any
    params: Any  # engine.SamplingParams
    loop: asyncio.AbstractEventLoop
    tools: list | None = None  # OpenAI function definitions for the chat template
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, payload: Any = None) -> None:
        deliver([(self, (kind, payload))])


def deliver(events: list[tuple[Job, tuple]]) -> None:
    """Put each (job, event) on its job's queue: one wake-up of each event loop for all of them.
    A batch step's tokens go together: waking the loop once per token handed the GIL back and
    forth between the loop and the engine thread (8 streams of the demo: every engine call
    took three times its time alone)."""
    loops: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
    for job, event in events:
        loops.setdefault(id(job.loop), (job.loop, []))[1].append((job, event))
    for loop, items in loops.values():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: the server is shutting down
            for job, _ in items:
                job.cancel.set()


def _put_all(items: list[tuple[Job, tuple]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)


class GateFull(Exception):
    """More requests than the queue holds."""


class GenerationGate:
    """Runs jobs on a thread, up to `max_batch` decoding together (engine.runtime.batching: one
    pass over the weights a step for all of them, each with its own KV cache and sampling; new
    jobs join between steps); at most `max_waiting` wait beyond those, more get GateFull (429).

    Events posted to a job: ("token", text), then ("done", {"stats": dict, "token_ids": list})
    or ("error", exception); a job cancelled before it ran gets ("cancelled", None) alone. The
    first event of a job that cannot start (prompt too long, bad sampling values, a KV cache
    the memory left cannot hold) is its error, before any token.
    """

    def __init__(self, get_engine: Callable[[], Any], max_waiting: int = 8, max_batch: int = 8):
        self.get_engine = get_engine
        self.max_waiting, self.max_batch = max_waiting, max(1, max_batch)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._count_lock = threading.Lock()
        self._outstanding = 0  # running + waiting
        self._batch = None  # engine.runtime.batching.Batch of the engine now served
        self._outbox: list[tuple[Job, tuple]] = []  # events of this step, delivered once it sampled and at its end
        self._thread = threading.Thread(target=self._run, name="thermocline-serve-engine", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def running(self) -> int:
        return len(self._batch.active) if self._batch is not None else 0

    def submit(self, job: Job) -> None:
        with self._count_lock:
            if self._outstanding >= self.max_batch + self.max_waiting:
                raise GateFull(f"the server is busy: {self.max_batch} generations run and {self.max_waiting} wait")
            self._outstanding += 1
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _release(self) -> None:
        with self._count_lock:
            self._outstanding -= 1

    def _run(self) -> None:
        while True:
            busy = self._batch is not None and self._batch.active
            while not busy or (len(self._batch.active) < self.max_batch and not self._jobs.empty()):
                job = self._jobs.get()  # blocks only when nothing decodes
                if job is None:
                    return
                self._admit(job)
                self._flush()
                busy = self._batch is not None and self._batch.active
            self._step()

    def _post(self, job: Job, kind: str, payload: Any = None) -> None:
        self._outbox.append((job, (kind, payload)))

    def _flush(self) -> None:
        if self._outbox:
            events, self._outbox = self._outbox, []
            deliver(events)

    def _step(self) -> None:
        """One decode step of the batch; a failure ends this batch's answers, not the server."""
        try:
            self._batch.step()
        except Exception as exc:
            log.exception("a batched decode step failed")
            for seq in self._batch.active:
                seq.done_error(exc)
            self._batch.active = []
        finally:
            self._flush()

    def _admit(self, job: Job) -> None:
        """Start `job` in the batch (its prompt is read now), or answer why it cannot start."""
        from engine.runtime.batching import Batch, Sequence

        if job.cancel.is_set():  # its client left while it waited: never run it
            self._post(job, "cancelled")
            self._release()
            return
        engine = self.get_engine()
        if engine is None:
            self._post(job, "error", RuntimeError("no model is loaded"))
            self._release()
            return
        if self._batch is None or (self._batch.engine is not engine and not self._batch.active):
            self._batch = Batch(engine, on_sampled=self._flush)
        elif self._batch.engine is not engine:  # the window swapped models mid-batch: the old one finishes first
            while self._batch.active:
                self._step()
            self._batch = Batch(engine, on_sampled=self._flush)

        def emit(event) -> None:
            if event.text:
                self._post(job, "token", event.text)

        settled = []  # a step that fails after some sequences finished must not end them twice

        def done(stats, token_ids) -> None:
            if not settled:
                settled.append("done")
                self._post(job, "done", {"stats": stats.to_dict(), "token_ids": token_ids})
                self._release()

        def failed(exc: BaseException) -> None:
            if not settled:
                settled.append("error")
                self._post(job, "error", exc)
                self._release()

        try:
            ids = engine.encode_prompt(job.prompt, job.tools)
            seq = Sequence(ids, job.params, emit, done, job.cancel)
            seq.done_error = failed
            self._batch.start(seq)
        except Exception as exc:  # every failure goes back to its request
            if not isinstance(exc, _user_error_types()):
                log.exception("generation failed")
            failed(exc)


def _user_error_types() -> tuple[type, ...]:
    from engine.errors import UserError

    return (UserError,)
