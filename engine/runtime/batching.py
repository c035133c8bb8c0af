"""Continuous batching: many generations decoding together, one pass over the weights a step.

Each sequence has its own KV cache (sized for its prompt and answer, not the whole context),
its own sampler (penalties, grammar, seed) and its own stop strings; a step samples each
sequence's next token from its logits, then runs one `Transformer.decode_batch` over every
sequence still going (the sparse FFN computes the union of their predicted neurons, each
row masked to its own). New sequences join between steps: `start` reads the prompt (the
others wait that long), the next step decodes it with the rest. A sequence whose cache would
not fit in the memory left is refused before it starts (`BatchMemoryError`).

A batch of one decodes through `Transformer.forward` (the fused one-call-per-layer decode),
so one request alone runs as fast as through `Engine.stream`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil
import torch

from engine.errors import ContextFullError, UserError
from engine.runtime.engine import PREFILL_CHUNK, GenerationStats, TokenEvent, _stop_holdback
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.tokenizer import StreamDecoder

MEMORY_RESERVE = 256 << 20  # RAM left to everything else when a sequence's cache is counted


class BatchMemoryError(UserError):
    """A sequence whose KV cache would not fit in the memory left: refused before it starts."""


@dataclass
class Sequence:
    """One generation in the batch; `emit(event)` receives its TokenEvents, `done(stats)` its end."""
    ids: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    done: Callable[[GenerationStats, list[int]], None]
    cancel: threading.Event | None = None
    cache: object = None
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    logits: torch.Tensor | None = None
    history: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
    pending: str = ""
    stats: GenerationStats | None = None
    started: float = 0.0
    prefill_done: float = 0.0
    finished: bool = False
    done_error: Callable[[BaseException], None] | None = None  # a failed step ends it with this


class Batch:
    """The sequences decoding together on one engine; `step` is called by one thread."""

    def __init__(self, engine):
        self.engine = engine
        self.active: list[Sequence] = []

    def cache_bytes(self, slots: int) -> int:
        """Bytes of a KV cache of `slots` positions, in the engine cache's formats."""
        cfg, cache = self.engine.config, self.engine.cache
        return slots * sum(2 * cfg.num_kv_heads * cfg.head_dim * k.element_size() for k in cache.k)

    def start(self, seq: Sequence) -> None:
        """Check, size and read the prompt of `seq`; it decodes from the next step on.
        Raises UserError (bad values, context full, memory) before anything is allocated."""
        engine, params = self.engine, seq.params
        params.validate()
        if not engine.cache.rolling and len(seq.ids) >= engine.ctx:
            raise ContextFullError(f"the prompt has {len(seq.ids)} tokens but the context holds {engine.ctx}; "
                                   "shorten it, start a new conversation or raise the context length")
        slots = min(engine.ctx, len(seq.ids) + params.max_new_tokens + 1)
        need = self.cache_bytes(slots)
        left = psutil.virtual_memory().available - MEMORY_RESERVE
        if need > left:
            raise BatchMemoryError(f"this request's KV cache needs {need >> 20} MiB and {max(left, 0) >> 20} MiB "
                                   f"are left beside the {len(self.active)} answers running; retry later or ask "
                                   "for fewer tokens")
        constraint = engine.token_grammar().start(params.grammar) if params.grammar is not None else None
        layers = engine.model.layers
        seq.cache = engine.make_cache(engine.config, slots, [la.device for la in layers], [la.dtype for la in layers])
        seq.sampler = Sampler(params, engine.sampled_vocab, constraint)
        seq.decoder = StreamDecoder(engine.tokenizer)
        seq.stats = GenerationStats(prompt_tokens=len(seq.ids), mode=engine.mode)
        seq.started = time.perf_counter()
        with engine._lock:
            engine.swap_in_kernels()
            with engine._kernels():  # the kernels this engine has taken in (a first start compiles beside it)
                logits = None
                n = len(seq.ids)
                chunks = max(1, -(-n // PREFILL_CHUNK))
                bounds = [n * i // chunks for i in range(chunks + 1)]
                for lo, hi in zip(bounds, bounds[1:]):
                    logits = engine.model.forward(torch.tensor(seq.ids[lo:hi]), lo, seq.cache)
                engine._check_finite(logits[-1])
        seq.logits = logits[-1]
        seq.prefill_done = time.perf_counter()
        seq.stats.ttft_s = seq.prefill_done - seq.started
        seq.stats.prefill_tok_s = n / max(seq.stats.ttft_s, 1e-9)
        seq.history = list(seq.ids)
        self.active.append(seq)

    def step(self) -> None:
        """Each active sequence takes its next token; those still going decode one step together."""
        going = []
        for seq in self.active:
            token = self._advance(seq)
            if token is not None:
                going.append((seq, token))
        self.active = [s for s, _ in going]
        if not going:
            return
        engine = self.engine
        with engine._lock:
            if engine.sparse is not None:
                engine.sparse.at_token_boundary()
            engine.swap_in_kernels()
            with engine._kernels():  # the kernels this engine has taken in (a first start compiles beside it)
                model = engine.model
                seqs = [s for s, _ in going]
                positions = [len(s.history) - 1 for s in seqs]
                if len(going) == 1:
                    logits = model.forward(torch.tensor([going[0][1]]), positions[0], seqs[0].cache)
                elif model.can_batch([s.cache for s in seqs]):
                    logits = model.decode_batch(torch.tensor([t for _, t in going]), positions, [s.cache for s in seqs])
                else:  # experts or windows: one sequence at a time, interleaved
                    logits = torch.cat([model.forward(torch.tensor([t]), p, s.cache)
                                        for (s, t), p in zip(going, positions)])
        for row, seq in enumerate(seqs):
            seq.logits = logits[row]

    def _advance(self, seq: Sequence) -> int | None:
        """Sample `seq`'s next token and emit its text; the token to decode next, or None when
        the sequence ended (its `done` is then called)."""
        params, engine = seq.params, self.engine
        if seq.sampler.constraint is not None:
            seq.sampler.constraint.room = min(params.max_new_tokens - len(seq.generated),
                                              seq.cache.slots - len(seq.history))
        token = seq.sampler(seq.logits, seq.history)
        if token in engine.eos_ids:
            return self._finish(seq, "stop")
        seq.generated.append(token)
        seq.history.append(token)
        seq.sampler.accept(token)
        seq.pending += seq.decoder.push(token)
        full = seq.emitted + seq.pending
        hit = min((i for i in (full.find(s, max(0, len(seq.emitted) - len(s))) for s in params.stop if s) if i >= 0),
                  default=-1)
        if hit >= 0:
            seq.emit(TokenEvent(full[len(seq.emitted):hit], token, len(seq.generated) - 1))
            seq.emitted = full[:hit]
            return self._finish(seq, "stop", flush=False)
        keep = _stop_holdback(seq.pending, params.stop)
        piece = seq.pending[: len(seq.pending) - keep]
        seq.emitted += piece
        seq.pending = seq.pending[len(piece):]
        seq.emit(TokenEvent(piece, token, len(seq.generated) - 1))
        if len(seq.generated) >= params.max_new_tokens:
            return self._finish(seq, "length")
        if seq.cancel is not None and seq.cancel.is_set():
            return self._finish(seq, "cancelled")
        if len(seq.history) - 1 >= seq.cache.slots:
            return self._finish(seq, "context_full")
        return token

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        stats = seq.stats
        stats.finish_reason = reason
        if flush and reason != "stop":
            tail = seq.pending + seq.decoder.flush()
            if tail:
                seq.emitted += tail
                seq.emit(TokenEvent(tail, -1, len(seq.generated) - 1))
        end = time.perf_counter()
        stats.new_tokens = len(seq.generated)
        steps = max(len(seq.generated) - 1, 0)
        stats.decode_tok_s = steps / (end - seq.prefill_done) if steps and end > seq.prefill_done else 0.0
        mem = self.engine.memory()
        stats.vram_bytes, stats.ram_bytes, stats.device = mem["vram_bytes"], mem["ram_bytes"], mem["device"]
        if self.engine.sparse is not None:
            stats.ffn_active_fraction, stats.hot_hit_fraction = self.engine.sparse.generation_fractions()
        seq.finished = True
        self.engine.last_stats, self.engine.last_token_ids = stats, list(seq.generated)  # as Engine.stream leaves them
        seq.cache = None  # its memory goes back now, not when the request's objects go
        seq.done(stats, list(seq.generated))
        return None

