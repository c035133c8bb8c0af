"""One generation at a time on the engine, a bounded queue in front of it, cancellation.

Requests arrive on uvicorn's event loop; the engine runs on this gate's own thread (its
`stream` is a blocking generator). Each job carries an asyncio queue that the gate thread
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
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancel.set()


class GateFull(Exception):
    """More requests than the queue holds."""


class GenerationGate:
    """Runs jobs one after another on a thread; at most `max_waiting` wait behind the running one.

    Events posted to a job: ("token", text), then ("done", {"stats": dict, "token_ids": list})
    or ("error", exception); a job cancelled before it ran gets ("cancelled", None) alone. The first event of a job that cannot start (prompt too long, bad
    sampling values) is its error, before any token.
    """

    def __init__(self, get_engine: Callable[[], Any], max_waiting: int = 8):
        self.get_engine = get_engine
        self.max_waiting = max_waiting
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._count_lock = threading.Lock()
        self._outstanding = 0  # running + waiting
        self._thread = threading.Thread(target=self._run, name="thermocline-serve-engine", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def submit(self, job: Job) -> None:
        with self._count_lock:
            if self._outstanding >= 1 + self.max_waiting:
                raise GateFull(f"the server is busy: one generation runs and {self.max_waiting} wait")
            self._outstanding += 1
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job.cancel.is_set():  # its client left while it waited: never run it
                    job.post("cancelled")
                else:
                    self._generate(job)
            finally:
                with self._count_lock:
                    self._outstanding -= 1

    def _generate(self, job: Job) -> None:
        engine = self.get_engine()
        if engine is None:
            job.post("error", RuntimeError("no model is loaded"))
            return
        try:
            extra = {"tools": job.tools} if job.tools is not None else {}
            for event in engine.stream(job.prompt, job.params, job.cancel, **extra):
                if event.text:
                    job.post("token", event.text)
            stats = engine.last_stats
            job.post("done", {"stats": stats.to_dict(), "token_ids": list(getattr(engine, "last_token_ids", []))})
        except Exception as exc:
            if not isinstance(exc, _user_error_types()):
                log.exception("generation failed")
            job.post("error", exc)


def _user_error_types() -> tuple[type, ...]:
    from engine.errors import UserError

    return (UserError,)
