"""The engine the app and the CLI talk to: load a model, stream tokens, report stats.

One generation runs at a time (a lock); `stream` is a generator meant to run on a
worker thread, cancellable through a `threading.Event` between tokens and between chunks
of the prompt. The KV cache is kept between calls: a prompt that extends the previous
conversation only pays for its new tokens.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.config import ModelConfig, read_cats
from engine.arch import read_config
from engine.activations import dense_only_words, is_sparse
from engine.errors import ContextFullError, ModelFormatError, UserError
from engine.hotcold.moe_tiers import load_moe
from engine.hotcold.sparse import load_sparse
from engine.loading.dense_quant import load_dense
from engine.model.kv_cache import KVCache
from engine.loading.loader import Progress, model_folder
from engine.runtime import fused_batch, fused_decode
from engine.runtime.answer import Answer, TokenEvent
from engine.runtime.context_policy import Fitted, fit_messages
from engine.runtime.sampling import SamplingParams
from engine.runtime.tokenizer import Tokenizer
from engine.validation import check_ctx, check_kv_fits, check_text, check_threads, resolve_device
from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_q4, cpu_q4x8, numba_pool, q4_tiles, thread_tuner

MODES = ("dense", "sparse", "hybrid", "oracle")
PREFILL_CHUNK = 128  # prompt tokens per forward: a stop is honoured between chunks


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    mode: str = "dense"
    ffn_active_fraction: float = 0.0
    hot_hit_fraction: float = 0.0
    # the disk tier (engine.hotcold.neuron_cache): of the cold neurons computed, the share the
    # RAM cache served, and the bytes read from the prepared file per token (prompt included)
    cache_hit_fraction: float = 1.0
    disk_read_bytes_per_token: float = 0.0
    vram_bytes: int = 0
    ram_bytes: int = 0
    device: str = "cpu"
    finish_reason: str = "length"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    """A local model; `RemoteEngine` answers the same calls for a remote one (`fit`, `stream`,
    `reset`, `memory`, `remote`), so the window and the CLI never ask which it is by type."""

    remote = False

    def __init__(self, model_dir: Path, config: ModelConfig, tokenizer: Tokenizer, model, cache: KVCache,
                 mode: str, ctx: int, eos_ids: set[int], generation_defaults: dict, sparse=None):
        self.model_dir, self.config, self.tokenizer = model_dir, config, tokenizer
        self.model, self.cache, self.mode, self.ctx = model, cache, mode, ctx
        self.eos_ids = eos_ids
        self.generation_defaults = generation_defaults
        self.last_stats = GenerationStats(mode=mode)
        self.sparse = sparse  # engine.hotcold.sparse.SparseRuntime for sparse/hybrid/oracle modes
        self.dense_prepared = None  # dense mode: the prepared file this load mapped (engine.loading.prepared)
        # One generation or re-placement at a time; the sparse runtime shares the lock so a
        # budget change can tell whether a generation is running.
        self._lock = sparse.lock if sparse is not None else threading.RLock()
        self._cached_ids: list[int] = []
        self.warnings: list[str] = []
        self._token_grammar = None  # built at the first constrained request (token_grammar)
        self._grammar_lock = threading.Lock()  # concurrent first requests build it once
        self._logits_checked = False  # NaN/Inf weights are caught on the first token after a load
        self.kernel_preparation = None  # the CPU kernels compiling in the background (a first start)
        self._kernel_gate = None  # numba_pool.KernelGate: the kernels this engine computes with (None: all)
        self._warmup: _KernelWarmup | None = None  # the cached kernels still loading after `load` returned
        # Rows of the head past the tokenizer's vocabulary (padding) are never sampled.
        self.sampled_vocab = tokenizer.vocab_size if tokenizer.vocab_size < config.vocab_size else None

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, model: str | Path, *, mode: str = "dense", ctx: int | None = None,
             vram_budget: int | None = None, ram_budget: int | None = None,
             device: str | None = None, threads: int | None = None, cpu_weights: str | None = None,
             progress: Progress | None = None, kernels: str = "wait", kernel_progress=None) -> "Engine":
        """`cpu_weights`: the format of the weights on the CPU (int8, int4, fp32); None: int8 in
        the sparse modes, fp32 in dense, which is then the exact reference (the CLI and the
        window pass the user's choice, int8 unless changed). `kernels` "background": where this
        machine has not compiled the CPU kernels yet (a first start), they compile on a thread
        while the engine answers on the torch paths, and come in between two tokens
        (engine.runtime.kernel_preparation; `kernel_preparation` reports progress, and
        `kernel_progress(compiled, total, finished)` is called on the compiling thread after
        each kernel and at the end);
        "wait": they load (or compile: minutes on a first start) on a thread past the load's end,
        and the engine's first computation waits for them (`wait_kernels`)."""
        if mode not in MODES:
            raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
        if cpu_weights is None:
            cpu_weights = "fp32" if mode == "dense" else "int8"
        if cpu_weights not in ("int4", "int8", "fp32"):
            raise UserError(f"unknown CPU weight format {cpu_weights!r}: choose int4, int8 or fp32")
        if kernels not in ("wait", "background"):
            raise ValueError(f"kernels: 'wait' or 'background', not {kernels!r}")
        ctx, threads = check_ctx(ctx), check_threads(threads)
        fused_decode.enabled()  # a bad THERMOCLINE_FUSED_DECODE is refused here, not at the first token
        device = str(resolve_device(device)) if device is not None else None
        if threads:
            torch.set_num_threads(threads)
        model_dir = model_folder(model)
        config = read_config(model_dir)
        check_ctx(ctx)
        notes = []
        if ctx is not None and ctx > config.max_positions:
            notes.append(f"context {ctx} is capped at the {config.max_positions} positions {model_dir.name} "
                         f"was trained on")
        if mode != "dense" and config.activation == "silu":
            # CATS: a SiLU model profiled with --target-sparsity runs sparse at its calibrated
            # thresholds; dense mode stays the model itself
            cats = read_cats(model_dir, config.num_layers)
            if cats is not None:
                config = dataclasses.replace(config, cats_thresholds=cats["thresholds"])
        if not is_sparse(config.activation, config.activation_threshold, config.cats_thresholds):
            if mode != "dense":
                raise UserError(f"{model_dir.name}: {dense_only_words(config)}; load it with --mode dense")
            notes.append(f"{model_dir.name} runs dense: {dense_only_words(config)}")
        ctx = config.context_length(ctx)  # no longer than the model was trained for (as place/fit count)
        check_kv_fits(config, ctx, device)
        tokenizer = Tokenizer(model_dir)
        # Load the CPU kernels' machine code now (numba's disk cache), not in the first token,
        # on a thread while the weights load: numba's first use is mostly Python under the GIL,
        # the weights' reads and copies mostly not.
        from engine.kernels import numba_pool
        from engine.runtime import kernel_preparation as kp

        preparing = None
        if kernels == "background" and numba_pool.module() is not None and not kp.is_cached(kp.kind_of(mode, cpu_weights)):
            preparing = kp.KernelPreparation(mode, cpu_weights, _KernelWarmup.run_prompt, _KernelWarmup.run_all,
                                             on_progress=kernel_progress)
        warm = _KernelWarmup(mode, cpu_weights) if preparing is None else None
        try:
            with numba_pool.gated(preparing.gate if preparing is not None else None):  # the torch paths
                model_obj, cache, runtime, dense_prepared = cls._load_model(
                    model_dir, config, mode, ctx, vram_budget, ram_budget, device, progress, cpu_weights)
        except BaseException:
            if warm is not None:
                warm.join(raise_error=False)  # the load's own error is the one to report
            else:
                preparing.model_loaded(None, None)
            raise
        model_obj.decoder = fused_decode.decode_step  # one compiled call per CPU layer where it can
        model_obj.batch_decoder = fused_batch.decode_batch_step  # and for a batch of sequences (the server)
        model_obj.thread_tuner = thread_tuner.for_this_process()  # a thread count that holds up under load
        if hasattr(runtime, "prompt_kernel"):  # a mixture's prompt: its experts in one compiled call
            runtime.prompt_kernel = fused_decode.moe_prompt
        if preparing is not None:
            layers = model_obj.layers
            scratch = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 2, [la.dtype for la in layers],
                              [la.device for la in layers], config.sliding_window, cpu_16bit=cache.cpu_16bit)
            preparing.model_loaded(model_obj, scratch)
        else:
            # The decode's kernels (from numba's disk cache: ~1 s of its registry work and LLVM
            # relinking on a 2-core host; a first compile: minutes) load on past the load's end,
            # on the warm-up's thread, over a scratch cache of 2 slots; the engine's first
            # computation waits for them (`wait_kernels`), so every token computes on the same
            # kernels as before and the load returns once the weights are in.
            layers = model_obj.layers
            warm.decode_over(model_obj, KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 2,
                                                [la.dtype for la in layers], [la.device for la in layers],
                                                config.sliding_window, cpu_16bit=cache.cpu_16bit))
        engine = cls(model_dir, config, tokenizer, model_obj, cache, mode, ctx,
                     cls.eos_from(model_dir, config, tokenizer), cls.defaults_from(model_dir), sparse=runtime)
        engine.kernel_preparation = preparing
        engine._warmup = warm
        engine._kernel_gate = preparing.gate if preparing is not None else None
        engine.warnings = notes  # things the user should hear about, not errors (the CLI prints them)
        if mode == "dense":
            engine.dense_prepared = dense_prepared
        return engine

    @classmethod
    def _load_model(cls, model_dir, config, mode, ctx, vram_budget, ram_budget, device, progress, cpu_weights):
        """The transformer, its KV cache, the sparse runtime (None in dense mode) and the dense
        mode's mapped prepared file (None elsewhere)."""
        runtime = dense_prepared = None
        if mode in ("sparse", "hybrid", "oracle"):
            # a mixture of experts is placed expert by expert, routed by the model's own router
            load = load_moe if config.is_moe else load_sparse
            parts = load(model_dir, config, mode, ctx, vram_budget, ram_budget, device, progress, cpu_weights)
            model_obj, runtime = parts.model, parts.runtime
            cache = cls.make_cache(config, ctx, parts.layer_devices, parts.layer_dtypes)
            runtime.cache = cache  # a re-placement moves each layer's KV cache with the layer
        else:
            dev = torch.device(device or "cpu")
            # int8/int4 CPU weights: a prepared file mapped, or each layer converted as it loads
            model_obj, dense_prepared = load_dense(model_dir, config, dev, ctx, progress, cpu_weights)
            cache = cls.make_cache(config, ctx, [dev] * config.num_layers,
                                   [model_obj.layers[0].dtype] * config.num_layers)
        return model_obj, cache, runtime, dense_prepared

    @staticmethod
    def make_cache(config: ModelConfig, ctx: int, devices: list[torch.device], dtypes: list[torch.dtype]) -> KVCache:
        return KVCache(config.num_layers, config.num_kv_heads, config.head_dim, ctx, dtypes, devices,
                       config.sliding_window)

    @staticmethod
    def eos_from(model_dir: Path, config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
        eos = set(config.eos_token_ids) | set(tokenizer.stop_ids)  # + the template's end of turn
        if tokenizer.eos_id is not None:
            eos.add(tokenizer.eos_id)
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            try:
                value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                value = None
            if value is not None:
                eos.update(value if isinstance(value, list) else [value])
        return eos

    @staticmethod
    def defaults_from(model_dir: Path) -> dict:
        gen = model_dir / "generation_config.json"
        try:
            data = json.loads(gen.read_text(encoding="utf-8")) if gen.is_file() else {}
        except (OSError, ValueError):
            data = {}
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        return {k: data[k] for k in keys if k in data}

    # --------------------------------------------------------------- a conversation
    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The token ids the model reads for a conversation: its chat template rendered and
        encoded without special tokens (the template writes BOS itself where the model wants
        it). The one count of a conversation: `count_chat`, `fit` (the window, the terminal
        chat) and `stream` (every caller, the server's usage included) all go through it."""
        return self.tokenizer.encode_chat(messages, tools=tools)

    def count_chat(self, messages: list[dict]) -> int:
        return len(self.chat_ids(messages)) if messages else 0

    def fit(self, messages: list[dict], policy: str = "truncate", max_new_tokens: int | None = None,
            previous_drop: int = 0) -> Fitted:
        """What the model will read of `messages` under the context policy (`context_policy`):
        the messages, their count in tokens, how many of the oldest were left out, whether an
        answer has room. `previous_drop`: the last call's `dropped` for the same conversation."""
        return fit_messages(messages, self.count_chat, self.ctx, max_new_tokens, policy, previous_drop)

    # --------------------------------------------------------------- generation
    def encode_prompt(self, prompt: str | list[dict] | list[int], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a text, a conversation (rendered by the chat template, which receives
        `tools`, OpenAI's function definitions, where given) or ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text(prompt, "the prompt"))
        elif prompt and isinstance(prompt[0], dict):
            for m in prompt:
                check_text(m.get("content") if isinstance(m, dict) else m, "a message")
            ids = self.chat_ids(prompt, tools=tools)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise UserError("the prompt is empty")
        if any(i < 0 or i >= self.config.vocab_size for i in ids):
            raise UserError("the prompt has token ids outside the model's vocabulary")
        return ids

    def token_grammar(self):
        """The grammar library's view of this model's tokenizer (engine.runtime.constraints),
        built at the first constrained request."""
        if self._token_grammar is None:
            from engine.runtime.constraints import TokenGrammar

            with self._grammar_lock:  # the server's requests prepare on threads of their own
                if self._token_grammar is None:
                    self._token_grammar = TokenGrammar(self.tokenizer, self.eos_ids)
        return self._token_grammar

    def check_grammar(self, spec) -> None:
        """GrammarError (a UserError) naming the problem when `spec` cannot constrain this model."""
        self.token_grammar().check(spec)

    def swap_in_kernels(self) -> bool:
        """Between tokens: each CPU kernel compiled in the background since the last token
        replaces its torch path from the next computation on. True when the last of them came
        in now (the preparation is over and the engine computes with every kernel)."""
        prep = self.kernel_preparation
        if prep is None:
            return False
        finished = prep.ready()  # read first: once finished, every kernel is compiled
        prep.gate.refresh()
        if not finished:
            return False
        self.kernel_preparation = None
        if prep.error is not None:  # those that compiled stay in; the rest run on the torch paths
            self.warnings.append(f"the fast CPU kernels could not be prepared ({prep.error}); "
                                 "running on the slower torch paths")
            return False
        self._kernel_gate = None
        return True

    def _kernels(self):
        """`with self._kernels():` around each computation: the kernels this engine has taken in
        (the load's warm-up over first, where it still runs)."""
        self.wait_kernels()
        return numba_pool.gated(self._kernel_gate)

    def wait_kernels(self) -> None:
        """Wait for the CPU kernels the load left loading from numba's cache (its warm-up thread);
        raises what that raised. Every computation of the engine calls it first."""
        warm = self._warmup
        if warm is not None:
            self._warmup = None
            warm.join()

    def close(self) -> None:
        """End what the engine runs beside generations (a mixture's prefetch thread); call it
        when the model is unloaded. Idempotent; a generation running now finishes first."""
        with self._lock:
            if self.sparse is not None:
                self.sparse.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the cached conversation."""
        with self._lock:
            self._cached_ids = []
            self.cache.reset(0)

    def stream(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None,
               cancel: threading.Event | None = None, tools: list[dict] | None = None) -> Iterator[TokenEvent]:
        params = params or SamplingParams()
        params.validate()
        outside = [t for t in params.logit_bias if t >= self.config.vocab_size]
        if outside:
            raise UserError(f"logit bias names token {outside[0]}, outside the model's vocabulary "
                            f"of {self.config.vocab_size}")
        ids = self.encode_prompt(prompt, tools)
        if not self.cache.rolling and len(ids) >= self.ctx:
            raise ContextFullError(
                f"the prompt has {len(ids)} tokens but the context holds {self.ctx}; "
                "shorten it, start a new conversation or raise the context length"
            )
        with self._lock:
            yield from self._generate(ids, params, cancel)

    def _generate(self, ids: list[int], params: SamplingParams, cancel: threading.Event | None):
        stats = GenerationStats(prompt_tokens=len(ids), mode=self.mode)
        self.last_stats = stats
        constraint = self.token_grammar().start(params.grammar) if params.grammar is not None else None
        answer = Answer(ids, params, self.tokenizer, self.eos_ids, self.sampled_vocab, constraint,
                        None if self.cache.rolling else self.ctx, cancel)
        if self.sparse is not None:
            self.sparse.begin_generation()
        reuse = min(_common_prefix(self._cached_ids, ids), len(ids) - 1)
        self.cache.reset(reuse)
        self._cached_ids = self._cached_ids[:reuse]
        stats.cached_tokens = reuse
        start = time.perf_counter()
        self.swap_in_kernels()
        with self._kernels():
            logits = self._prefill(ids, reuse, cancel)
        if logits is None:  # stopped while reading the prompt: nothing was generated
            stats.finish_reason = "cancelled"
            stats.ttft_s = time.perf_counter() - start
            self._fill_memory_stats(stats)
            self.last_text, self.last_token_ids = "", []
            return
        self._check_finite(logits[-1])
        prefill_done = time.perf_counter()
        stats.ttft_s = prefill_done - start
        stats.prefill_tok_s = (len(ids) - reuse) / max(stats.ttft_s, 1e-9)
        try:
            while True:
                events, token = answer.take(logits[-1])
                yield from events
                if token is None:
                    break
                self.swap_in_kernels()
                with self._kernels():
                    if self.sparse is not None:
                        self.sparse.at_token_boundary()
                    logits = self.model.forward(torch.tensor([token]), len(answer.history) - 1, self.cache)
                self._cached_ids.append(token)
        finally:
            end = time.perf_counter()
            stats.finish_reason = answer.finish_reason or "length"  # None: the caller closed the stream early
            stats.new_tokens = len(answer.generated)
            decode_steps = max(len(answer.generated) - 1, 0)
            stats.decode_tok_s = decode_steps / (end - prefill_done) if decode_steps and end > prefill_done else 0.0
            self._fill_memory_stats(stats)
            self.last_text = answer.emitted
            self.last_token_ids = answer.generated

    def _check_finite(self, logits: torch.Tensor) -> None:
        """Once per load: weights holding NaN or Inf (a damaged or badly converted checkpoint)
        give NaN logits, which would sample garbage or nothing at all without a word."""
        if self._logits_checked:
            return
        # -inf for a token can be a deliberate mask; NaN, +inf or no finite score at all cannot.
        broken = bool(torch.isnan(logits).any() or torch.isposinf(logits).any()
                      or not torch.isfinite(logits).any(dim=-1).all())
        if broken:
            self.cache.reset(0)
            self._cached_ids = []
            raise ModelFormatError(
                f"{self.model_dir.name} computed NaN or infinite scores on its first token: its weights are "
                "broken (NaN/Inf values, or a failed conversion); download or convert the model again")
        self._logits_checked = True

    def _prefill(self, ids: list[int], reuse: int, cancel: threading.Event | None) -> torch.Tensor | None:
        """Read the prompt from position `reuse` on, in chunks of about PREFILL_CHUNK tokens so a
        stop lands between chunks; None when `cancel` was set (the cache keeps what was read)."""
        new = len(ids) - reuse
        chunks = max(1, -(-new // PREFILL_CHUNK))
        bounds = [reuse + new * i // chunks for i in range(chunks + 1)]  # even sizes: none of 1 token
        logits = None
        for lo, hi in zip(bounds, bounds[1:]):
            if cancel is not None and cancel.is_set():
                return None
            logits = self.model.forward(torch.tensor(ids[lo:hi]), lo, self.cache)
            self._cached_ids = list(ids[:hi])
        if cancel is not None and cancel.is_set():
            return None
        return logits

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None,
                 cancel: threading.Event | None = None, tools: list[dict] | None = None) -> GenerationResult:
        text = "".join(event.text for event in self.stream(prompt, params, cancel, tools))
        return GenerationResult(text, list(self.last_token_ids), self.last_stats)

    # -------------------------------------------------------------- inspection
    def _fill_memory_stats(self, stats: GenerationStats) -> None:
        mem = self.memory()
        stats.vram_bytes, stats.ram_bytes, stats.device = mem["vram_bytes"], mem["ram_bytes"], mem["device"]
        if self.sparse is not None:
            stats.ffn_active_fraction, stats.hot_hit_fraction = self.sparse.generation_fractions()
            stats.cache_hit_fraction, stats.disk_read_bytes_per_token = self.sparse.disk_fractions(
                stats.prompt_tokens - stats.cached_tokens + stats.new_tokens)

    def memory(self) -> dict:
        """Bytes of weights and KV cache per tier, as allocated."""
        if self.sparse is not None:
            return self.sparse.memory()
        m = self.model
        total = sum(t.numel() * t.element_size() for t in (m.embed, m.final_norm.weight)) + m.head_nbytes
        total += sum(layer.dense_nbytes + layer.ffn.nbytes for layer in m.layers) + self.cache.nbytes
        on_gpu = m.layers[0].device.type != "cpu"
        return {"vram_bytes": total if on_gpu else 0, "ram_bytes": 0 if on_gpu else total,
                "device": str(m.layers[0].device)}

    @torch.inference_mode()
    def score(self, token_ids: list[int], mode: str | None = None) -> torch.Tensor:
        """Logits [T, vocab] for a whole sequence (teacher forcing) under `mode`."""
        mode = mode or self.mode
        with self._lock:
            self.swap_in_kernels()
            with self._kernels():
                return self._score(token_ids, mode)

    def _score(self, token_ids: list[int], mode: str) -> torch.Tensor:
        self._cached_ids = []
        self.cache.reset(0)
        ids = torch.tensor(token_ids)
        if mode == "dense" or self.sparse is None:
            if mode != "dense":
                raise UserError(f"mode {mode} needs the engine loaded in a sparse mode")
            logits = self.model.forward(ids, 0, self.cache, all_logits=True)
        else:
            with self.sparse.scoring(mode):
                logits = self.model.forward(ids, 0, self.cache, all_logits=True)
        self._check_finite(logits)
        return logits

    def set_budgets(self, vram: int | None = None, ram: int | None = None):
        if self.sparse is None:
            raise UserError("budgets apply to the sparse and hybrid modes; load the model with --mode hybrid")
        with self._kernels():
            return self.sparse.set_budgets(vram, ram)


# Warm-ups still running. A process that ends right after a load (a CLI command, a bench
# worker) waits for them at exit: a daemon thread cut off inside numba's compiler or its
# thread pool aborted the interpreter ("terminate called without an active exception").
_WARMUPS: set = set()


@atexit.register
def _finish_warmups() -> None:
    for warm in list(_WARMUPS):
        warm.join(raise_error=False)


class _KernelWarmup:
    """The CPU kernels a prompt of the load's mode and weight format runs, loaded on a thread
    (numba's disk cache; a first compile takes minutes) while the weights load: numba's first
    use is mostly Python under the GIL (0.37 s of it refreshing its registries, once a
    process), the weights' reads mostly not. The decode's own kernels load after the weights
    (engine.runtime.fused_decode.warm); where the decode cannot be fused, `run_all` then loads
    every kernel the unfused path may run. `join` waits for the thread and raises what it raised."""

    def __init__(self, mode: str, cpu_weights: str):
        # The kernel modules load here, not on the thread: two threads importing the same
        # modules at once can see them half initialised.
        numba_pool.kernels()
        self._error: BaseException | None = None
        self._decode: tuple | None = None  # (model, scratch cache) once loaded, or (None, None)
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(mode, cpu_weights),
                                        name="thermocline-kernel-warmup", daemon=True)
        _WARMUPS.add(self)
        self._thread.start()

    def decode_over(self, model, cache=None) -> None:
        """After the prompt's kernels, the decode's (fused_decode.warm over `cache`, a scratch one
        the engine never reads; the unfused decode's kernels where it is not fused); None: no more."""
        self._decode = (model, cache)
        self._loaded.set()

    def _run(self, mode: str, cpu_weights: str) -> None:
        behind: list = []  # set aside by fused_decode.warm, for compile_behind
        try:
            self.run_prompt(mode, cpu_weights)
            self._loaded.wait()
            model, cache = self._decode
            if model is not None and not fused_decode.warm(model, cache, keep=False, behind=behind):
                self.run_all(mode, cpu_weights)
            for functions, calls in behind:  # after run_all: numba loads no kernel while it compiles
                fused_decode.compile_behind(functions, calls)
            behind.clear()
        except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
            self._error = exc
        finally:
            for functions, _ in behind:  # this load failed: the next one sets them aside again
                numba_pool.compiling_behind.difference_update(functions)
            _WARMUPS.discard(self)

    @staticmethod
    def run_prompt(mode: str, cpu_weights: str) -> None:
        """What a prompt runs: the products of the attention (int8, fp32: cpu; int4: cpu_q4x8's
        packed matrices) and, in the sparse modes, the FFN's gathered rows. Loading all of
        `run_all`'s kernels instead took the bench model's sparse int8 load 0.3-0.4 s more, for
        14 kernels of which the first prompt and the fused decode then ran 2."""
        sparse = mode != "dense"
        cpu_kernels.warmup_prompt(cpu_weights, sparse)
        if cpu_weights == "int4":
            cpu_q4.warmup(sparse=sparse, decode=False)  # its many-token product: unpacked rows
            cpu_q4x8.warmup()

    @staticmethod
    def run_all(mode: str, cpu_weights: str) -> None:
        """Every kernel of the mode and format, the unfused decode's included."""
        quants = () if mode == "dense" else tuple({cpu_weights, "fp32"} & set(cpu_kernels.QUANTS))
        cpu_kernels.warmup(quants=quants)
        if cpu_weights == "int4":
            cpu_q4.warmup()
            q4_tiles.warmup()
            cpu_q4x8.warmup()

    def join(self, raise_error: bool = True) -> None:
        if not self._loaded.is_set():  # the load failed before it had a model to hand over
            self.decode_over(None)
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error
