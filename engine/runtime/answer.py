"""One answer as it is sampled, token by token: the state `Engine.stream` and the batch share.

`Answer.take(logits)` samples the next token (penalties, grammar, seed: the answer's own
Sampler), turns it into text (never splitting a character), holds back text that may still
grow into a stop string, and decides whether the answer ends there: an end-of-turn token, a
stop string, max_new_tokens, a cancel, or a full cache. It returns the TokenEvents to emit and
the token to decode next (None once the answer ended, `finish_reason` then says why). The
caller owns the model and the cache; this owns everything about the text.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.tokenizer import StreamDecoder


@dataclass
class TokenEvent:
    """One step of a stream; a last event with token_id -1 carries text held back until the end."""
    text: str
    token_id: int
    index: int


def stop_holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                best = max(best, k)
                break
    return best


class Answer:
    """The text side of one generation. `limit`: the positions its cache holds (None: a
    rolling cache, never full); `history`: the prompt's ids, then each token taken."""

    def __init__(self, ids: list[int], params: SamplingParams, tokenizer, eos_ids: set[int],
                 sampled_vocab: int | None, constraint=None, limit: int | None = None,
                 cancel: threading.Event | None = None):
        self.params, self.eos_ids, self.limit, self.cancel = params, eos_ids, limit, cancel
        self.sampler = Sampler(params, sampled_vocab, constraint)
        self.decoder = StreamDecoder(tokenizer)
        self.history = list(ids)
        self.generated: list[int] = []
        self.emitted = ""  # the text sent so far
        self.pending = ""  # decoded but held back (it may become a stop string)
        self.finish_reason: str | None = None

    def take(self, logits: torch.Tensor | None, token: int | None = None) -> tuple[list[TokenEvent], int | None]:
        """`token`: the sampler's choice made by the caller (a batch's argmax of its plain greedy
        rows, `Sampler.plain_greedy`; `logits` may then be None); None: sampled here from `logits`."""
        params = self.params
        constraint = self.sampler.constraint
        if constraint is not None:  # the room left, so the grammar can close in time
            room = self.limit - len(self.history) if self.limit is not None else 1 << 30
            constraint.room = min(params.max_new_tokens - len(self.generated), room)
        if token is None:
            token = self.sampler(logits, self.history)
        if token in self.eos_ids:
            # The model ended its turn: text held back for a stop string that never came is its own.
            return self._end("stop", flush=True), None
        self.generated.append(token)
        self.history.append(token)
        self.sampler.accept(token)
        self.pending += self.decoder.push(token)
        full = self.emitted + self.pending
        index = len(self.generated) - 1
        hit = min((i for i in (full.find(s, max(0, len(self.emitted) - len(s))) for s in params.stop if s) if i >= 0),
                  default=-1)
        if hit >= 0:
            event = TokenEvent(full[len(self.emitted):hit], token, index)
            self.emitted, self.pending = full[:hit], ""
            self.finish_reason = "stop"
            return [event], None
        keep = stop_holdback(self.pending, params.stop)
        piece = self.pending[: len(self.pending) - keep]
        self.emitted += piece
        self.pending = self.pending[len(piece):]
        events = [TokenEvent(piece, token, index)]
        if len(self.generated) >= params.max_new_tokens:
            return events + self._end("length"), None
        if self.cancel is not None and self.cancel.is_set():
            return events + self._end("cancelled"), None
        if self.limit is not None and len(self.history) - 1 >= self.limit:
            return events + self._end("context_full"), None
        return events, token

    def _end(self, reason: str, flush: bool = True) -> list[TokenEvent]:
        """End the answer; the text still held back, as a last event with no token."""
        self.finish_reason = reason
        tail = (self.pending + self.decoder.flush()) if flush else ""
        self.pending = ""
        if not tail:
            return []
        self.emitted += tail
        return [TokenEvent(tail, -1, len(self.generated) - 1)]

    def cancelled(self) -> list[TokenEvent]:
        """End it from outside (a cancel seen between steps)."""
        return self._end("cancelled")
