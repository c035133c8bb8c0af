"""Continuous batching: many generations decoding together, one pass over the weights a step.

Each sequence has its own KV cache (sized for its prompt and answer, not the whole context),
and its own `Answer` (engine.runtime.answer: sampler with penalties, grammar and seed, stop
strings, the end of the answer), the one `Engine.stream` uses. A step samples each decoding
sequence's next token from its logits, then runs one `Transformer.forward_batch` over every
sequence still going (the sparse FFN computes the union of their predicted neurons, each
row masked to its own).

Prompts are read inside the steps, not beside them: `start` only checks and sizes a new
sequence; each step then carries, beside the decoding sequences' one token each, pieces of
the waiting prompts, up to PREFILL_BUDGET prompt tokens a step. Prompts that arrive together
are read in one pass over the weights, and a prompt that joins a running batch costs it one
wider step instead of a pause of its own pass (each joining prompt used to stop the batch for
a whole prefill). A sequence whose cache would not fit in the memory left is refused before
it starts (`BatchMemoryError`).

A batch of one decodes through `Transformer.forward` (the fused one-call-per-layer decode),
so one request alone runs as fast as through `Engine.stream`. A decode step of many runs as one
compiled call per layer for all of them (engine.runtime.fused_batch) once its kernels are in;
they load on a thread the first batch starts, and until then the step takes the unfused
batched path. While a batched decode step takes the unfused path (before the fused batch is in,
or where it does not cover the model) it is timed both ways (`StepChooser`): batched, or each
sequence through the fused decode in turn, and takes the way measured cheaper per token: the
unfused step lost on a small model (the demo, dense int8: 1.3 ms a token alone, 14 ms a
batched step of 8). Through the fused batch a decode step is always batched.

A step that carries prompt pieces beside decodes is timed three ways, once the fused batch is
in: "fused" (every row, each prompt token one, through the fused batch: a sparse FFN then
computes each prompt token over its own neurons), "split" (the decodes through the fused
batch, the prompt pieces through a pass of their own) or "joint" (one unfused pass for all the
rows: each weight read once). On a small model the unfused per-layer Python costs more than
reading the weights again (the demo, 8 streams: a third of the steps carried a joining prompt
and took most of the engine's time); on a large one a second read, or a sparse prompt row by
row, may cost more.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from engine.errors import ContextFullError, UserError
from engine.runtime import fused_batch
from engine.runtime.answer import Answer
from engine.runtime.engine import PREFILL_CHUNK, GenerationStats, TokenEvent
from engine.runtime.sampling import first_maxima

MEMORY_RESERVE = 256 << 20  # RAM left to everything else when a sequence's cache is counted
PREFILL_BUDGET = PREFILL_CHUNK  # prompt tokens a step reads, over all the prompts waiting


class BatchMemoryError(UserError):
    """A sequence whose KV cache would not fit in the memory left: refused before it starts."""


@dataclass
class Sequence:
    """One generation in the batch; `emit(event)` receives its TokenEvents, `done(stats)` its end."""
    ids: list[int]
    params: object  # SamplingParams
    emit: Callable[[TokenEvent], None]
    done: Callable[[GenerationStats, list[int]], None]
    cancel: threading.Event | None = None
    cache: object = None
    answer: Answer | None = None
    row: int = -1  # its row in the batch's last logits (its next token's, once its prompt is read)
    read: int = 0  # prompt tokens in its cache
    stats: GenerationStats | None = None
    started: float = 0.0
    prefill_done: float = 0.0
    finished: bool = False
    done_error: Callable[[BaseException], None] | None = None  # a failed step ends it with this

    @property
    def reading(self) -> bool:
        """Still reading its prompt (no token sampled yet)."""
        return self.read < len(self.ids)


class StepChooser:
    """Which way a kind of step runs, from the seconds per token each took lately (the least
    of its last `WINDOW` steps: another process taking the core only ever adds time, and on a
    host shared with busy clients one slowed step in four or five is usual; an average made
    the demo's 8 streams decode "alone", at 3.6 times a batched step's cost, for dozens of
    steps after one batched step was slowed): for a decode step of many sequences "batch" (one
    forward_batch) or "alone" (the fused decode per sequence). Each way is tried first; then
    the best runs, and every `EXPLORE` steps the next of the others is tried again, so a
    change in load or batch width is noticed. A way that lost by more than `FAR` is tried
    half as often each time it loses again (up to every `EXPLORE << MAX_BACKOFF` steps): on
    7B shapes "alone" costs a step of 8 five times a batched one (240-300 ms against 55),
    and trying it every 16 steps took a quarter of the batch's time."""

    EXPLORE = 16
    FAR = 1.5
    MAX_BACKOFF = 4
    WINDOW = 4

    def __init__(self, ways: tuple[str, ...] = ("batch", "alone")):
        self.recent: dict[str, deque[float]] = {way: deque(maxlen=self.WINDOW) for way in ways}
        self.backoff = dict.fromkeys(ways, 0)  # how many times in a row each lost by more than FAR
        self.steps = 0
        self.last: str | None = None
        self._due = 0  # the step at which another way is tried next
        self._turn = 0

    @property
    def cost(self) -> dict[str, float | None]:
        """Each way's seconds per token: the least of its last WINDOW steps (None: untried)."""
        return {way: min(times) if times else None for way, times in self.recent.items()}

    def choose(self) -> str:
        self.steps += 1
        cost = self.cost
        untried = [k for k, v in cost.items() if v is None]
        if untried:
            return untried[0]
        best = min(cost, key=lambda k: cost[k])
        others = [k for k in cost if k != best]
        if not others:
            return best
        if self._due == 0:
            self._due = self.steps + self.EXPLORE - 1
        if self.steps >= self._due:  # the others in turn
            way = others[self._turn % len(others)]
            self._turn += 1
            self._due = self.steps + (self.EXPLORE << self.backoff[way])
            return way
        return best

    def forget(self, way: str) -> None:
        """`way` changed (the fused batch came in): it is tried again at the next step."""
        self.recent[way].clear()

    def record(self, way: str, seconds_per_token: float) -> None:
        self.recent[way].append(seconds_per_token)
        rivals = [v for k, v in self.cost.items() if k != way and v is not None]
        if rivals and seconds_per_token > self.FAR * min(rivals):
            self.backoff[way] = min(self.backoff[way] + 1, self.MAX_BACKOFF)
        else:
            if self.backoff[way] and self._due:  # it came close: explored again within EXPLORE steps
                self._due = min(self._due, self.steps + self.EXPLORE)
            self.backoff[way] = 0
        self.last = way


class ChooserByWidth:
    """A StepChooser for each width of decode step (the sequences in it): a way's cost per
    token changes with the width (the demo's batched step costs 0.24 ms a token at 2 rows and
    0.15 at 8; "alone" about 0.4 at both), and a cost measured at one width made another
    width's choice (a batched step of 2, slowed, sent steps of 8 "alone")."""

    def __init__(self, ways: tuple[str, ...] = ("batch", "alone")):
        self.ways = ways
        self.by_width: dict[int, StepChooser] = {}
        self.last: str | None = None

    def at(self, width: int) -> StepChooser:
        chooser = self.by_width.get(width)
        if chooser is None:
            chooser = self.by_width[width] = StepChooser(self.ways)
        return chooser

    def choose(self, width: int) -> str:
        return self.at(width).choose()

    def record(self, width: int, way: str, seconds_per_token: float) -> None:
        self.at(width).record(way, seconds_per_token)
        self.last = way

    def forget(self, way: str) -> None:
        for chooser in self.by_width.values():
            chooser.forget(way)


class Batch:
    """The sequences decoding together on one engine; `step` is called by one thread."""

    def __init__(self, engine, on_sampled: Callable[[], None] | None = None):
        self.engine = engine
        self.active: list[Sequence] = []  # decoding, or reading their prompts
        self.chooser = ChooserByWidth()  # decode steps of many sequences
        self.mixed = StepChooser(("fused", "split", "joint"))  # steps of decodes and prompt pieces together
        # Called once a step's tokens are sampled and emitted, before its pass over the weights:
        # the server sends them then, not a whole pass later (a 7B step: 30-60 ms a token sooner).
        self.on_sampled = on_sampled
        self._logits: torch.Tensor | None = None  # the last step's, a row per sequence in it
        model = engine.model
        self.fused = fused_batch.ready()  # whether batched decode steps were fused when last timed
        fused_batch.prepare(model, lambda: engine.make_cache(engine.config, 2, [la.device for la in model.layers],
                                                             [la.dtype for la in model.layers]))

    def cache_bytes(self, slots: int) -> int:
        """Bytes of a KV cache of `slots` positions, in the engine cache's formats."""
        cfg, cache = self.engine.config, self.engine.cache
        return slots * sum(2 * cfg.num_kv_heads * cfg.head_dim * k.element_size() for k in cache.k)

    def start(self, seq: Sequence) -> None:
        """Check and size `seq`; its prompt is read in the next steps. Raises UserError (bad
        values, context full, memory) before anything is allocated."""
        engine, params = self.engine, seq.params
        params.validate()
        if not engine.cache.rolling and len(seq.ids) >= engine.ctx:
            raise ContextFullError(f"the prompt has {len(seq.ids)} tokens but the context holds {engine.ctx}; "
                                   "shorten it, start a new conversation or raise the context length")
        slots = min(engine.ctx, len(seq.ids) + params.max_new_tokens + 1)
        need = self.cache_bytes(slots)
        # The caches are untouched zero pages until written (host_memory.zeros): what the running
        # answers have not yet written is not in `available`, so it is set aside here.
        promised = sum(self.cache_bytes(s.cache.slots - s.cache.length) for s in self.active if s.cache is not None)
        left = psutil.virtual_memory().available - MEMORY_RESERVE - promised
        if need > left:
            raise BatchMemoryError(f"this request's KV cache needs {need >> 20} MiB and {max(left, 0) >> 20} MiB "
                                   f"are left beside the {len(self.active)} answers running; retry later or ask "
                                   "for fewer tokens")
        constraint = engine.token_grammar().start(params.grammar) if params.grammar is not None else None
        layers = engine.model.layers
        seq.cache = engine.make_cache(engine.config, slots, [la.device for la in layers], [la.dtype for la in layers])
        seq.answer = Answer(seq.ids, params, engine.tokenizer, engine.eos_ids, engine.sampled_vocab, constraint,
                            seq.cache.slots, seq.cancel)
        seq.stats = GenerationStats(prompt_tokens=len(seq.ids), mode=engine.mode)
        seq.started = time.perf_counter()
        self.active.append(seq)

    def step(self) -> None:
        """Each decoding sequence takes its next token; one pass then decodes those still going
        and reads the next pieces of the prompts waiting."""
        work: list[tuple[Sequence, list[int], int]] = []  # (sequence, its tokens this step, first position)
        greedy = self._greedy_tokens()
        for seq in self.active:
            if seq.reading:
                continue
            token = greedy.get(id(seq))
            # A row is taken only where it is sampled from: indexing is a torch op, which hands the
            # GIL to the event loop, and the engine then waits out the loop's turn (8 a step).
            events, token = seq.answer.take(self._logits[seq.row] if token is None else None, token)
            for event in events:
                seq.emit(event)
            if token is None:
                self._finish(seq)
            else:
                work.append((seq, [token], len(seq.answer.history) - 1))
        budget = PREFILL_BUDGET
        for seq in self.active:
            if not seq.reading or seq.finished:
                continue
            if seq.cancel is not None and seq.cancel.is_set():  # its client left while its prompt was read
                seq.answer.finish_reason = "cancelled"
                self._finish(seq)
                continue
            if budget <= 0:
                continue
            take = min(budget, len(seq.ids) - seq.read)
            if take == len(seq.ids) - seq.read - 1:  # never leave one token for a step of its own
                take += 1
            work.append((seq, seq.ids[seq.read : seq.read + take], seq.read))
            budget -= take
        self.active = [s for s in self.active if not s.finished]
        if self.on_sampled is not None:
            self.on_sampled()
        if work:
            self._forward(work)

    def _forward(self, work: list[tuple[Sequence, list[int], int]]) -> None:
        engine, model = self.engine, self.engine.model
        with engine._lock:
            if engine.sparse is not None:
                engine.sparse.at_token_boundary()
            engine.swap_in_kernels()
            with engine._kernels():  # the kernels this engine has taken in (a first start compiles beside it)
                if len(work) == 1:  # alone: the fused decode, or the plain prefill
                    seq, tokens, start = work[0]
                    logits = model.forward(torch.tensor(tokens), start, seq.cache)
                elif model.can_batch([s.cache for s, _, _ in work]):
                    ones = sum(len(t) == 1 for _, t, _ in work)
                    decode = ones == len(work)  # prompts are always read together
                    if self.fused != fused_batch.ready():
                        self.fused = not self.fused
                        self.chooser.forget("batch")
                        self.mixed.forget("split")
                    if decode and model.batch_fused:
                        # Through the fused batch "alone" cannot win: the same work a row, each weight
                        # read once a step instead of once a sequence (the demo: 0.15 against 0.40 ms a
                        # token at 8 rows, 0.24 against 0.39 at 2; 7B shapes: a fifth). Trying it cost
                        # 7% of the demo's 8 streams.
                        way = "batch"
                    elif decode:
                        way = self.chooser.choose(len(work))
                    elif ones and self.fused:
                        way = self.mixed.choose()
                    else:
                        way = "batch"
                    began = time.perf_counter()
                    if way in ("batch", "joint", "fused"):
                        logits = model.forward_batch([(t, p, s.cache) for s, t, p in work],
                                                     fuse_prompts=way == "fused")
                    elif way == "split":
                        logits = self._split(work)
                    else:
                        logits = torch.cat([model.forward(torch.tensor(t), p, s.cache) for s, t, p in work])
                    per_token = (time.perf_counter() - began) / sum(len(t) for _, t, _ in work)
                    if decode:
                        self.chooser.record(len(work), way, per_token)
                    elif ones and self.fused:
                        self.mixed.record(way, per_token)
                else:  # experts or windows: one sequence at a time, interleaved
                    logits = torch.cat([model.forward(torch.tensor(t), p, s.cache) for s, t, p in work])
        now = time.perf_counter()
        self._logits = logits
        for row, (seq, tokens, start) in enumerate(work):
            seq.row = row
            if seq.reading:
                seq.read = start + len(tokens)
                if not seq.reading:  # its prompt is read: its first token comes at the next step
                    engine._check_finite(logits[row])
                    seq.prefill_done = now
                    seq.stats.ttft_s = now - seq.started
                    seq.stats.prefill_tok_s = len(seq.ids) / max(seq.stats.ttft_s, 1e-9)

    def _greedy_tokens(self) -> dict[int, int]:
        """The plain greedy decoding sequences' next tokens (by id(sequence)), from one argmax
        over their rows of the last logits: what each Sampler computes (a row's first maximum
        within its vocabulary limit), without a copy and four calls per sequence. With many
        streams of a small model those calls were a large part of a step's Python."""
        rows: dict[int | None, list[Sequence]] = {}
        for seq in self.active:
            if not seq.reading and seq.row >= 0 and seq.answer.sampler.plain_greedy:
                rows.setdefault(seq.answer.sampler.vocab_limit, []).append(seq)
        if not rows or self._logits is None:
            return {}
        chosen = {}
        for limit, seqs in rows.items():
            picked = first_maxima(self._logits[:, :limit])  # every row of the step: a view, no copy
            chosen.update((id(s), int(picked[s.row])) for s in seqs)
        return chosen

    def _split(self, work: list[tuple[Sequence, list[int], int]]) -> torch.Tensor:
        """Logits of a step run as two passes: the one-token rows (through the fused batch),
        then the prompt pieces."""
        model, rows = self.engine.model, [None] * len(work)
        for group in ([i for i, (_, t, _) in enumerate(work) if len(t) == 1],
                      [i for i, (_, t, _) in enumerate(work) if len(t) > 1]):
            segments = [(work[i][1], work[i][2], work[i][0].cache) for i in group]
            if len(segments) == 1:
                ids, start, cache = segments[0]
                out = model.forward(torch.tensor(ids), start, cache)
            elif segments:
                out = model.forward_batch(segments)
            for row, i in enumerate(group):
                rows[i] = out[row]
        return torch.stack(rows)

    def _finish(self, seq: Sequence) -> None:
        stats, answer = seq.stats, seq.answer
        stats.finish_reason = answer.finish_reason
        end = time.perf_counter()
        stats.new_tokens = len(answer.generated)
        steps = max(len(answer.generated) - 1, 0)
        stats.decode_tok_s = steps / (end - seq.prefill_done) if steps and end > seq.prefill_done else 0.0
        if seq.reading:
            stats.ttft_s = end - seq.started
        mem = self.engine.memory()
        stats.vram_bytes, stats.ram_bytes, stats.device = mem["vram_bytes"], mem["ram_bytes"], mem["device"]
        if self.engine.sparse is not None:
            stats.ffn_active_fraction, stats.hot_hit_fraction = self.engine.sparse.generation_fractions()
        seq.finished = True
        self.engine.last_stats, self.engine.last_token_ids = stats, list(answer.generated)  # as Engine.stream leaves them
        seq.cache = None  # its memory goes back now, not when the request's objects go
        seq.done(stats, list(answer.generated))
