"""A decode step of many sequences as one compiled call per CPU layer (engine.kernels.decode_batch)
where every layer has the shape the one-token fused decode computes (engine.runtime.fused_decode)
and every sequence's cache is a plain fp16 or fp32 CPU cache; otherwise `decode_batch_step`
answers None and the batch takes `Transformer.forward_batch`'s unfused path.

The batch kernels are compiled (or loaded from numba's disk cache) on a thread of their own,
which the first `Batch` starts (`prepare`): until they are in, batched steps take the unfused
path, so the first concurrent requests a server takes never wait for a compile. A first start's
kernel preparation (engine.runtime.kernel_preparation) does not compile them: a machine's first
`serve` compiles them on that thread (about 45 s on 2 busy cores), later starts load them.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import numpy as np
import torch

from engine.kernels import cpu_q4, numba_pool
from engine.runtime import fused_decode

# A step whose layers and head hold fewer bytes than this runs its kernels on one thread. It
# takes a few milliseconds at most on one (the demo's 20 MB, a step of 8: 1.09 ms; 0.83 on
# two free cores), about a scheduler's time slice: on two threads a descheduled one costs it
# that slice (4.87 ms with one core busy), and a server's clients and event loop keep taking
# a core. bench.serve on the demo, 8 streams, alternating (2-core AMD EPYC): 1,412-1,592
# tok/s on one thread against 947-1,432 on two (six pairs), then, the host quieter,
# 1,656-1,944 against 1,299-1,934 (four pairs, mean +7%); one stream unchanged. A 7B-shaped
# step (about 0.5 GB, 60 ms) is bound by memory and gains from every thread.
ONE_THREAD_STEP_BYTES = 32 << 20

_ready = threading.Event()  # the batch kernels are in this process
_tried = threading.Event()  # the warm-up thread has ended (in, or not)
_started = False
_start_lock = threading.Lock()
_module = None  # engine.kernels.decode_batch once imported


def _kernels():
    """(decode_layer, decode_batch) where the calling thread may launch the batch functions, else None."""
    dl = fused_decode.kernels()
    if dl is None or not _ready.is_set() or not numba_pool.usable(_module.decode_layer_batch,
                                                                  _module.decode_head_batch):
        return None
    return dl, _module


def ready() -> bool:
    return _ready.is_set()


def wait_ready(timeout: float | None = None) -> bool:
    """Wait for the batch kernels (tests, the bench's warm-up); False when they did not come in."""
    _tried.wait(timeout)
    return _ready.is_set()


def prepare(model, scratch_cache) -> bool:
    """Start compiling (or loading) the batch kernels on a thread, once per process, over this
    model's layer 0 and head (their argument types are those of every model the fused decode
    runs) and `scratch_cache()`, a KV cache of 2 slots of the model's layer kinds that nothing
    else reads. Returns whether they are in or coming; False where the model is not one the
    fused decode runs (a later batch of another model may start them)."""
    global _started
    if not fused_decode.enabled() or fused_decode.kernels() is None or not model.layers:
        return False
    with _start_lock:
        if _started:
            return True
        _started = True
        _tried.clear()
    thread = threading.Thread(target=_warm, args=(model, scratch_cache), name="thermocline-batch-kernels",
                              daemon=True)
    thread.start()
    return True


def warm_now(model, cache) -> bool:
    """Compile (or load) the batch kernels on this thread over layer 0 and the head; position 0
    of `cache` is written. Returns whether they are in."""
    global _module
    dl = fused_decode.module()
    if dl is None:
        return False
    from engine.kernels import decode_batch  # numba at import: only where it runs

    cpu = torch.device("cpu")
    table = model.rotary.get(cpu)
    plan = fused_decode._build_layer(dl, model, 0, model.layers[0], cache)
    head = fused_decode._build_head(dl, model)
    caches = (_cache_arrays(model, [cache]) or [None])[0]
    if plan.args is None or plan.moe is not None or head.args is None or table is None or caches is None:
        return False
    a, c = plan.args, fused_decode.ATTENTION_CACHE
    x = np.zeros((1, model.config.hidden_size), dtype=np.float32)
    with numba_pool.lock:
        threads = numba_pool.use_threads(numba_pool.module())
        decode_batch.decode_layer_batch(x, np.zeros(1, dtype=np.int64), threads, table.cos.numpy(), table.sin.numpy(),
                                        0.0, *a[:c], *caches, *a[c + 3:], np.zeros((1, 2), dtype=np.int64))
        decode_batch.decode_head_batch(x, threads, *head.args)
    _module = decode_batch
    _ready.set()
    return True


def _warm(model, scratch_cache) -> None:
    global _started
    try:
        if not warm_now(model, scratch_cache()):
            _started = False  # not this model: a batch of another may start them
    except Exception as e:  # noqa: BLE001 - the unfused batched path still runs
        warnings.warn(f"batched fused decode unavailable ({e}); batches take the unfused path", RuntimeWarning,
                      stacklevel=2)
    finally:
        _tried.set()


_layouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # KVCache -> (its tensors, _layout's answer)


def _layout(model, cache) -> tuple | None:
    """(k addresses [L], v addresses [L], fp16 [L], slots) of every layer's cache tensors, or None
    where a layer's is not a plain contiguous fp16 or fp32 CPU cache of the model's attention shape.
    Kept for the cache's life while its tensors are the same objects (a batch's caches never
    move; the engine's own may, with its layers)."""
    tensors = cache.k + cache.v
    known = _layouts.get(cache)
    if known is not None and all(a is b for a, b in zip(known[0], tensors)):
        return known[1]
    cfg = model.config
    n = len(cache.k)
    k_addr, v_addr, half = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.bool_)
    slots = cache.k[0].shape[1] if n else 0
    found = (k_addr, v_addr, half, slots)
    for index, (k, v) in enumerate(zip(cache.k, cache.v)):
        if (cache.rolling or k.device.type != "cpu" or k.dtype != v.dtype
                or k.dtype not in (torch.float16, torch.float32) or not k.is_contiguous() or not v.is_contiguous()
                or k.shape != v.shape or k.shape != (cfg.num_kv_heads, slots, cfg.head_dim)):
            found = None
            break
        k_addr[index], v_addr[index], half[index] = k.data_ptr(), v.data_ptr(), k.dtype == torch.float16
    _layouts[cache] = (tensors, found)
    return found


_last_arrays: tuple[list, list[tuple] | None] | None = None  # the last step's layouts and _cache_arrays' answer


def _cache_arrays(model, caches) -> list[tuple] | None:
    """Per layer, (k addresses [B], v addresses [B], slots [B], fp16) of the caches, or None
    where one is not a plain cache (`_layout`) or the caches' formats differ. The last answer
    is kept while the step's caches keep their layouts (a batch's sequences change only when
    one joins or ends): restacking them took a tenth of the engine's Python under 8 streams."""
    global _last_arrays
    layouts = [_layout(model, c) for c in caches]
    if any(lay is None for lay in layouts):
        return None
    last = _last_arrays
    if last is not None and len(last[0]) == len(layouts) and all(a is b for a, b in zip(last[0], layouts)):
        return last[1]
    k_addr, v_addr, half = (np.stack([lay[i] for lay in layouts]) for i in range(3))
    arrays = None
    if (half == half[:1]).all():
        slots = np.array([lay[3] for lay in layouts], dtype=np.int64)
        arrays = [(np.ascontiguousarray(k_addr[:, i]), np.ascontiguousarray(v_addr[:, i]), slots, bool(half[0, i]))
                  for i in range(k_addr.shape[1])]
    _last_arrays = (layouts, arrays)
    return arrays


def decode_batch_step(model, ids: torch.Tensor, positions: list[int], caches: list,
                      heads: list[int] | None = None) -> torch.Tensor | None:
    """Logits [len(heads), vocab] of rows `heads` (None: all) of R tokens (ids [R], row b's token
    at positions[b] of caches[b]), every layer in one compiled call for all of them; None
    (nothing done) where the model, the switch, a cache or the kernels' readiness needs the
    unfused path. Rows may share a cache (a prompt's piece: consecutive positions): a layer
    writes every row's keys and values before any row attends, so each row sees the rows before
    it, as a prompt's tokens decoded one by one."""
    if model.ffn_observer is not None or not fused_decode.enabled():
        return None
    both = _kernels()
    if both is None:
        return None
    dl, db = both
    table = model.rotary.get(torch.device("cpu"))
    if table is None or table.cos.dtype != torch.float32:
        return None
    arrays = _cache_arrays(model, caches)
    if arrays is None:
        return None
    plans = []
    for index, layer in enumerate(model.layers):
        plan = fused_decode.layer_plan(dl, model, index, layer, caches[0], batched=True)
        if plan.args is None or plan.moe is not None:
            return None
        if plan.sparse:
            hooks = layer.ffn.context._hooks
            if hooks.scoring_mode is not None or hooks.override_masks is not None:
                return None
        plans.append(plan)
    head = fused_decode.head_plan(dl, model)
    if head.args is None:
        return None
    if (head.q4 or any(p.q4 for p in plans)) and not cpu_q4.int8_activations(numba_pool.module()):
        return None
    for cache, pos in zip(caches, positions):
        cache.prepare(pos, 1)
    if max(positions) >= table.cos.shape[0]:
        table.at(max(positions), 1)  # grows the table
    cos, sin = table.cos.numpy(), table.sin.numpy()
    X = fused_decode.embedded_rows(model, ids)
    small = sum(_weight_bytes(p) for p in (*plans, head)) < ONE_THREAD_STEP_BYTES
    with numba_pool.running_threads(1) if small else contextlib.nullcontext():
        return _run_layers_and_head(db, model, plans, head, arrays, X, positions, heads, cos, sin)


def _weight_bytes(plan: fused_decode.FusedLayer) -> int:
    """Bytes of a layer's or the head's arrays (a batched plan holds no KV cache), once a plan."""
    if plan.weight_bytes is None:
        plan.weight_bytes = sum(a.nbytes for a in plan.args if isinstance(a, np.ndarray))
    return plan.weight_bytes


def _run_layers_and_head(db, model, plans, head, arrays, X, positions, heads, cos, sin) -> torch.Tensor:
    pos = np.asarray(positions, dtype=np.int64)
    counts = np.zeros((len(positions), 2), dtype=np.int64)
    c = fused_decode.ATTENTION_CACHE
    kern = numba_pool.module()
    for layer, plan, cache_args in zip(model.layers, plans, arrays):
        pthr = layer.ffn.context.threshold if plan.sparse else 0.0
        a = plan.args
        with numba_pool.lock:
            db.decode_layer_batch(X, pos, numba_pool.use_threads(kern), cos, sin, float(pthr), *a[:c], *cache_args,
                                  *a[c + 3:], counts)
        plan.calls += 1
        if plan.sparse:
            counters = layer.ffn.context.counters
            counters.considered += plan.n_ff * len(positions)
            counters.computed = counters.computed + int(counts[:, 0].sum())
            hot = int(counts[:, 1].sum())
            if hot:
                counters.computed_hot = counters.computed_hot + hot
    if heads is not None:
        X = np.ascontiguousarray(X[heads])
    with numba_pool.lock:
        logits = db.decode_head_batch(X, numba_pool.use_threads(kern), *head.args)
    head.calls += 1
    return torch.from_numpy(logits)
