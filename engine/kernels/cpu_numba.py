"""numba row kernels for the cold (CPU) partition of the sparse FFN.

Importing this module needs numba; `engine.kernels.cpu` imports it lazily and falls back to
the pure-torch reference when it is missing or disabled. All jitted code lives in this one
file on purpose: numba's on-disk cache is invalidated by the timestamp of the file that
defines a function, so helpers kept elsewhere could go stale in the cache.

`ffn_rows` computes, for the rows selected by `idx`, by predictor logits >= a threshold
(selection fused into the kernel: no separate nonzero pass), or all rows, in three passes
per chunk of rows (one chunk per thread, thread-private partial sums, no atomics):
  A. gate rows: the gate nonlinearity per neuron (for ungated FFNs: up rows, final act);
  B. up rows, only of neurons whose gate is nonzero: act = nonlin(g) * u;
  C. down rows, only of neurons whose act is nonzero: part[chunk] += act * down_t[i].
Splitting the passes means every row read is one we know we need, so rows a few ahead
can be software-prefetched (into L2) while the current one is consumed (rows are 4-20 KB
at random places, each a new stream for the hardware prefetcher). Rows are read in place,
never copied out.
int8 rows carry one fp32 scale per row: the dot runs on the raw int8 values (converted to
fp32 in registers) and is scaled once per row. `ffn_rows_batch` does the same for a few
tokens at once; `quantize_rows_int8` builds int8 rows.
"""

from __future__ import annotations

import os

import numba  # noqa: F401 - read as kern.numba (numba_pool: the thread count)
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from engine.activations import CODES as ACTIVATION_CODES
from engine.kernels import numba_jit

# The activation codes the kernels branch on (engine.activations, their one home); numba reads
# these globals as compile-time constants.
_RELU, _FATRELU, _DRELU, _RELU2, _SILU = (ACTIVATION_CODES[n] for n in ("relu", "fatrelu", "drelu", "relu2", "silu"))

# Elements per inner block: the dot keeps vector accumulators inside a block of constant
# trip count (a variable one stops LLVM vectorising) and issues the prefetches of the row
# ahead once per block.
_BLOCK = 256
_CACHE_LINE = 64
# How far ahead rows are prefetched, in bytes of rows: one 4 KB int8 row ahead left the
# kernel waiting on memory; about 12 KB ahead (3 int8 rows of 4096, 2 of 5120, one fp32
# row) streamed random rows fastest on a 2-core EPYC (bench.ffn).
_PREFETCH_AHEAD_BYTES = 12288


_njit = numba_jit.njit


@intrinsic
def _prefetch_row(typingctx, rows, i, j):
    """Prefetch the line holding rows[i, j] into L2 (x86 prefetcht1).

    Into L2, not L1: an L1 prefetch holds one of the core's few L1 miss buffers until the
    line arrives, which capped random 4 KB rows at about 12 GB/s on two EPYC cores; L2
    prefetches keep more lines in flight (about 17 GB/s), and the demand loads then hit L2.
    """
    sig = types.void(rows, i, j)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        arr = context.make_array(arrty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arrty, arr, [args[1], args[2]],
                                       wraparound=False)
        prefetch_line(builder, ptr, locality=2)
        return context.get_dummy_value()

    return sig, codegen


def prefetch_line(builder, ptr, locality: int) -> None:
    """A read prefetch of the line at ptr (a hint: never faults); locality 3 into L1, 2 into L2."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    # the intrinsic's name is mangled by pointer type: opaque `ptr` (LLVM >= 15 as
    # llvmlite >= 0.45 emits it) or typed `i8*` (older llvmlite)
    suffix = "p0" if str(i8p) == "ptr" else "p0i8"
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch." + suffix)
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(locality), i32(1)])


@_njit(inline="always")
def _prefetch_span(w, i, lo, hi):
    """Prefetch the lines of w[i, lo:hi] (nothing when i < 0)."""
    if i >= 0:
        for j in range(lo, hi, _CACHE_LINE // w.itemsize):
            _prefetch_row(w, i, j)


@_njit(inline="always", fastmath=True)
def _row_dot(w, i, x, ahead):
    """w[i] . x in fp32; prefetches row `ahead` (if >= 0) at the same offsets meanwhile."""
    d = x.shape[0]
    nfull = d // _BLOCK
    s = np.float32(0.0)
    for b in range(nfull):
        jb = b * _BLOCK
        _prefetch_span(w, ahead, jb, jb + _BLOCK)
        p = np.float32(0.0)
        for j in range(_BLOCK):
            p += np.float32(w[i, jb + j]) * x[jb + j]
        s += p
    _prefetch_span(w, ahead, nfull * _BLOCK, d)
    for j in range(nfull * _BLOCK, d):
        s += np.float32(w[i, j]) * x[j]
    return s


@_njit(inline="always", fastmath=True)
def _row_axpy(part, c, a, w, i, ahead):
    """part[c] += a * w[i]; prefetches row `ahead` (if >= 0) meanwhile."""
    d = part.shape[1]
    nfull = d // _BLOCK
    for b in range(nfull):
        jb = b * _BLOCK
        _prefetch_span(w, ahead, jb, jb + _BLOCK)
        for j in range(_BLOCK):
            part[c, jb + j] += a * np.float32(w[i, jb + j])
    _prefetch_span(w, ahead, nfull * _BLOCK, d)
    for j in range(nfull * _BLOCK, d):
        part[c, j] += a * np.float32(w[i, j])


@_njit(inline="always")
def _rows_ahead(w):
    """How many rows of w the passes prefetch ahead of the one they compute."""
    return max(1, _PREFETCH_AHEAD_BYTES // (w.shape[1] * w.itemsize))


@_njit(inline="always", fastmath=True)
def _nonlinearity(g, code, thr):
    if code == _SILU:  # SwiGLU; a CATS threshold zeroes the small magnitudes
        s = g / (np.float32(1.0) + np.exp(-g))
        return np.float32(0.0) if thr > 0.0 and abs(s) < thr else s
    if code == _FATRELU:
        return g if g >= thr else np.float32(0.0)
    r = g if g > 0.0 else np.float32(0.0)
    if code == _RELU2:
        return r * r
    return r


@_njit(inline="always")
def _row_at(idx, use_idx, t, hi):
    """The row at position t of the selection (for prefetching), or -1 past its end."""
    if t >= hi:
        return -1
    return idx[t] if use_idx else t


@_njit(inline="always")
def _next_live(acts, t, hi):
    """First position >= t (below hi) whose activation is nonzero, else hi."""
    while t < hi and acts[t] == 0.0:
        t += 1
    return t


_PASS_GATE, _PASS_UP, _PASS_DOWN = 0, 1, 2


@_njit(inline="always", fastmath=True)
def _rows_pass(kind, w, w_s, scaled, idx, use_idx, acts, lo, hi, x, part, c, code, thr):
    """One pass of `ffn_rows` over the positions t in [lo, hi) whose acts[t] is nonzero:
      _PASS_GATE: acts[t] = nonlinearity(w[i] . x)  (acts marks the selected rows on entry);
      _PASS_UP:   acts[t] *= w[i] . x               (dReLU: the up value clamped at 0);
      _PASS_DOWN: part[c] += acts[t] * w[i].
    A second cursor runs `_rows_ahead` live rows ahead, and its row is prefetched while the
    current one is consumed; the first rows are prefetched whole before the loop."""
    t = _next_live(acts, lo, hi)
    ahead = t
    for _ in range(_rows_ahead(w)):
        if ahead >= hi:
            break
        _prefetch_span(w, idx[ahead] if use_idx else ahead, 0, w.shape[1])
        ahead = _next_live(acts, ahead + 1, hi)
    while t < hi:
        i = idx[t] if use_idx else t
        nxt = _row_at(idx, use_idx, ahead, hi)
        if kind == _PASS_DOWN:
            a = acts[t]
            if scaled:
                a *= w_s[i]
            _row_axpy(part, c, a, w, i, nxt)
        else:
            v = _row_dot(w, i, x, nxt)
            if scaled:
                v *= w_s[i]
            if kind == _PASS_GATE:
                acts[t] = _nonlinearity(v, code, thr)
            else:
                if code == _DRELU and v < 0.0:
                    v = np.float32(0.0)
                acts[t] *= v
        if ahead < hi:
            ahead = _next_live(acts, ahead + 1, hi)
        t = _next_live(acts, t + 1, hi)


@_njit(parallel=True, fastmath=True)
def ffn_rows(x, gate, gate_s, up, up_s, down, down_s, idx, use_idx, pred, pred_ids, use_pred,
             use_pred_ids, pthr, gated, scaled, code, thr, acts, nchunks):
    """y fp32 [d] over the selected rows (see the module docstring).

    x fp32 [d]; gate/up/down int8 or fp32 [n, d] (gate ignored unless `gated`); *_s fp32 [n]
    per-row scales (ignored unless `scaled`). Rows computed, by mode:
      use_idx:  rows idx[0..k) (int64), acts fp32 [k];
      use_pred: rows i with pred[i] >= pthr, or pred[pred_ids[i]] >= pthr when
                use_pred_ids (the rows are a subset of a layer's neurons), acts fp32 [n];
      neither:  all rows, acts fp32 [n].
    acts receives the activations (0 for rows not computed).
    """
    d = x.shape[0]
    n = up.shape[0]
    k = idx.shape[0] if use_idx else n
    if use_idx:
        for t in range(k):  # out-of-range ids would read arbitrary memory
            if idx[t] < 0 or idx[t] >= n:
                raise IndexError("active neuron id out of range")
    if use_pred and use_pred_ids:
        for t in range(n):
            if pred_ids[t] < 0 or pred_ids[t] >= pred.shape[0]:
                raise IndexError("row id out of range of the predictor logits")
    thr = np.float32(thr)
    pthr = np.float32(pthr)
    part = np.empty((nchunks, d), dtype=np.float32)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for j in range(d):
            part[c, j] = 0.0
        lo = min(k, c * per)
        hi = min(k, lo + per)
        # acts marks the rows to compute (nonzero), so every pass walks it the same way.
        for t in range(lo, hi):
            sel = True
            if use_pred:
                lg = pred[pred_ids[t]] if use_pred_ids else pred[t]
                sel = lg >= pthr
            acts[t] = 1.0 if sel else 0.0
        # A: gate rows (up rows when ungated); B: up rows of the neurons whose gate fired;
        # C: down rows of the neurons that fired, into this chunk's partial sum.
        if gated:
            _rows_pass(_PASS_GATE, gate, gate_s, scaled, idx, use_idx, acts, lo, hi, x, part, c,
                       code, thr)
            _rows_pass(_PASS_UP, up, up_s, scaled, idx, use_idx, acts, lo, hi, x, part, c,
                       code, thr)
        else:
            _rows_pass(_PASS_GATE, up, up_s, scaled, idx, use_idx, acts, lo, hi, x, part, c,
                       code, thr)
        _rows_pass(_PASS_DOWN, down, down_s, scaled, idx, use_idx, acts, lo, hi, x, part, c,
                   code, thr)
    # Fixed-order reduction: the result does not depend on thread timing.
    y = np.zeros(d, dtype=np.float32)
    for c in range(nchunks):
        for j in range(d):
            y[j] += part[c, j]
    return y


@_njit(parallel=True)
def quantize_rows_int8(w, q, scale):
    """Per-row symmetric int8: scale[i] = max|w[i]| / 127, q[i] = rint(w[i] / scale[i]).

    Same fp32 operations as the torch path of cpu_quant (no fastmath), so the two agree
    bit for bit; one pass over each row while it sits in L1.
    """
    n, d = w.shape
    for i in prange(n):
        m = np.float32(0.0)
        for j in range(d):
            a = abs(w[i, j])
            if a > m:
                m = a
        s = m / np.float32(127.0)
        scale[i] = s
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        for j in range(d):
            v = np.rint(w[i, j] * inv)
            if v > 127.0:
                v = 127.0
            elif v < -127.0:
                v = -127.0
            q[i, j] = np.int8(v)


@_njit(inline="always")
def _next_live_any(acts, t, hi):
    """First position >= t (below hi) where some token's activation is nonzero, else hi."""
    T = acts.shape[0]
    while t < hi:
        for s in range(T):
            if acts[s, t] != 0.0:
                return t
        t += 1
    return t


@_njit(parallel=True, fastmath=True)
def ffn_rows_batch(xs, gate, gate_s, up, up_s, down, down_s, idx, use_idx, gated, scaled,
                   code, thr, acts, nchunks):
    """Small-batch variant of `ffn_rows` (no predictor mode): xs fp32 [T, d], acts fp32 [T, k];
    returns ys fp32 [T, d]. Each selected row is read from memory once for all T tokens
    (the T dots re-read it from L1); a token's up/down work is skipped where its gate/act
    is 0, and a row is skipped where it is 0 for every token."""
    T, d = xs.shape
    n = up.shape[0]
    k = idx.shape[0] if use_idx else n
    if use_idx:
        for t in range(k):
            if idx[t] < 0 or idx[t] >= n:
                raise IndexError("active neuron id out of range")
    thr = np.float32(thr)
    part = np.empty((nchunks, T, d), dtype=np.float32)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for s in range(T):
            for j in range(d):
                part[c, s, j] = 0.0
        lo = min(k, c * per)
        hi = min(k, lo + per)
        first = gate if gated else up
        first_s = gate_s if gated else up_s
        for t in range(lo, hi):
            i = idx[t] if use_idx else t
            nxt = -1
            if t + 1 < hi:
                nxt = idx[t + 1] if use_idx else t + 1
            for s in range(T):
                g = _row_dot(first, i, xs[s], nxt if s == 0 else -1)
                if scaled:
                    g *= first_s[i]
                acts[s, t] = _nonlinearity(g, code, thr)
        if gated:
            t = _next_live_any(acts, lo, hi)
            while t < hi:
                t2 = _next_live_any(acts, t + 1, hi)
                i = idx[t] if use_idx else t
                nxt = _row_at(idx, use_idx, t2, hi)
                pf = nxt
                for s in range(T):
                    if acts[s, t] != 0.0:
                        u = _row_dot(up, i, xs[s], pf)
                        pf = -1
                        if scaled:
                            u *= up_s[i]
                        if code == _DRELU and u < 0.0:
                            u = np.float32(0.0)
                        acts[s, t] *= u
                t = t2
        t = _next_live_any(acts, lo, hi)
        while t < hi:
            t2 = _next_live_any(acts, t + 1, hi)
            i = idx[t] if use_idx else t
            nxt = _row_at(idx, use_idx, t2, hi)
            pf = nxt
            for s in range(T):
                a = acts[s, t]
                if a != 0.0:
                    if scaled:
                        a *= down_s[i]
                    _row_axpy(part[c], s, a, down, i, pf)
                    pf = -1
            t = t2
    ys = np.zeros((T, d), dtype=np.float32)
    for c in range(nchunks):
        for s in range(T):
            for j in range(d):
                ys[s, j] += part[c, s, j]
    return ys


# ---- dense matrix-vector products for decode ---------------------------------------------
# torch's fp32 [1, d] x [n, d]^T product streams DRAM-resident weights at about 7 GB/s on
# these machines; a plain row loop split over the threads reaches about 15 GB/s. Every row
# is used (dense), so rows stream in order and the hardware prefetcher does the rest.
# Four rows per pass over x: four independent sums keep the vector units busy where one
# sum waits on its own previous add (int8 rows, converted to fp32 on the fly, went from
# about 20 to 28 GB/s on a 2-core EPYC; fp32 rows gained 3-14%). That holds for long rows
# only: rows of up to SHORT_ROW_COLS columns (a predictor's second matrix, 512) go one at a
# time, where four at a time streamed int8 [11008, 512] at 12.9 GB/s against 27.1 (int8
# [4096, 1024]: 14.9 against 24.2; [4096, 3072]: 19.5 against 15.3; 2-core AVX-512 EPYC, 2
# threads). Each row's sum is the same loop either way: the same bits (checked for fp32 and
# int8 rows of 1 to 4096 columns).
SHORT_ROW_COLS = 2560


@_njit(inline="always", fastmath=True)
def _matvec_chunk(w, scale, scaled, x, y, lo, hi):
    """y[i] = w[i] . x (times scale[i] when `scaled`) for rows lo..hi of w (fp32 or int8)."""
    d = x.shape[0]
    i = lo
    while d > SHORT_ROW_COLS and i + 3 < hi:  # long rows four at a time
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for j in range(d):
            xj = x[j]
            s0 += np.float32(w[i, j]) * xj
            s1 += np.float32(w[i + 1, j]) * xj
            s2 += np.float32(w[i + 2, j]) * xj
            s3 += np.float32(w[i + 3, j]) * xj
        if scaled:
            s0 *= scale[i]
            s1 *= scale[i + 1]
            s2 *= scale[i + 2]
            s3 *= scale[i + 3]
        y[i], y[i + 1], y[i + 2], y[i + 3] = s0, s1, s2, s3
        i += 4
    while i < hi:  # short rows, and the last long ones
        s = np.float32(0.0)
        for j in range(d):
            s += np.float32(w[i, j]) * x[j]
        y[i] = s * scale[i] if scaled else s
        i += 1


@_njit(parallel=True, fastmath=True)
def matvec_rows(w, x, nchunks):
    """y[i] = w[i] . x for every row of w fp32 [n, d]; x fp32 [d]."""
    n = w.shape[0]
    y = np.empty(n, dtype=np.float32)
    no_scale = np.empty(0, dtype=np.float32)
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        _matvec_chunk(w, no_scale, False, x, y, c * per, min(n, (c + 1) * per))
    return y


@_njit(parallel=True, fastmath=True)
def matvec_rows_int8(q, scale, x, nchunks):
    """y[i] = scale[i] * (q[i] . x) for every row of q int8 [n, d]; scale fp32 [n], x fp32 [d]:
    `matvec_rows` over int8 rows, a quarter of the bytes."""
    n = q.shape[0]
    y = np.empty(n, dtype=np.float32)
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        _matvec_chunk(q, scale, True, x, y, c * per, min(n, (c + 1) * per))
    return y


@_njit(parallel=True, fastmath=True)
def combine_rows(a, w, nchunks):
    """y = sum_i a[i] * w[i] over every row of w fp32 [n, d] (a transposed matrix-vector
    product); thread-private partial sums, added in a fixed order."""
    n, d = w.shape
    part = np.zeros((nchunks, d), dtype=np.float32)
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for i in range(c * per, min(n, (c + 1) * per)):
            ai = a[i]
            for j in range(d):
                part[c, j] += ai * w[i, j]
    y = np.zeros(d, dtype=np.float32)
    for c in range(nchunks):
        for j in range(d):
            y[j] += part[c, j]
    return y


# ---- int8 x int8 products (llama.cpp's Q8_0 scheme, AVX2) ---------------------------------
# The fp32 kernels above convert every int8 weight to fp32 before its multiply-add: three
# vector instructions per 8 weights, so int8 rows stream at about 28 GB/s, compute-bound on
# two cores. Quantizing the activation too (int8 in blocks of _ACT_BLOCK, one fp32 scale a
# block) lets the products run on int8 pairs: per 32 weights and row, vpsignb, vpmaddubsw,
# vpmaddwd, vpaddd (the activation's |x| is shared by the four rows of a pass). LLVM does
# not find this from a plain loop (it emits a 128-bit vpmaddwd over sign-extended words, as
# many instructions as the fp32 path), so the block loop is written in LLVM IR below. It
# needs AVX2: `engine.kernels.cpu` calls it only where the host has it.

_ACT_BLOCK = 128  # activation values per fp32 scale (a multiple of 32)


def _host_has_avx2() -> bool:
    from llvmlite import binding as llvm

    try:
        return bool(llvm.get_host_cpu_features().get("avx2"))
    except RuntimeError:  # features unknown on this host
        return False


HAS_AVX2 = _host_has_avx2()

# CPUs whose LLVM name implies 256-bit VNNI (AVX512-VNNI with VL, or AVX-VNNI): a target set by
# NUMBA_CPU_NAME (an installer's tier, packaging/kernel_tiers.py) decides, not the host.
_VNNI_CPUS = {"cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
              "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids",
              "alderlake", "raptorlake", "meteorlake", "arrowlake", "arrowlake-s", "lunarlake", "pantherlake",
              "gracemont", "sierraforest", "grandridge", "clearwaterforest", "znver4", "znver5"}


def _target_has_vnni() -> bool:
    """Whether the code numba generates may use vpdpbusd on 256-bit vectors."""
    from llvmlite import binding as llvm

    name = os.environ.get("NUMBA_CPU_NAME", "").strip()
    features = os.environ.get("NUMBA_CPU_FEATURES", "")
    if name and name != "host":
        named = name in _VNNI_CPUS or "+avxvnni" in features or "+avx512vnni" in features
        return named and "-avxvnni" not in features and "-avx512vnni" not in features
    try:
        host = llvm.get_host_cpu_features()
    except RuntimeError:
        return False
    return bool(host.get("avxvnni") or (host.get("avx512vnni") and host.get("avx512vl")))


HAS_VNNI = HAS_AVX2 and _target_has_vnni()  # matmul_q8's two-token pass below


def _avx2_fn(builder, name, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
    return builder.call(fn, args)


def _lane_sums(builder, accs) -> list:
    """Each fp32x8 accumulator (allocas) summed across its lanes in lane order: a kernel's results."""
    sums = []
    for a in accs:
        v = builder.load(a)
        s = builder.extract_element(v, ir.IntType(32)(0))
        for lane in range(1, 8):
            s = builder.fadd(s, builder.extract_element(v, ir.IntType(32)(lane)))
        sums.append(s)
    return sums


def _madd_bytes(builder, acc, u, s, ones):
    """acc int32x8 + the sums of four products of u (unsigned bytes, <= 127 here) and s (signed
    bytes), lane by lane: vpdpbusd where the target has VNNI, else vpmaddubsw, vpmaddwd, vpaddd
    (no 16-bit saturation at |u| <= 127: the same integers)."""
    v8i32 = ir.VectorType(ir.IntType(32), 8)
    if HAS_VNNI:
        return _avx2_fn(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, acc, builder.bitcast(u, v8i32),
                        builder.bitcast(s, v8i32))
    p16 = _avx2_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(ir.IntType(16), 16), u, s)
    return builder.add(acc, _avx2_fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, p16, ones))


def _dot_q8_codegen(rows: int):
    """The code of `rows` rows' products with one token (see `_dot4_q8_avx2`): each row's integer
    block sums, block scales and lane sums are the same operations whatever `rows` is."""
    def codegen(context, builder, signature, args):
        qty, _, xty, xsty, _ = signature.args
        qa = context.make_array(qty)(context, builder, args[0])
        xa = context.make_array(xty)(context, builder, args[2])
        xsa = context.make_array(xsty)(context, builder, args[3])
        i64 = ir.IntType(64)
        row = context.cast(builder, args[1], signature.args[1], types.int64)
        tok = context.cast(builder, args[4], signature.args[4], types.int64)
        zero64 = i64(0)
        v32i8 = ir.VectorType(ir.IntType(8), 32)
        v16i16 = ir.VectorType(ir.IntType(16), 16)
        v8i32 = ir.VectorType(ir.IntType(32), 8)
        v8f32 = ir.VectorType(ir.FloatType(), 8)
        d = cgutils.unpack_tuple(builder, qa.shape)[1]
        nb = builder.sdiv(d, i64(_ACT_BLOCK))
        xptr = cgutils.get_item_pointer(context, builder, xty, xa, [tok, zero64], wraparound=False)
        xsptr = cgutils.get_item_pointer(context, builder, xsty, xsa, [tok, zero64], wraparound=False)
        rptrs = [cgutils.get_item_pointer(context, builder, qty, qa, [builder.add(row, i64(k)), zero64],
                                          wraparound=False) for k in range(rows)]
        ones = ir.Constant(v16i16, [ir.Constant(ir.IntType(16), 1)] * 16)
        accf = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(rows)]
        acci = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, None)) for _ in range(rows)]

        def load32(ptr, off):
            p = builder.bitcast(builder.gep(ptr, [off]), v32i8.as_pointer())
            return builder.load(p, align=1)

        with cgutils.for_range(builder, nb) as blk:
            base = builder.mul(blk.index, i64(_ACT_BLOCK))
            for k in range(rows):
                builder.store(ir.Constant(v8i32, None), acci[k])
            for u in range(_ACT_BLOCK // 32):  # unrolled: a constant trip count
                off = builder.add(base, i64(32 * u))
                xv = load32(xptr, off)
                ax = _avx2_fn(builder, "llvm.x86.avx2.psign.b", v32i8, xv, xv)
                for k in range(rows):
                    sw = _avx2_fn(builder, "llvm.x86.avx2.psign.b", v32i8, load32(rptrs[k], off), xv)
                    builder.store(_madd_bytes(builder, builder.load(acci[k]), ax, sw, ones), acci[k])
            scale = builder.load(builder.gep(xsptr, [blk.index]))
            splat = cgutils.alloca_once_value(builder, ir.Constant(v8f32, None))
            vs = builder.load(splat)
            for lane in range(8):
                vs = builder.insert_element(vs, scale, ir.IntType(32)(lane))
            for k in range(rows):
                f = builder.sitofp(builder.load(acci[k]), v8f32)
                builder.store(builder.fadd(builder.load(accf[k]), builder.fmul(f, vs)), accf[k])
        sums = _lane_sums(builder, accf)
        return sums[0] if rows == 1 else context.make_tuple(builder, signature.return_type, sums)

    return codegen


@intrinsic
def _dot4_q8_avx2(typingctx, q, i, x, xs, t):
    """(q[i+k] . x[t]) for k = 0..3, fp32: q int8 [n, d] (rows i..i+3 must exist), x int8
    [T, d] quantized in blocks of _ACT_BLOCK with fp32 scales xs [T, d // _ACT_BLOCK];
    d a multiple of _ACT_BLOCK. Integer sums within a block, an fp32 multiply-add by the
    block's scale, one horizontal sum per row at the end."""
    return types.UniTuple(types.float32, 4)(q, i, x, xs, t), _dot_q8_codegen(4)


@intrinsic
def _dot1_q8_avx2(typingctx, q, i, x, xs, t):
    """q[i] . x[t], fp32: one row of `_dot4_q8_avx2`, the same bits."""
    return types.float32(q, i, x, xs, t), _dot_q8_codegen(1)


@_njit()
def quantize_act_q8(x, xq, xs):
    """x fp32 [T, d] -> xq int8 [T, d] in blocks of _ACT_BLOCK, xs fp32 [T, d // _ACT_BLOCK]:
    per block scale = max|x| / 127, xq = rint(x / scale) (llama.cpp's Q8_0, wider blocks)."""
    T, d = x.shape
    nb = d // _ACT_BLOCK
    for tb in range(T * nb):  # one thread: a decode step's vector is 16 KB
        t = tb // nb
        lo = (tb % nb) * _ACT_BLOCK
        m = np.float32(0.0)
        for j in range(lo, lo + _ACT_BLOCK):
            a = abs(x[t, j])
            if a > m:
                m = a
        s = m / np.float32(127.0)
        xs[t, tb % nb] = s
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        for j in range(lo, lo + _ACT_BLOCK):
            v = np.rint(x[t, j] * inv)
            if v > 127.0:
                v = 127.0
            elif v < -127.0:
                v = -127.0
            xq[t, j] = np.int8(v)


# Tiles of a many-token product: a pass keeps _TILE_TOKENS quantized activations (4 KB each
# at d 4096) in L1 while it runs _TILE_ROWS rows (in L2) over them, so each weight row comes
# from memory once and each activation from cache once per tile of rows.
_TILE_ROWS = 64
_TILE_TOKENS = 8


# ---- the same product with VNNI (vpdpbusd) ---------------------------------------------------
# vpdpbusd multiplies unsigned by signed bytes and sums them in fours into int32 lanes. With the
# activation offset to unsigned (x + 128) one instruction does a row's 32 products for a token,
# where AVX2 takes vpsignb, vpmaddubsw, vpmaddwd and vpaddd for each (row, token) pair; the offset
# comes back out per block as 128 times the row's lane sums, one vpdpbusd per 32 weights for all
# the tokens of a pass. A pass is four rows by four tokens, or two (a remainder). Each int32 lane
# holds the same four products as the AVX2 kernel's lane, and the scaling and sums run in its
# order: the same bits.
#
# Four tokens a pass take a quarter of the offset passes where two took half, and both passes
# prefetch, into L2, the rows two passes ahead: computing this densely, the hardware's own
# prefetch left them waiting on memory. int8 [4096, 4096] and [11008, 4096], 2 threads (2-core
# AVX-512 EPYC), alternating runs: 8 tokens 110-138 GMAC/s two a pass without prefetch, 155-166
# four a pass prefetching into L1, 198-223 into L2; 2 tokens 46-51 -> 61-65 with the prefetch,
# 3 tokens 62-67 -> 85-92; 34 tokens (a prompt) 207-214 into L1, 228-240 into L2.
_PREFETCH_GROUPS = 2


def _tile_q8_codegen(tokens: int):
    """The code of a pass of four rows by `tokens` tokens (see `_tile_q8_vnni`)."""
    def codegen(context, builder, signature, args):
        qty, _, xty, xsty = signature.args[:4]
        qa = context.make_array(qty)(context, builder, args[0])
        xa = context.make_array(xty)(context, builder, args[2])
        xsa = context.make_array(xsty)(context, builder, args[3])
        i64 = ir.IntType(64)
        row = context.cast(builder, args[1], signature.args[1], types.int64)
        toks = [context.cast(builder, args[4 + j], signature.args[4 + j], types.int64) for j in range(tokens)]
        zero64 = i64(0)
        v32i8 = ir.VectorType(ir.IntType(8), 32)
        v8i32 = ir.VectorType(ir.IntType(32), 8)
        v8f32 = ir.VectorType(ir.FloatType(), 8)
        d = cgutils.unpack_tuple(builder, qa.shape)[1]
        nb = builder.sdiv(d, i64(_ACT_BLOCK))
        xptrs = [cgutils.get_item_pointer(context, builder, xty, xa, [t, zero64], wraparound=False) for t in toks]
        xsptrs = [cgutils.get_item_pointer(context, builder, xsty, xsa, [t, zero64], wraparound=False)
                  for t in toks]
        rptrs = [cgutils.get_item_pointer(context, builder, qty, qa, [builder.add(row, i64(k)), zero64],
                                          wraparound=False) for k in range(4)]
        offset = builder.bitcast(ir.Constant(v32i8, [ir.Constant(ir.IntType(8), 128)] * 32), v8i32)
        accf = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(4 * tokens)]
        acci = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, None)) for _ in range(4 * tokens)]
        corr = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, None)) for _ in range(4)]
        ahead = builder.mul(d, i64(4 * _PREFETCH_GROUPS))  # bytes from a row to its row passes ahead

        def load32(ptr, off):
            p = builder.bitcast(builder.gep(ptr, [off]), v32i8.as_pointer())
            return builder.bitcast(builder.load(p, align=1), v8i32)

        def dpbusd(acc, u, s):
            return _avx2_fn(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, acc, u, s)

        with cgutils.for_range(builder, nb) as blk:
            base = builder.mul(blk.index, i64(_ACT_BLOCK))
            for a in acci + corr:
                builder.store(ir.Constant(v8i32, None), a)
            for u in range(_ACT_BLOCK // 32):  # unrolled: a constant trip count
                off = builder.add(base, i64(32 * u))
                if u % 2 == 0:  # one 64-byte line a row
                    for k in range(4):
                        prefetch_line(builder, builder.gep(rptrs[k], [builder.add(off, ahead)]), locality=2)
                xv = [load32(p, off) for p in xptrs]
                for k in range(4):
                    w = load32(rptrs[k], off)
                    builder.store(dpbusd(builder.load(corr[k]), offset, w), corr[k])
                    for j in range(tokens):
                        a = acci[tokens * k + j]
                        builder.store(dpbusd(builder.load(a), xv[j], w), a)
            for j in range(tokens):
                scale = builder.load(builder.gep(xsptrs[j], [blk.index]))
                vs = ir.Constant(v8f32, None)
                for lane in range(8):
                    vs = builder.insert_element(vs, scale, ir.IntType(32)(lane))
                for k in range(4):
                    exact = builder.sub(builder.load(acci[tokens * k + j]), builder.load(corr[k]))
                    f = builder.sitofp(exact, v8f32)
                    a = accf[tokens * k + j]
                    builder.store(builder.fadd(builder.load(a), builder.fmul(f, vs)), a)
        return context.make_tuple(builder, signature.return_type, _lane_sums(builder, accf))

    return codegen


@intrinsic
def _tile_q8_vnni(typingctx, q, i, xu, xs, t0, t1):
    """(q[i+k] . x[t]) for k = 0..3 and t = t0, t1 (8 fp32, k-major): as `_dot4_q8_avx2` with
    xu uint8 [T, d] = the quantized activations + 128. Prefetches rows i + 4 * _PREFETCH_GROUPS
    on (a hint: past the last row it reads nothing)."""
    return types.UniTuple(types.float32, 8)(q, i, xu, xs, t0, t1), _tile_q8_codegen(2)


@intrinsic
def _tile4_q8_vnni(typingctx, q, i, xu, xs, t0, t1, t2, t3):
    """`_tile_q8_vnni` for four tokens (16 fp32, k-major)."""
    return (types.UniTuple(types.float32, 16)(q, i, xu, xs, t0, t1, t2, t3),
            _tile_q8_codegen(4))


@_njit(parallel=True, fastmath=True)
def matmul_q8(q, scale, xq, xs, nchunks):
    """y[t, i] = scale[i] * (q[i] . dequant(xq[t])) for every row of q int8 [n, d] (n >= 4)
    and every token of xq (see quantize_act_q8) -> fp32 [T, n]. Four rows per pass, with one
    token (`_dot4_q8_avx2`), or four and two where the target has VNNI (`_tile4_q8_vnni`,
    `_tile_q8_vnni`); a single token row by row (`_dot1_q8_avx2`): the same bits. Row by row,
    one token read int8 [11008, 512] (a predictor's second matrix) at 20-25 GB/s against 10-14
    four rows a pass, and [11008, 4096] at 34.6 against 27.5 (2-core AVX-512 EPYC, 2 threads)."""
    n = q.shape[0]
    T, d = xq.shape
    if T == 1:  # a decode's token: row by row
        y1 = np.empty((1, n), dtype=np.float32)
        per1 = (n + nchunks - 1) // nchunks
        for c in prange(nchunks):
            for i in range(c * per1, min(n, (c + 1) * per1)):
                y1[0, i] = _dot1_q8_avx2(q, i, xq, xs, 0) * scale[i]
        return y1
    xu = np.empty((T if HAS_VNNI else 0, d), dtype=np.uint8)  # tokens offset to unsigned bytes for the VNNI passes
    if HAS_VNNI:
        for t in range(T):
            for j in range(d):
                xu[t, j] = np.uint8(np.int32(xq[t, j]) + 128)
    y = np.empty((T, n), dtype=np.float32)
    groups = (n + 3) // 4
    per = (groups + nchunks - 1) // nchunks
    tile = _TILE_ROWS // 4
    for c in prange(nchunks):
        g_hi = min(groups, (c + 1) * per)
        for g_tile in range(c * per, g_hi, tile):
            for t_lo in range(0, T, _TILE_TOKENS):
                hi = min(T, t_lo + _TILE_TOKENS)
                for g in range(g_tile, min(g_hi, g_tile + tile)):
                    # the last group reads rows n-4..n-1 and keeps the ones not done yet
                    i = min(g * 4, n - 4)
                    t = t_lo
                    if HAS_VNNI:  # a module constant: on other targets numba prunes the branch
                        while t + 3 < hi:
                            s4 = _tile4_q8_vnni(q, i, xu, xs, t, t + 1, t + 2, t + 3)
                            for k in range(g * 4, min(n, g * 4 + 4)):
                                for j in range(4):
                                    y[t + j, k] = s4[4 * (k - i) + j] * scale[k]
                            t += 4
                        while t + 1 < hi:
                            s2 = _tile_q8_vnni(q, i, xu, xs, t, t + 1)
                            for k in range(g * 4, min(n, g * 4 + 4)):
                                y[t, k] = s2[2 * (k - i)] * scale[k]
                                y[t + 1, k] = s2[2 * (k - i) + 1] * scale[k]
                            t += 2
                    while t < hi:  # one token at a time (an odd last one; every one without VNNI)
                        s = _dot4_q8_avx2(q, i, xq, xs, t)
                        for k in range(g * 4, min(n, g * 4 + 4)):
                            y[t, k] = s[k - i] * scale[k]
                        t += 1
    return y


# ---- many tokens over the selected rows (a sparse prefill) ---------------------------------

@_njit(parallel=True, fastmath=True)
def ffn_rows_tokens(xs, gate, gate_s, up, up_s, down, down_s, pred, pthr, use_pred, gated, scaled, code,
                    thr, acts, nchunks):
    """ys fp32 [T, d] for the tokens xs fp32 [T, d] over rows int8 or fp32 [k, d] (*_s fp32
    [k] per-row scales, used when `scaled`), each token computing only the rows its own
    predictor logits select (pred fp32 [T, k] >= pthr; every row when not `use_pred`):
    what decoding the tokens one at a time computes, with each row read from memory once.

    Phase 1, threads over rows: a row's gate (up when ungated) for the tokens that select
    it, then its up row for the tokens whose gate fired; acts fp32 [k, T] (neuron-major)
    receives the activations, 0 where not computed. A row no token selects is never read.
    Phase 2, threads over slices of d: ys[t] += acts[i, t] * down[i] for nonzero acts, so
    no thread-private copies of ys are needed."""
    T, d = xs.shape
    k = up.shape[0]
    thr = np.float32(thr)
    pthr = np.float32(pthr)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for i in range(c * per, min(k, (c + 1) * per)):
            for t in range(T):
                g = np.float32(0.0)
                if not use_pred or pred[t, i] >= pthr:
                    if gated:
                        g = _row_dot(gate, i, xs[t], -1)
                        if scaled:
                            g *= gate_s[i]
                    else:
                        g = _row_dot(up, i, xs[t], -1)
                        if scaled:
                            g *= up_s[i]
                    g = _nonlinearity(g, code, thr)
                acts[i, t] = g
            if gated:
                for t in range(T):
                    if acts[i, t] != 0.0:
                        u = _row_dot(up, i, xs[t], -1)
                        if scaled:
                            u *= up_s[i]
                        if code == _DRELU and u < 0.0:
                            u = np.float32(0.0)
                        acts[i, t] *= u
    ys = np.zeros((T, d), dtype=np.float32)
    span = (d + nchunks - 1) // nchunks
    span = (span + 63) // 64 * 64
    for c in prange(nchunks):
        lo = min(d, c * span)
        hi = min(d, lo + span)
        for i in range(k):
            s = down_s[i] if scaled else np.float32(1.0)
            for t in range(T):
                a = acts[i, t]
                if a != 0.0:
                    a *= s
                    for j in range(lo, hi):
                        ys[t, j] += a * np.float32(down[i, j])
    return ys


# ---- many tokens over int8 rows, int8 x int8 (a sparse prefill on AVX2 hosts) --------------
# `ffn_rows_tokens` converts every int8 weight to fp32 once per token that selects its row;
# a 200-token prefill of one 7B layer spent about 1.3 s there. Here the tokens' activations
# are quantized in blocks (as `matmul_q8` does) and each row runs against four tokens
# per pass in int8: |w| is taken once per 32 weights and shared by the four products.

def _dot_row_q8_codegen(ntok):
    """Codegen of `_dot_row_q8x{ntok}_avx2`: (q[i] . x[t_k]) for ntok tokens, fp32."""

    def codegen(context, builder, signature, args):
        qty, ity, xty, xsty = signature.args[:4]
        qa = context.make_array(qty)(context, builder, args[0])
        xa = context.make_array(xty)(context, builder, args[2])
        xsa = context.make_array(xsty)(context, builder, args[3])
        i64 = ir.IntType(64)
        zero64 = i64(0)
        row = context.cast(builder, args[1], ity, types.int64)
        toks = [context.cast(builder, args[4 + k], signature.args[4 + k], types.int64) for k in range(ntok)]
        v32i8 = ir.VectorType(ir.IntType(8), 32)
        v16i16 = ir.VectorType(ir.IntType(16), 16)
        v8i32 = ir.VectorType(ir.IntType(32), 8)
        v8f32 = ir.VectorType(ir.FloatType(), 8)
        d = cgutils.unpack_tuple(builder, qa.shape)[1]
        nb = builder.sdiv(d, i64(_ACT_BLOCK))
        rptr = cgutils.get_item_pointer(context, builder, qty, qa, [row, zero64], wraparound=False)
        xptrs = [cgutils.get_item_pointer(context, builder, xty, xa, [t, zero64], wraparound=False) for t in toks]
        xsptrs = [cgutils.get_item_pointer(context, builder, xsty, xsa, [t, zero64], wraparound=False)
                  for t in toks]
        ones = ir.Constant(v16i16, [ir.Constant(ir.IntType(16), 1)] * 16)
        accf = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(ntok)]
        acci = [cgutils.alloca_once_value(builder, ir.Constant(v8i32, None)) for _ in range(ntok)]

        def load32(ptr, off):
            p = builder.bitcast(builder.gep(ptr, [off]), v32i8.as_pointer())
            return builder.load(p, align=1)

        with cgutils.for_range(builder, nb) as blk:
            base = builder.mul(blk.index, i64(_ACT_BLOCK))
            for k in range(ntok):
                builder.store(ir.Constant(v8i32, None), acci[k])
            for u in range(_ACT_BLOCK // 32):
                off = builder.add(base, i64(32 * u))
                wv = load32(rptr, off)
                aw = _avx2_fn(builder, "llvm.x86.avx2.psign.b", v32i8, wv, wv)
                for k in range(ntok):
                    sx = _avx2_fn(builder, "llvm.x86.avx2.psign.b", v32i8, load32(xptrs[k], off), wv)
                    builder.store(_madd_bytes(builder, builder.load(acci[k]), aw, sx, ones), acci[k])
            for k in range(ntok):
                scale = builder.load(builder.gep(xsptrs[k], [blk.index]))
                vs = ir.Constant(v8f32, None)
                for lane in range(8):
                    vs = builder.insert_element(vs, scale, ir.IntType(32)(lane))
                f = builder.sitofp(builder.load(acci[k]), v8f32)
                builder.store(builder.fadd(builder.load(accf[k]), builder.fmul(f, vs)), accf[k])
        sums = _lane_sums(builder, accf)
        if ntok == 1:
            return sums[0]
        return context.make_tuple(builder, signature.return_type, sums)

    return codegen


@intrinsic
def _dot_row_q8x4_avx2(typingctx, q, i, x, xs, t0, t1, t2, t3):
    """(q[i] . x[t_k]) for the four tokens t0..t3, fp32: q int8 [n, d], x int8 [T, d] in
    blocks of _ACT_BLOCK with fp32 scales xs [T, d // _ACT_BLOCK]; d a multiple of
    _ACT_BLOCK. maddubs(|w|, sign(x, w)): pairs of products fit int16 (|w|, |x| <= 127);
    |w| is taken once per 32 weights for the four tokens."""
    return types.UniTuple(types.float32, 4)(q, i, x, xs, t0, t1, t2, t3), _dot_row_q8_codegen(4)


@intrinsic
def _dot_row_q8x1_avx2(typingctx, q, i, x, xs, t0):
    """q[i] . x[t0], fp32: `_dot_row_q8x4_avx2` for one token (a row's last few tokens)."""
    return types.float32(q, i, x, xs, t0), _dot_row_q8_codegen(1)


@_njit(inline="always", fastmath=True)
def _q8_row_tokens(w, w_s, i, xq, xsc, sel, m, acts, first, code, thr):
    """Row i of w against the m tokens sel[0..m), four per pass: first (gate) pass
    acts[i, t] = nonlinearity(v), else (up) acts[i, t] *= v (dReLU: clamped at 0)."""
    j = 0
    while j < m:
        if m - j >= 4:
            s = _dot_row_q8x4_avx2(w, i, xq, xsc, sel[j], sel[j + 1], sel[j + 2], sel[j + 3])
            _q8_store(acts, i, sel[j], s[0] * w_s[i], first, code, thr)
            _q8_store(acts, i, sel[j + 1], s[1] * w_s[i], first, code, thr)
            _q8_store(acts, i, sel[j + 2], s[2] * w_s[i], first, code, thr)
            _q8_store(acts, i, sel[j + 3], s[3] * w_s[i], first, code, thr)
            j += 4
        else:  # the last 1-3 tokens one at a time: no wasted products on repeated tokens
            _q8_store(acts, i, sel[j], _dot_row_q8x1_avx2(w, i, xq, xsc, sel[j]) * w_s[i], first, code, thr)
            j += 1


@_njit(inline="always", fastmath=True)
def _q8_store(acts, i, t, v, first, code, thr):
    if first:
        acts[i, t] = _nonlinearity(v, code, thr)
    else:
        if code == _DRELU and v < 0.0:
            v = np.float32(0.0)
        acts[i, t] *= v


@_njit(parallel=True, fastmath=True)
def ffn_rows_tokens_q8(xq, xsc, gate, gate_s, up, up_s, down, down_s, pred, pthr, use_pred, gated, code,
                       thr, acts, nchunks, dchunks):
    """`ffn_rows_tokens` over int8 rows with int8 activations: xq int8 [T, d], xsc fp32
    [T, d // _ACT_BLOCK] (quantize_act_q8 of the tokens), pred fp32 [k, T] (neuron-major);
    the other arguments as there (rows always scaled). Gate and up rows run int8 x int8 for the tokens that need them;
    the down pass converts each fired row's slice to fp32 once for all its tokens."""
    T, d = xq.shape
    k = up.shape[0]
    thr = np.float32(thr)
    pthr = np.float32(pthr)
    live = np.zeros(k, dtype=np.uint8)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        sel = np.empty(max(T, 1), dtype=np.int64)
        for i in range(c * per, min(k, (c + 1) * per)):
            m = 0
            for t in range(T):
                acts[i, t] = 0.0
                if not use_pred or pred[i, t] >= pthr:
                    sel[m] = t
                    m += 1
            if m == 0:
                continue
            if gated:
                _q8_row_tokens(gate, gate_s, i, xq, xsc, sel, m, acts, True, code, thr)
                m2 = 0
                for j in range(m):
                    if acts[i, sel[j]] != 0.0:
                        sel[m2] = sel[j]
                        m2 += 1
                if m2:
                    _q8_row_tokens(up, up_s, i, xq, xsc, sel, m2, acts, False, code, thr)
            else:
                _q8_row_tokens(up, up_s, i, xq, xsc, sel, m, acts, True, code, thr)
            for j in range(m):
                if acts[i, sel[j]] != 0.0:
                    live[i] = 1
                    break
    nlive = 0
    for i in range(k):
        if live[i]:
            nlive += 1
    rows = np.empty(nlive, dtype=np.int64)
    nlive = 0
    for i in range(k):
        if live[i]:
            rows[nlive] = i
            nlive += 1
    ys = np.zeros((T, d), dtype=np.float32)
    span = (d + dchunks - 1) // dchunks
    span = (span + 63) // 64 * 64
    ahead = 8  # slices of the rows ahead in flight: each is on its own page
    for c in prange(dchunks):
        lo = min(d, c * span)
        hi = min(d, lo + span)
        buf = np.empty(max(hi - lo, 1), dtype=np.float32)
        for r in range(min(ahead, nlive)):
            _prefetch_span(down, rows[r], lo, hi)
        for r in range(nlive):
            i = rows[r]
            if r + ahead < nlive:
                _prefetch_span(down, rows[r + ahead], lo, hi)
            s = down_s[i]
            for j in range(lo, hi):
                buf[j - lo] = np.float32(down[i, j]) * s
            for t in range(T):
                a = acts[i, t]
                if a != 0.0:
                    for j in range(lo, hi):
                        ys[t, j] += a * buf[j - lo]
    return ys


# ---- decode attention over a 16-bit KV cache ------------------------------------------------
# The CPU cache holds keys and values in fp16 (half the bytes a long chat reads per token);
# numba has no float16 arrays, so they arrive as int16 bit patterns and are widened here
# (LLVM's fpext from half: vcvtph2ps where the host has F16C).

@intrinsic
def _half_bits_to_float(typingctx, bits):
    """The fp32 value of an fp16 bit pattern held in an int16/uint16."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _kv_value(v):
    """A cache element as fp32: fp16 bits (int16) widened, fp32 as is."""


@overload(_kv_value, inline="always")
def _kv_value_impl(v):
    if isinstance(v, types.Integer):
        return lambda v: _half_bits_to_float(v)
    return lambda v: np.float32(v)


@_njit(fastmath=True)
def _head_attention(q, kc, vc, g, length, scale, out):
    """One query head q fp32 [hd] over kv head g of a layer's cache kc/vc [kv_heads, slots, hd]
    (fp32, or int16 fp16 bits), positions 0..length-1 -> out fp32 [hd]: the scores, their
    softmax (max-subtracted, fp32) and the weighted sum of values."""
    hd = q.shape[0]
    scale = np.float32(scale)
    s = np.empty(length, dtype=np.float32)
    m = np.float32(-np.inf)
    for p in range(length):
        a = np.float32(0.0)
        for j in range(hd):
            a += q[j] * _kv_value(kc[g, p, j])
        a *= scale
        s[p] = a
        if a > m:
            m = a
    total = np.float32(0.0)
    for p in range(length):
        e = np.exp(s[p] - m)
        s[p] = e
        total += e
    acc = np.zeros(hd, dtype=np.float32)
    for p in range(length):
        w = s[p]
        for j in range(hd):
            acc[j] += w * _kv_value(vc[g, p, j])
    inv = np.float32(1.0) / total
    for j in range(hd):
        out[j] = acc[j] * inv


@_njit(parallel=True, fastmath=True)
def decode_attention_cache(q, kc, vc, length, scale, out):
    """One query token against positions 0..length-1 of a layer's cache: q fp32 [H, hd],
    kc/vc [kv_heads, slots, hd] fp32 or int16 (fp16 bits), out fp32 [H, hd]; query head h
    reads kv head h // (H // kv_heads). `_head_attention` per head, heads over the threads, no
    copies of the cache."""
    H = q.shape[0]
    group = H // kc.shape[0]
    for h in prange(H):
        _head_attention(q[h], kc, vc, h // group, length, scale, out[h])


@_njit()
def linear_q8(q, scale, x, nchunks):
    """matmul_q8 of x fp32 [T, d] quantized by quantize_act_q8, in one call from Python
    (one transition per product instead of two, and no Python-side buffers)."""
    T, d = x.shape
    xq = np.empty((T, d), dtype=np.int8)
    xs = np.empty((T, d // _ACT_BLOCK), dtype=np.float32)
    quantize_act_q8(x, xq, xs)
    return matmul_q8(q, scale, xq, xs, nchunks)
