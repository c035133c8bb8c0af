"""Sparse FFN over the cold (CPU) rows: the public entry points.

    rows = CpuFfnRows.from_dense(gate, up, down_t, quant="int8")   # or "fp32"
    y = sparse_ffn(x, rows, active, "relu")                        # fp32 [d]

The fast path is the numba kernel of `cpu_numba` (multithreaded over rows, reads only the
selected rows in place); without numba, or with THERMOCLINE_NO_NUMBA=1, the same call runs
the pure-torch reference (`reference.sparse_ffn`), which gathers rows and is slower but
gives the same result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.cpu_formats import predictor_cpu_format
from engine.kernels import host_memory
from engine.kernels import numba_pool, reference
from engine.kernels.call_args import (
    FfnRowsShape,
    as_numpy,
    check_ffn_call,
    check_predicted_call,
    id_array,
    predicted_in_torch,
)
from engine.kernels.cpu_quant import dequantize_rows_int8, quantize_rows_int8

QUANTS = ("int8", "fp32")

# The numba state is shared with cpu_quant and cpu_q4 (numba_pool); the short names stay for this module's calls.
_lock = numba_pool.lock
_kernels = numba_pool.kernels
_use_threads = numba_pool.use_threads
available = numba_pool.available
num_threads = numba_pool.num_threads
set_num_threads = numba_pool.set_num_threads


@dataclass(eq=False, frozen=True)
class CpuFfnRows(FfnRowsShape):
    """One layer's FFN rows (or a subset of its neurons) in the CPU kernels' storage.

    `quant` "fp32": gate/up/down_t fp32 [n, d], scales None.
    `quant` "int8": gate/up/down_t int8 [n, d] and *_scale fp32 [n] (row = q * scale).
    `gate` is None for ungated FFNs. All tensors are contiguous CPU tensors; the kernel
    reads them through numpy views that share their memory.
    """

    gate: torch.Tensor | None
    up: torch.Tensor
    down_t: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    quant: str = "fp32"

    def __post_init__(self):
        if self.quant not in QUANTS:
            raise ValueError(f"unknown quant {self.quant!r}; expected one of {QUANTS}")
        dtype = torch.int8 if self.quant == "int8" else torch.float32
        n, d = self.up.shape
        for name in ("gate", "up", "down_t"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.shape != (n, d) or t.dtype != dtype or not t.is_contiguous() or t.is_cuda:
                raise ValueError(f"{name}: expected contiguous CPU {dtype} [{n}, {d}], "
                                 f"got {t.dtype} {tuple(t.shape)}")
        scales = ("up_scale", "down_scale") + (("gate_scale",) if self.gate is not None else ())
        for name in scales:
            s = getattr(self, name)
            if self.quant == "int8" and (s is None or s.shape != (n,) or s.dtype != torch.float32):
                raise ValueError(f"{name}: int8 rows need an fp32 [{n}] scale")
        object.__setattr__(self, "_np", None)  # numpy views for the kernel, built on use

    @classmethod
    def from_dense(cls, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor,
                   quant: str = "int8") -> "CpuFfnRows":
        """Copy float rows [n, d] (any float dtype, any device) into the kernel's storage
        (on huge pages where the OS has them: the kernels read rows at random)."""
        if quant == "int8":
            def quantize(t):
                if t is None:
                    return None, None
                return quantize_rows_int8(t, out_q=host_memory.empty(t.shape, torch.int8))

            (gq, gs), (uq, us), (dq, ds) = quantize(gate), quantize(up), quantize(down_t)
            return cls(gq, uq, dq, gs, us, ds, quant="int8")
        if quant == "fp32":
            def copy(t):
                return host_memory.copy_of(t.to("cpu"), torch.float32) if t is not None else None
            return cls(copy(gate), copy(up), copy(down_t), quant="fp32")
        raise ValueError(f"unknown quant {quant!r}; expected one of {QUANTS}")

    @property
    def dim(self) -> int:
        return self.up.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes actually held (rows and scales)."""
        ts = (self.gate, self.up, self.down_t, self.gate_scale, self.up_scale, self.down_scale)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def select(self, neuron_ids: torch.Tensor) -> "CpuFfnRows":
        """A new CpuFfnRows holding copies of rows `neuron_ids` (in that order): row j of
        the result is neuron neuron_ids[j] of this one."""
        ids = self.checked_ids(neuron_ids)

        def pick(t):
            return host_memory.gather_rows(t, ids) if t is not None else None

        return CpuFfnRows(pick(self.gate), pick(self.up), pick(self.down_t),
                          pick(self.gate_scale), pick(self.up_scale), pick(self.down_scale),
                          quant=self.quant)

    def dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate, up, down_t) as fp32 tensors (copies for int8; the rows themselves for fp32)."""
        if self.quant == "fp32":
            return self.gate, self.up, self.down_t
        g = dequantize_rows_int8(self.gate, self.gate_scale) if self.gate is not None else None
        return g, dequantize_rows_int8(self.up, self.up_scale), \
            dequantize_rows_int8(self.down_t, self.down_scale)

    def _scales(self):
        return (self.gate_scale, self.up_scale, self.down_scale) if self.quant == "int8" else None

    def _numpy_views(self):
        if self._np is None:
            empty = np.empty(0, dtype=np.float32)
            up = self.up.numpy()
            gate = self.gate.numpy() if self.gate is not None else up
            s = [t.numpy() if t is not None else empty
                 for t in (self.gate_scale, self.up_scale, self.down_scale)]
            object.__setattr__(self, "_np", (gate, s[0], up, s[1], self.down_t.numpy(), s[2]))
        return self._np


_EMPTY_IDS = np.empty(0, dtype=np.int64)
_EMPTY_F32 = np.empty(0, dtype=np.float32)


def _launch(kern, x, rows, idx, pred, pred_ids, pthr, activation, act_threshold, acts, nchunks: int | None = None):
    xn = as_numpy(x, torch.float32)
    gate, gate_s, up, up_s, down, down_s = rows._numpy_views()
    use_idx, use_pred = idx is not None, pred is not None
    k = idx.shape[0] if use_idx else rows.n_neurons
    with _lock:
        nchunks = max(1, min(_use_threads(kern), k)) if nchunks is None else nchunks
        y = kern.ffn_rows(xn, gate, gate_s, up, up_s, down, down_s,
                          idx if use_idx else _EMPTY_IDS, use_idx,
                          pred if use_pred else _EMPTY_F32,
                          pred_ids if pred_ids is not None else _EMPTY_IDS, use_pred,
                          pred_ids is not None, float(pthr), rows.gated, rows.quant == "int8",
                          kern.ACTIVATION_CODES[activation], float(act_threshold), acts, nchunks)
    return torch.from_numpy(y)


def sparse_ffn(x: torch.Tensor, rows: CpuFfnRows, active: torch.Tensor | None, activation: str,
               act_threshold: float = 0.0, out_acts: torch.Tensor | None = None) -> torch.Tensor:
    """y fp32 [d] = sum over computed neurons i of act_i * row_i(down_t).

    x fp32 [d] (CPU); active int32/int64 [k] ids into `rows` (sorted ascending reads memory
    in order; any order is correct), or None for all rows; activation in relu, fatrelu,
    drelu, relu2 (act_threshold is fatrelu's threshold). out_acts, if given, fp32 [k]
    (or [n] when active is None) receives each computed neuron's activation (0: did not
    fire). Down rows of neurons whose activation is exactly 0 are not read, nor up rows of
    neurons whose gate nonlinearity is 0.
    """
    idx = id_array("active", active) if active is not None else None
    k = rows.n_neurons if active is None else idx.shape[0]
    check_ffn_call(x, rows, activation, out_acts, k)
    kern = _kernels("ffn_rows")
    if kern is None:
        return reference.sparse_ffn(x, rows.gate, rows.up, rows.down_t, active, activation,
                                    act_threshold, out_acts, scales=rows._scales())
    acts = out_acts.numpy() if out_acts is not None else np.empty(k, dtype=np.float32)
    return _launch(kern, x, rows, idx, None, None, 0.0, activation, act_threshold, acts)


def sparse_ffn_predicted(x: torch.Tensor, rows: CpuFfnRows, pred_logits: torch.Tensor,
                         pred_threshold: float, activation: str, act_threshold: float = 0.0,
                         out_acts: torch.Tensor | None = None,
                         row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """As `sparse_ffn` over the rows whose predictor logit >= pred_threshold, selected inside
    the kernel (no separate nonzero pass, no index vector).

    pred_logits fp32: [n_neurons] logits of these rows, or, with row_ids int [n_neurons]
    (row j of `rows` is neuron row_ids[j] of the layer, e.g. the cold subset), the whole
    layer's logits, row j's being pred_logits[row_ids[j]]. out_acts, if given, fp32
    [n_neurons]: the activation of each row, 0 for rows not selected or not firing.
    """
    n = rows.n_neurons
    ids = check_predicted_call(x, rows, activation, out_acts, pred_logits, row_ids)
    kern = _kernels("ffn_rows")
    if kern is None:
        return predicted_in_torch(lambda active, acts: reference.sparse_ffn(
            x, rows.gate, rows.up, rows.down_t, active, activation, act_threshold, acts, scales=rows._scales()),
            pred_logits, ids, pred_threshold, out_acts)
    pred = as_numpy(pred_logits, torch.float32)
    acts = out_acts.numpy() if out_acts is not None else np.empty(n, dtype=np.float32)
    return _launch(kern, x, rows, None, pred, ids, pred_threshold, activation, act_threshold, acts)


def sparse_ffn_batch(xs: torch.Tensor, rows: CpuFfnRows, active: torch.Tensor | None,
                     activation: str, act_threshold: float = 0.0,
                     out_acts: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_ffn` for a few tokens at once (e.g. 2-8): xs fp32 [T, d] -> ys fp32 [T, d].

    `active` is the union of the tokens' active sets (or None for all rows); each selected
    row is read from memory once for all tokens. out_acts, if given, fp32 [T, k] (k = n when
    active is None). Batch 1 decode should call `sparse_ffn`.
    """
    if xs.dim() != 2:
        raise ValueError(f"xs: expected [T, {rows.dim}], got {tuple(xs.shape)}")
    T = xs.shape[0]
    idx = id_array("active", active) if active is not None else None
    k = rows.n_neurons if active is None else idx.shape[0]
    check_ffn_call(xs[0] if T else xs.new_empty(rows.dim), rows, activation, None, k)
    if out_acts is not None and (out_acts.shape != (T, k) or out_acts.dtype != torch.float32
                                 or not out_acts.is_contiguous() or out_acts.is_cuda):
        raise ValueError(f"out_acts: expected contiguous CPU fp32 [{T}, {k}]")
    kern = _kernels("ffn_rows_batch")
    if kern is None or T == 0:
        ys = torch.zeros(T, rows.dim)
        for s in range(T):
            ys[s] = reference.sparse_ffn(xs[s], rows.gate, rows.up, rows.down_t, active,
                                         activation, act_threshold,
                                         out_acts[s] if out_acts is not None else None,
                                         scales=rows._scales())
        return ys
    xn = as_numpy(xs, torch.float32)
    acts = out_acts.numpy() if out_acts is not None else np.empty((T, k), dtype=np.float32)
    gate, gate_s, up, up_s, down, down_s = rows._numpy_views()
    with _lock:
        nchunks = max(1, min(_use_threads(kern), k))
        ys = kern.ffn_rows_batch(xn, gate, gate_s, up, up_s, down, down_s,
                                 idx if idx is not None else _EMPTY_IDS, idx is not None,
                                 rows.gated, rows.quant == "int8",
                                 kern.ACTIVATION_CODES[activation], float(act_threshold),
                                 acts, nchunks)
    return torch.from_numpy(ys)


def sparse_ffn_tokens(xs: torch.Tensor, rows: CpuFfnRows, pred_logits: torch.Tensor | None,
                      pred_threshold: float, activation: str, act_threshold: float = 0.0) -> torch.Tensor:
    """Many tokens (a prefill), each over its own predicted rows: xs fp32 [T, d] ->
    ys fp32 [T, d], token t computing the rows j with pred_logits[t, j] >= pred_threshold
    (pred_logits fp32 [T, n_neurons], or None: every row), as `sparse_ffn_predicted` would
    for that token alone. Each row is read from memory once for all tokens, in its int8
    or fp32 storage: nothing is dequantized. Without numba, torch computes the rows dense
    per block and masks them (the reference)."""
    if xs.dim() != 2 or xs.shape[1] != rows.dim:
        raise ValueError(f"xs: expected [T, {rows.dim}], got {tuple(xs.shape)}")
    T, n = xs.shape[0], rows.n_neurons
    reference.check_activation(activation)
    if pred_logits is not None and tuple(pred_logits.shape) != (T, n):
        raise ValueError(f"pred_logits: expected [{T}, {n}], got {tuple(pred_logits.shape)}")
    q8 = rows.quant == "int8" and int8_activations_available(rows.dim)
    kern = _kernels("ffn_rows")
    if kern is not None and 0 < T and decode_each_token(T, n, pred_logits, pred_threshold):
        # few tokens, or tokens whose predicted rows overlap little: the decode kernel per
        # token reads only each token's rows (4 tokens of a 7B layer, int8: 7 vs 20 ms on one
        # thread, 17 vs 41 ms on two)
        if pred_logits is None:
            return torch.stack([sparse_ffn(xs[t].float(), rows, None, activation, act_threshold)
                                for t in range(T)])
        return torch.stack([sparse_ffn_predicted(xs[t].float(), rows, pred_logits[t].float(), pred_threshold,
                                                 activation, act_threshold) for t in range(T)])
    kern = _kernels(*(("quantize_act_q8", "ffn_rows_tokens_q8") if q8 else ("ffn_rows_tokens",)))
    if kern is None or T == 0 or n == 0:
        ys = torch.zeros(T, rows.dim)
        for lo in range(0, n, _DEQUANT_ROWS):
            hi = min(lo + _DEQUANT_ROWS, n)
            part = rows.select(torch.arange(lo, hi))
            gate, up, down_t = part.dequantized()
            xf = xs.float()
            acts = reference.activations(None if gate is None else xf @ gate.T, xf @ up.T, activation,
                                         act_threshold)
            if pred_logits is not None:
                acts = acts * (pred_logits[:, lo:hi].float() >= pred_threshold)
            ys += acts @ down_t
        return ys
    xn = as_numpy(xs, torch.float32)
    pred = as_numpy(pred_logits, torch.float32) if pred_logits is not None else np.empty((0, 0), np.float32)
    acts = np.empty((n, T), dtype=np.float32)
    gate, gate_s, up, up_s, down, down_s = rows._numpy_views()
    if q8:
        # int8 x int8 (the tokens quantized in blocks, as matmul_int8 does): 200 tokens over
        # a 7B layer's rows at 10% took 0.39 s against 0.91 s converting weights to fp32
        # (one thread, a loaded machine)
        if pred_logits is not None:  # neuron-major: a row's tokens side by side, not 4 * n bytes apart
            pred = np.ascontiguousarray(pred.T)
        xq = np.empty((T, rows.dim), dtype=np.int8)
        xsc = np.empty((T, rows.dim // kern._ACT_BLOCK), dtype=np.float32)
        with _lock:
            kern.quantize_act_q8(xn, xq, xsc)
            nchunks = max(1, min(_DENSE_CHUNKS_PER_THREAD * _use_threads(kern), n))
            ys = kern.ffn_rows_tokens_q8(xq, xsc, gate, gate_s, up, up_s, down, down_s, pred,
                                         float(pred_threshold), pred_logits is not None, rows.gated,
                                         kern.ACTIVATION_CODES[activation], float(act_threshold), acts, nchunks,
                                         _DOWN_SPANS_PER_THREAD * _use_threads(kern))
        return torch.from_numpy(ys)
    with _lock:
        nchunks = max(1, min(_DENSE_CHUNKS_PER_THREAD * _use_threads(kern), n))
        ys = kern.ffn_rows_tokens(xn, gate, gate_s, up, up_s, down, down_s, pred, float(pred_threshold),
                                  pred_logits is not None, rows.gated, rows.quant == "int8",
                                  kern.ACTIVATION_CODES[activation], float(act_threshold), acts, nchunks)
    return torch.from_numpy(ys)


def warmup(quants: tuple[str, ...] = QUANTS, batch: bool = False, dense: bool = True) -> dict:
    """Compile (or load from numba's disk cache) the kernels for the given row storages on
    tiny inputs. A cold compile of both storages took ~25 s on a busy 2-core machine; the
    disk cache (next to the module, else the user cache dir) makes later starts ~1 s, so an
    installer should run this once.

    `batch`: also the small-batch kernel (sparse_ffn_batch); `dense`: the decode products
    (matvec, combine).
    Returns {"seconds": wall time, "cache_hits": n, "compiled": n, "numba": available()}.
    The first call of each specialisation otherwise pays this inside a decode step.
    """
    t0 = time.perf_counter()
    kern = _kernels()
    if kern is None:
        return {"seconds": 0.0, "cache_hits": 0, "compiled": 0, "numba": False}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 8, generator=g)
    x = torch.randn(8, generator=g)
    for quant in quants:
        rows = CpuFfnRows.from_dense(w[0], w[1], w[2], quant=quant)
        sparse_ffn(x, rows, torch.tensor([1, 5]), "relu")
        prompt = torch.randn(_TOKENS_AS_DECODE + 1, 8, generator=g)  # a sparse prefill
        sparse_ffn_tokens(prompt, rows, torch.ones(prompt.shape[0], 8), 0.0, "relu")
        if batch:
            sparse_ffn_batch(w[:2, 0], rows, torch.tensor([1, 5]), "relu")
    if dense:  # directly: matvec/combine leave matrices this small to torch
        wn, xn = w[0].contiguous().numpy(), x.numpy()
        q, scale = quantize_rows_int8(w[0])
        with _lock:
            kern.matvec_rows(wn, xn, 1)
            kern.combine_rows(xn, wn, 1)
            kern.matvec_rows_int8(q.numpy(), scale.numpy(), xn, 1)
        for dtype in _CACHE_VIEWS:  # the KV caches (fp32, 16-bit)
            cache = torch.zeros(1, 4, 8, dtype=dtype)
            decode_attention(torch.randn(2, 8, generator=g), cache, cache, 2, 0.35)
        if int8_activations_available(128):
            rows = CpuFfnRows.from_dense(*torch.randn(3, 8, 128, generator=g), quant="int8")
            sparse_ffn_tokens(torch.randn(_TOKENS_AS_DECODE + 1, 128, generator=g), rows, None, 0.0, "relu")
            wq, ws = quantize_rows_int8(torch.randn(4, 128, generator=g))
            xq = np.zeros((1, 128), dtype=np.int8)
            xs = np.ones((1, 1), dtype=np.float32)
            kern.quantize_act_q8(np.zeros((1, 128), dtype=np.float32), xq, xs)
            kern.matmul_q8(wq.numpy(), ws.numpy(), xq, xs, 1)
            kern.linear_q8(wq.numpy(), ws.numpy(), np.zeros((1, 128), dtype=np.float32), 1)
    fns = ((kern.ffn_rows, kern.quantize_rows_int8) + ((kern.ffn_rows_tokens,) if quants else ())
           + ((kern.ffn_rows_batch,) if batch else ())
           + ((kern.matvec_rows, kern.combine_rows, kern.matvec_rows_int8, kern.decode_attention_cache)
              if dense else ())
           + ((kern.quantize_act_q8, kern.matmul_q8, kern.ffn_rows_tokens_q8, kern.linear_q8)
              if dense and int8_activations_available(128) else ()))
    return {"seconds": time.perf_counter() - t0,
            "cache_hits": sum(sum(f.stats.cache_hits.values()) for f in fns),
            "compiled": sum(sum(f.stats.cache_misses.values()) for f in fns), "numba": True}


def warmup_prompt(quant: str, sparse: bool) -> None:
    """Load (or compile) only the kernels a prompt runs over CPU weights in `quant` where the
    fused decode (engine.runtime.fused_decode, its own warm-up) takes every token after it:
    the products of the attention (and of the dense FFN) over many tokens, and in the sparse
    modes the FFN's rows, one token at a time or many at once (the cost model's choice).
    Anything else loads at its first call (10-60 ms each from numba's disk cache). On the
    bench model (2 layers of 7B shapes, 10% active) a first prompt of 3, 20 or 200 tokens and
    the decode after it loaded no other kernel, where `warmup()`'s fourteen took the load
    0.3-0.4 s longer. int4 weights: cpu_q4 (gathered rows) and cpu_q4x8 (packed matrices)."""
    kern = _kernels()
    if kern is None:
        return
    g = torch.Generator().manual_seed(0)
    d = 128  # a multiple of the activation block: the int8 x int8 kernels
    x = torch.randn(d, generator=g)
    if sparse and quant in QUANTS:  # int4's rows: cpu_q4.warmup
        if quant == "int8":  # rows as the prepared files hold them, with no quantizing kernel
            q = [torch.randint(-127, 128, (8, d), dtype=torch.int8, generator=g) for _ in range(3)]
            rows = CpuFfnRows(q[0], q[1], q[2], torch.ones(8), torch.ones(8), torch.ones(8), quant="int8")
        else:
            rows = CpuFfnRows.from_dense(*torch.randn(3, 8, d, generator=g), quant="fp32")
        sparse_ffn(x, rows, torch.tensor([1, 5]), "relu")
        sparse_ffn_tokens(torch.randn(_TOKENS_AS_DECODE + 1, d, generator=g), rows, None, 0.0, "relu")  # every row
    if quant == "int8" or (sparse and predictor_cpu_format(quant) == "int8"):  # int4's predictors too
        matmul_int8(torch.randn(_TOKENS_AS_DECODE, d, generator=g),
                    torch.randint(-127, 128, (4, d), dtype=torch.int8, generator=g), torch.ones(4))
    elif quant in QUANTS:
        with _lock:
            kern.matvec_rows(torch.randn(8, d, generator=g).numpy(), x.numpy(), 1)


# Up to this many tokens `sparse_ffn_tokens` runs the decode kernel once per token.
_TOKENS_AS_DECODE = 4
# Cost of the many-token kernel per row of the union the tokens select, in units of one
# (token, predicted row) of the decode kernel: a fixed part (reading the row) plus a part
# per token. Measured on a 7B layer's int8 rows, 2 threads (AVX2, rows beyond the L3):
# decode 0.9-1.0 us per (token, row); many-token 2.95 us per union row + 0.135 us per token.
_UNION_ROW_COST = 3.0
_UNION_TOKEN_COST = 1 / 8


def decode_each_token(T: int, n: int, pred_logits: torch.Tensor | None, pred_threshold: float) -> bool:
    """Whether T tokens over n rows run faster as T decode calls, each over its own predicted
    rows, than as one pass over the union of those rows. With unrelated predictions (10% of
    a 7B layer each) 20 tokens select 88% of the rows: 19 ms per token against 55 ms for
    the union; 200 tokens 194 vs 330 ms. Tokens that share their rows favour the union."""
    if T <= _TOKENS_AS_DECODE:
        return True
    if pred_logits is None:
        return False
    selected = pred_logits >= pred_threshold
    union = int(selected.any(0).sum())
    return int(selected.sum()) < union * (_UNION_ROW_COST + _UNION_TOKEN_COST * T)


# Column slices per thread of the int8 prefill's down pass: each slice walks every fired
# row, so fewer, wider slices touch fewer pages (2 per thread: 59 vs 109 ms at 8, 20 tokens).
_DOWN_SPANS_PER_THREAD = 2


# More chunks than threads: a thread that shares its core with another process would
# otherwise hold up the whole product with its fixed half of the rows.
_DENSE_CHUNKS_PER_THREAD = 8


# Below this many weights (1 MB in fp32) the matrix sits in cache and torch's own product,
# with less call overhead, is faster.
_DENSE_MIN_ELEMENTS = 1 << 18


def _dense_operands(vector: torch.Tensor, w: torch.Tensor) -> bool:
    return w.numel() >= _DENSE_MIN_ELEMENTS and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (vector, w))


def matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x fp32 [d] times every row of w fp32 [n, d] -> [n]: a decode step's dense product.
    torch computes it when numba is missing, the operands are not contiguous fp32, or w is small."""
    kern = _kernels("matvec_rows")
    if kern is None or not _dense_operands(x, w):
        return torch.mv(w, x)
    with _lock:
        return torch.from_numpy(kern.matvec_rows(w.numpy(), x.numpy(), _DENSE_CHUNKS_PER_THREAD * _use_threads(kern)))


def matvec_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x fp32 [d] times every row of (q int8 [n, d], scale fp32 [n]) -> fp32 [n]: `matvec`
    over int8 rows. Without numba, torch dequantizes a block of rows at a time."""
    kern = _kernels("matvec_rows_int8")
    if kern is None:
        out = torch.empty(q.shape[0], dtype=torch.float32)
        for lo in range(0, q.shape[0], _DEQUANT_ROWS):
            hi = min(lo + _DEQUANT_ROWS, q.shape[0])
            out[lo:hi] = torch.mv(dequantize_rows_int8(q[lo:hi], scale[lo:hi]), x)
        return out
    with _lock:
        return torch.from_numpy(kern.matvec_rows_int8(q.numpy(), scale.numpy(), as_numpy(x, torch.float32),
                                                      _DENSE_CHUNKS_PER_THREAD * _use_threads(kern)))


def int8_activations_available(d: int) -> bool:
    """Whether `matmul_int8` runs int8 x int8 (AVX2 host, numba, d a multiple of the
    activation block) rather than returning None, on this host (whatever the calling thread's
    kernel gate: a capability, which choices of storage depend on)."""
    kern = numba_pool.module()
    return kern is not None and kern.HAS_AVX2 and d % kern._ACT_BLOCK == 0 and d > 0


def matmul_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x fp32 [T, d] times every row of (q int8 [n, d], scale fp32 [n]) -> fp32 [T, n], with
    x quantized to int8 in blocks (llama.cpp's Q8_0 scheme): int8 products, about twice the
    rows per second of `matvec_int8`, and a many-token product that reads each row once
    instead of dequantizing the matrix. None where it cannot run (no AVX2 or numba, d not a
    multiple of the block, fewer than 4 rows; on a first start, until the kernel is compiled):
    the caller takes another path."""
    n, d = q.shape
    if n < 4 or not int8_activations_available(d) or not q.is_contiguous() or not scale.is_contiguous():
        return None
    kern = _kernels("linear_q8")
    if kern is None:
        return None
    xn = as_numpy(x, torch.float32)
    with _lock:  # quantize and multiply in one call: one Python transition per product
        return torch.from_numpy(kern.linear_q8(q.numpy(), scale.numpy(), xn,
                                               _DENSE_CHUNKS_PER_THREAD * _use_threads(kern)))


# Rows dequantized at a time where torch computes over int8 rows: bounds the fp32 copy.
_DEQUANT_ROWS = 2048


def combine(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i a[i] * w[i] for a fp32 [n] and w fp32 [n, d] -> [d] (every row, dense)."""
    kern = _kernels("combine_rows")
    if kern is None or not _dense_operands(a, w):
        return a @ w
    with _lock:
        return torch.from_numpy(kern.combine_rows(a.numpy(), w.numpy(), _DENSE_CHUNKS_PER_THREAD * _use_threads(kern)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query token over positions 0..length-1: q fp32 [H, hd],
    k_cache/v_cache [kv_heads, slots, hd] (a layer's whole cache, fp16 or fp32; query head h
    reads kv head h // (H // kv_heads)) -> fp32 [H, hd]. A contiguous CPU cache goes through
    one numba call (no fp32 copy of an fp16 cache); otherwise torch's batched products."""
    H, hd = q.shape
    kvh = k_cache.shape[0]
    kern = _kernels("decode_attention_cache")
    if (kern is not None and k_cache.dtype in _CACHE_VIEWS and v_cache.dtype == k_cache.dtype
            and k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
            and 0 < length <= k_cache.shape[1] and H % kvh == 0):
        view = _CACHE_VIEWS[k_cache.dtype]
        out = np.empty((H, hd), dtype=np.float32)
        with _lock:
            _use_threads(kern)
            kern.decode_attention_cache(as_numpy(q, torch.float32), k_cache.view(view).numpy(),
                                        v_cache.view(view).numpy(), int(length), float(scale), out)
        return torch.from_numpy(out)
    qg = q.float().reshape(kvh, H // kvh, hd)
    keys, values = k_cache[:, :length].float(), v_cache[:, :length].float()
    scores = torch.softmax(torch.bmm(qg, keys.transpose(1, 2)) * scale, dim=-1)
    return torch.bmm(scores, values).reshape(H, hd)


# Cache dtypes the attention kernel reads, and the dtype numba sees them as (it has no fp16).
_CACHE_VIEWS = {torch.float16: torch.int16, torch.float32: torch.float32}
