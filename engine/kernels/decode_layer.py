"""One compiled call per CPU layer's decode step, and one for the final norm and the head.

A decode step through `engine.model.layers` makes about twenty Python-level calls per
layer (norms, rotary, the cache write, each product, the predictor, the FFN rows, the
residuals), each a torch op or a numba launch with its own fixed cost: about 6 ms of a
35 ms token on 2 layers of 7B shapes. Here one plain (not parallel) jitted function runs
the whole layer: the small vector work (RMSNorm, rotary, the fp16 cache write, residuals,
the activation of a dense FFN) in its own loops, and the existing parallel kernels of
`cpu_numba`, `cpu_q4` and `q4_tiles` for the products, the attention and the FFN rows, so
the numbers are those of the unfused path (the same kernels, the same chunking).

Every weight matrix arrives as its bytes (uint8 [n, row bytes]) with a kind code and is
viewed inside as fp32, int8 or 4-bit rows: one specialisation of the layer function
serves every storage (numba would compile one per combination of dtypes otherwise).

The layer function calls kernels defined in other files, whose code numba copies into its
own; its disk cache is therefore stamped with all those files (`DEPENDENCIES`), not only
this one, or an edited kernel would keep running in its stale cached copy.

A mixture-of-experts layer (`decode_moe_layer`) runs its router, top-k and chosen experts in
the same call; its experts' rows stay where the tiers keep them (one tensor per expert, or
views of a stacked or mapped layout) and arrive as a table of their addresses, so a layer
of 32 experts is one argument, not 200, and no layout of ours is imposed on the stores.

    count, count_hot = decode_layer(x, pos, threads, cos, sin, pthr, *layer_args)   # x updated in place
    decode_moe_layer(x, pos, threads, cos, sin, *moe_layer_args, chosen, weights, stats)   # a mixture's layer
    logits = decode_head(x, threads, *head_args)
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import caching
from numba.extending import intrinsic

from engine.kernels import cpu_numba as K
from engine.kernels import cpu_q4_numba as Q
from engine.kernels import cpu_q4x8 as QX
from engine.kernels import numba_jit
from engine.kernels import q4_tiles as QT

_HERE = os.path.abspath(__file__)
DEPENDENCIES = tuple(os.path.abspath(m.__file__) for m in (K, Q, QX, QT))
_STAMPED: dict[str, tuple[str, ...]] = {_HERE: DEPENDENCIES}  # a file: the kernel files its functions copy


def stamp_with_kernels(path: str, dependencies: tuple[str, ...]) -> None:
    """The jitted functions of file `path` are cached under its stamp and those of `dependencies`
    (a file whose functions call kernels of other files: decode_batch)."""
    _STAMPED[os.path.abspath(path)] = tuple(os.path.abspath(d) for d in dependencies)


class _StampedWithKernels:
    """A cache locator mixin: a stamped file's functions are stamped with the kernel files too."""

    def get_source_stamp(self):
        stamps = [super().get_source_stamp()]  # this file's (or a frozen bundle's executable's)
        for path in _STAMPED.get(os.path.abspath(self._py_file), ()):
            try:
                st = os.stat(path)
            except OSError:  # not shipped as a file: the bundle's own stamp above stands for it
                stamps.append(None)
                continue
            stamps.append(caching._hash_source_file(path, st.st_mtime, st.st_size))
        return tuple(stamps)

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.abspath(py_file) not in _STAMPED:
            return None
        return super().from_function(py_func, py_file)


def _install_locators() -> None:
    """Put stamped variants of numba's file-backed locators first (they answer for this file only)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    bases = [getattr(caching, n, None) or getattr(caching, "_" + n, None) for n in names]
    ours = [type("Stamped" + b.__name__.lstrip("_"), (_StampedWithKernels, b), {}) for b in bases if b is not None]
    existing = [c for c in impl._locator_classes if not issubclass(c, _StampedWithKernels)]
    impl._locator_classes = ours + existing


_install_locators()


_njit = numba_jit.njit
# The entry points (decode_layer, decode_moe_layer, decode_head and decode_batch's two) run
# without the GIL: every launch holds numba_pool.lock, and the GIL is then free for the
# server's event loop and the disk tier's readers while a layer computes.


# Kinds of a weight matrix (how its bytes are read, and which kernel the unfused path runs).
M_FP32 = 0       # fp32 rows: cpu_numba.matvec_rows
M_INT8_Q8 = 1    # int8 rows x int8 activations: cpu_numba.linear_q8 (AVX2, cols % 128 == 0, n >= 4)
M_INT8 = 2       # int8 rows x fp32: cpu_numba.matvec_rows_int8
M_Q4_TILES = 3   # 4-bit rows, blocks per row a multiple of 8: q4_tiles.tiles_kernel
M_Q4 = 4         # 4-bit rows: cpu_q4_numba.linear_q4
M_Q4X8 = 5       # 4-bit rows packed in interleaved groups of 8: cpu_q4x8.matmul_q4x8
# Q4_1 blocks (quantized.Q4MinMatrix): its Q4_0 rows' kind above + Q4MIN_SHIFT, the block
# offsets fp32 [n * blocks] as the scale; the product adds the input's block sums times them
Q4MIN_SHIFT = 3
M_Q4MIN_TILES, M_Q4MIN, M_Q4MIN_X8 = M_Q4_TILES + Q4MIN_SHIFT, M_Q4 + Q4MIN_SHIFT, M_Q4X8 + Q4MIN_SHIFT

# Kinds of FFN rows (CpuFfnRows fp32 / int8, Q4FfnRows) for the sparse FFN.
R_FP32, R_INT8, R_Q4 = 0, 1, 2

# The FFN of a layer: predicted rows, or dense with its down projection as a matrix
# [d, n_ff] (QuantDenseFfn) or as rows [n_ff, d] combined by their activations (DenseFfn).
FFN_ROWS, FFN_DENSE_LINEAR, FFN_DENSE_COMBINE = 0, 1, 2

_DRELU = K.ACTIVATION_CODES["drelu"]
_DENSE_CHUNKS_PER_THREAD = 8  # as cpu._DENSE_CHUNKS_PER_THREAD, cpu_q4's and q4_tiles'
_F16_MAX = 65504.0


@intrinsic
def _float_to_half_bits(typingctx, value):
    """The fp16 bit pattern (int16) of an fp32 value, rounded to nearest even as torch does."""
    sig = types.int16(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@_njit()
def _padded(x, width):
    """x fp32 [cols] as a contiguous [width] vector, the pad zero (4-bit rows' whole blocks)."""
    if x.shape[0] == width:
        return x
    xp = np.zeros(width, dtype=np.float32)
    xp[: x.shape[0]] = x
    return xp


@_njit()
def linear(kind, wb, scale, x, threads):
    """y fp32 [n] = W x for x fp32 [cols] (contiguous); W's bytes wb uint8 [n, row bytes] of `kind`."""
    if kind < M_Q4MIN_TILES:
        return _linear_rows(kind, wb, scale, x, threads)
    # Q4_1: the Q4_0 rows' product, plus sum_b offset[i, b] * (sum of x over block b), as
    # Q4MinMatrix.linear adds them (block sums of the fp32 input, not of its int8 copy)
    y = _linear_rows(kind - Q4MIN_SHIFT, wb, scale, x, threads)
    nb = wb.shape[1] // 18
    sums = np.zeros(nb, dtype=np.float32)
    for j in range(x.shape[0]):
        sums[j // 32] += x[j]
    off = scale.reshape((y.shape[0], nb))
    for i in range(y.shape[0]):
        acc = np.float32(0.0)
        for b in range(nb):
            acc += off[i, b] * sums[b]
        y[i] += acc
    return y


@_njit()
def _linear_rows(kind, wb, scale, x, threads):
    chunks = _DENSE_CHUNKS_PER_THREAD * threads
    cols = x.shape[0]
    if kind == M_FP32:
        return K.matvec_rows(wb.view(np.float32), x, chunks)
    if kind == M_INT8_Q8:
        return K.linear_q8(wb.view(np.int8), scale, x.reshape((1, cols)), chunks)[0]
    if kind == M_INT8:
        return K.matvec_rows_int8(wb.view(np.int8), scale, x, chunks)
    nb = wb.shape[1] // 18
    width = nb * 32
    xp = _padded(x, width).reshape((1, width))
    if kind == M_Q4X8:
        xq = np.empty((1, width), dtype=np.int8)
        xd = np.empty((1, nb), dtype=np.float32)
        xm = np.empty((1, nb, 8), dtype=np.int32)
        Q.quantize_act_q4_rows(xp, xq, xd, xm)
        return QX.matmul_q4x8(wb, xq, xd, xm, chunks)[0]
    if kind == M_Q4_TILES:
        xq = np.empty((1, width), dtype=np.int8)
        xd = np.empty((1, nb), dtype=np.float32)
        xm = np.empty((1, nb, 8), dtype=np.int32)
        Q.quantize_act_q4_rows(xp, xq, xd, xm)
        xo = np.ascontiguousarray(xm[:, :, 0])
        return QT.tiles_kernel(wb, xq, xd, xo, chunks)[0]
    return Q.linear_q4(wb, xp, chunks)[0]


@_njit()
def _rms_norm(x, w, eps):
    """x * rsqrt(mean(x^2) + eps) * w, in fp32 as Norm computes it."""
    d = x.shape[0]
    acc = 0.0
    for j in range(d):
        acc += np.float64(x[j]) * np.float64(x[j])
    r = np.float32(1.0) / np.sqrt(np.float32(acc / d) + np.float32(eps))
    out = np.empty(d, dtype=np.float32)
    for j in range(d):
        out[j] = (x[j] * r) * w[j]
    return out


@_njit()
def _rotate(src, dst, cos, sin, pos, use_rope):
    """dst = rotate-half rotary of src [hd] at row `pos` of the cos/sin tables (or a copy)."""
    hd = src.shape[0]
    if not use_rope:
        for j in range(hd):
            dst[j] = src[j]
        return
    half = hd // 2
    for j in range(half):
        dst[j] = src[j] * cos[pos, j] + (-src[j + half]) * sin[pos, j]
    for j in range(half, hd):
        dst[j] = src[j] * cos[pos, j] + src[j - half] * sin[pos, j]


@_njit()
def _write_cache(cb, half, h, pos, vec):
    """Position `pos` of kv head h of a layer's cache (bytes [kvh, slots, hd * size]) = vec."""
    hd = vec.shape[0]
    if half:
        c16 = cb.view(np.int16)
        for j in range(hd):
            v = min(max(vec[j], np.float32(-_F16_MAX)), np.float32(_F16_MAX))  # no inf in the cache
            c16[h, pos, j] = _float_to_half_bits(v)
    else:
        c32 = cb.view(np.float32)
        for j in range(hd):
            c32[h, pos, j] = vec[j]


@_njit()
def _rows_call(rkind, gb, gs, ub, us, db, ds, x, pred, ids, use_pred, use_ids, pthr, gated, code, thr, acts, threads,
               idx, use_idx):
    """y fp32 [d] of FFN rows (ub.shape[0] > 0) as cpu.sparse_ffn(_predicted) computes them: the
    positions j < k (k = len(idx) with `use_idx`, each reading row idx[j]: the disk tier's cache
    slots; else every row); with `use_pred`, those whose logit (pred[ids[j]] with `use_ids`, else
    pred[j]) >= pthr, else all; acts fp32 [k] receives each one's activation (0: not selected or
    did not fire)."""
    k = idx.shape[0] if use_idx else ub.shape[0]
    d = x.shape[0]
    chunks = max(1, min(threads, k))
    if rkind == R_Q4:
        width = ub.shape[1] // 18 * 32
        y = Q.ffn_rows_q4_act(_padded(x, width), gb, ub, db, idx, use_idx, pred, ids, use_pred, use_ids, pthr,
                              gated, code, thr, acts, chunks)
        return y[:d]
    if rkind == R_INT8:
        return K.ffn_rows(x, gb.view(np.int8), gs, ub.view(np.int8), us, db.view(np.int8), ds, idx, use_idx,
                          pred, ids, use_pred, use_ids, pthr, gated, True, code, thr, acts, chunks)
    return K.ffn_rows(x, gb.view(np.float32), gs, ub.view(np.float32), us, db.view(np.float32), ds, idx, use_idx,
                      pred, ids, use_pred, use_ids, pthr, gated, False, code, thr, acts, chunks)


@_njit()
def _ffn_rows(rkind, gb, gs, ub, us, db, ds, x, logits, row_ids, pthr, gated, code, thr, threads):
    """The FFN rows whose logit (logits[row_ids[j]]) >= pthr: cpu.sparse_ffn_predicted's kernel call."""
    n = ub.shape[0]
    if n == 0:  # a tier without rows (everything hot, or nothing)
        return np.zeros(x.shape[0], dtype=np.float32)
    acts = np.empty(n, dtype=np.float32)
    return _rows_call(rkind, gb, gs, ub, us, db, ds, x, logits, row_ids, True, True, pthr, gated, code, thr, acts,
                      threads, np.empty(0, dtype=np.int64), False)


@_njit()
def _attend(x, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
            use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half):
    """A layer's attention half: x += attention(norm(x)) (times muP's residual scale), the
    token's K and V written to the cache at `pos`."""
    d = x.shape[0]
    q_size = n_heads * head_dim
    kv_size = kv_heads * head_dim
    # attention: norm, fused qkv, rotary, the cache write, the kernel over the cache
    h = _rms_norm(x, attn_w, eps)
    qkv = linear(qkv_kind, qkv_b, qkv_s, h, threads)
    q = np.empty((n_heads, head_dim), dtype=np.float32)
    for hh in range(n_heads):
        _rotate(qkv[hh * head_dim: (hh + 1) * head_dim], q[hh], cos, sin, pos, use_rope)
    kv = np.empty(head_dim, dtype=np.float32)
    for g in range(kv_heads):
        lo = q_size + g * head_dim
        _rotate(qkv[lo: lo + head_dim], kv, cos, sin, pos, use_rope)
        _write_cache(k_cache, kv_half, g, pos, kv)
        _write_cache(v_cache, kv_half, g, pos, qkv[lo + kv_size: lo + kv_size + head_dim])
    att = np.empty((n_heads, head_dim), dtype=np.float32)
    if kv_half:
        K.decode_attention_cache(q, k_cache.view(np.int16), v_cache.view(np.int16), pos + 1, attn_scale, att)
    else:
        K.decode_attention_cache(q, k_cache.view(np.float32), v_cache.view(np.float32), pos + 1, attn_scale, att)
    o = linear(out_kind, out_b, out_s, att.reshape(q_size), threads)
    rs = np.float32(res_scale)
    for j in range(d):
        x[j] = x[j] + (o[j] * rs if use_res_scale else o[j])


@_njit()
def _predict(x, fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s, threads):
    """The layer's predictor on the residual stream x: logits fp32 [n_ff] = fc2 relu(fc1 x)."""
    hidden = linear(fc1_kind, fc1_b, fc1_s, x, threads)
    for j in range(hidden.shape[0]):
        if hidden[j] < 0.0:
            hidden[j] = 0.0
    return linear(fc2_kind, fc2_b, fc2_s, hidden, threads)


@_njit()
def _hot_and_counts(y, hm, logits, pthr, gated, code, act_thr, threads, hot_kind, hot_gate_b, hot_gate_s, hot_up_b,
                    hot_up_s, hot_down_b, hot_down_s, hot_ids):
    """y (the cold rows' sum) += the hot rows' (summed before the cold rows', as HybridFfn does);
    returns the neurons predicted active and those of them among the hot rows."""
    t = np.float32(pthr)
    count = 0
    count_hot = 0
    for j in range(logits.shape[0]):
        if logits[j] >= t:
            count += 1
    if hot_ids.shape[0]:
        for j in range(hot_ids.shape[0]):
            if logits[hot_ids[j]] >= t:
                count_hot += 1
        y_hot = _ffn_rows(hot_kind, hot_gate_b, hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hm,
                          logits, hot_ids, pthr, gated, code, act_thr, threads)
        for j in range(y.shape[0]):
            y[j] = y_hot[j] + y[j]
    return count, count_hot


@_njit(nogil=True)
def decode_layer(x, pos, threads, cos, sin, pthr,
                 attn_w, mlp_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale, use_res_scale,
                 qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half,
                 ffn_kind, n_ff, gated, code, act_thr,
                 fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s,
                 rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, row_ids,
                 hot_kind, hot_gate_b, hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hot_ids,
                 gu_kind, gu_b, gu_s, dn_kind, dn_b, dn_s):
    """One llama-family layer's decode step for the token at position `pos`; x fp32 [d] (the
    residual stream) is updated in place. Returns the FFN neurons computed (predicted active;
    every one in a dense FFN) and those of them among the hot rows (the CPU standing in for
    the fast tier: rows `hot_*` of neurons hot_ids, summed before the cold rows' as HybridFfn does)."""
    d = x.shape[0]
    _attend(x, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
            use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half)
    rs = np.float32(res_scale)
    # FFN: norm, then the predicted rows (the predictor reads the residual stream) or all of them
    hm = _rms_norm(x, mlp_w, eps)
    count = 0
    count_hot = 0
    if ffn_kind == FFN_ROWS:
        logits = _predict(x, fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s, threads)
        y = _ffn_rows(rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, hm, logits, row_ids, pthr, gated,
                      code, act_thr, threads)
        count, count_hot = _hot_and_counts(y, hm, logits, pthr, gated, code, act_thr, threads, hot_kind, hot_gate_b,
                                           hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hot_ids)
    else:
        pre = linear(gu_kind, gu_b, gu_s, hm, threads)
        thr = np.float32(act_thr)
        act = np.empty(n_ff, dtype=np.float32)
        for i in range(n_ff):
            if gated:
                u = pre[n_ff + i]
                if code == _DRELU and u < 0.0:
                    u = np.float32(0.0)
                act[i] = K._nonlinearity(pre[i], code, thr) * u
            else:
                act[i] = K._nonlinearity(pre[i], code, thr)
        count = n_ff
        if ffn_kind == FFN_DENSE_LINEAR:
            y = linear(dn_kind, dn_b, dn_s, act, threads)
        else:
            y = K.combine_rows(act, dn_b.view(np.float32), _DENSE_CHUNKS_PER_THREAD * threads)
    for j in range(d):
        x[j] = x[j] + (y[j] * rs if use_res_scale else y[j])
    return count, count_hot


@_njit(nogil=True)
def decode_layer_front(x, pos, threads, cos, sin,
                       attn_w, mlp_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
                       use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half,
                       fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s):
    """The first half of `decode_layer` for a layer whose cold rows the disk tier's cache holds:
    attention (x updated in place), the FFN's norm and the predictor. Returns (hm, logits); the
    caller makes the predicted rows resident, then `decode_layer_rows`."""
    _attend(x, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
            use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half)
    hm = _rms_norm(x, mlp_w, eps)
    return hm, _predict(x, fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s, threads)


@_njit(nogil=True)
def decode_layer_rows(x, hm, logits, threads, pthr, res_scale, use_res_scale, gated, code, act_thr,
                      rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, slots, pred_ids,
                      hot_kind, hot_gate_b, hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hot_ids,
                      cold_y, use_cold_y):
    """The second half: the cold positions' rows read through their cache slots (slots int64
    [k], pred_ids their indices into logits, padded as the cache's kernels take them), or the
    cold part the caller computed (`use_cold_y`: a layer the cache holds only in rounds); the
    hot rows; the residual. The same positions in the same order and chunks as decode_layer's
    rows in RAM: the same bits. Returns decode_layer's counts."""
    d = x.shape[0]
    if use_cold_y:
        y = cold_y.copy()
    elif slots.shape[0] == 0:
        y = np.zeros(d, dtype=np.float32)
    else:
        acts = np.empty(slots.shape[0], dtype=np.float32)
        y = _rows_call(rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, hm, logits, pred_ids, True, True, pthr,
                       gated, code, act_thr, acts, threads, slots, True)
    count, count_hot = _hot_and_counts(y, hm, logits, pthr, gated, code, act_thr, threads, hot_kind, hot_gate_b,
                                       hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hot_ids)
    rs = np.float32(res_scale)
    for j in range(d):
        x[j] = x[j] + (y[j] * rs if use_res_scale else y[j])
    return count, count_hot


# A mixture's expert table (decode_moe_layer's `table`, int64 [2 tiers, E, 8]): per tier (0: the
# CPU tier's rows, 1: the hot rows where the CPU stands in for the fast tier, fp32) and expert,
# the rows held there and the addresses of their arrays: gate, its scales, up, its scales,
# down_t, its scales, then the int64 neuron ids of the rows (0: all of the expert's neurons,
# in order). 0 rows: the expert has none there. The arrays are wherever the tiers keep them
# (one tensor per expert, or views of a stacked or mapped layout): no copy into a layout of ours.
X_ROWS, X_GATE, X_GATE_S, X_UP, X_UP_S, X_DOWN, X_DOWN_S, X_IDS = range(8)
# The experts' predictors (`preds`, int64 [E, 4]): fc1's bytes and scales, fc2's bytes and scales.
P_FC1, P_FC1_S, P_FC2, P_FC2_S = range(4)


def _pointer_to(ty):
    """An intrinsic: an int64 address as a pointer to `ty` (numba.carray then views it)."""
    @intrinsic
    def at(typingctx, addr):
        sig = types.CPointer(ty)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return at


_u8_at, _f32_at, _i64_at = _pointer_to(types.uint8), _pointer_to(types.float32), _pointer_to(types.int64)


@_njit()
def _bytes_at(addr, rows, cols):
    """uint8 [rows, cols] at `addr` (empty for 0 rows)."""
    if rows == 0 or addr == 0:
        return np.empty((0, cols), dtype=np.uint8)
    return numba.carray(_u8_at(addr), (rows, cols))


@_njit()
def _f32s_at(addr, n):
    if n == 0 or addr == 0:
        return np.empty(0, dtype=np.float32)
    return numba.carray(_f32_at(addr), n)


@_njit()
def _ids_at(addr, n):
    if n == 0 or addr == 0:
        return np.empty(0, dtype=np.int64)
    return numba.carray(_i64_at(addr), n)


@_njit()
def _scaled(kind):
    return kind == M_INT8_Q8 or kind == M_INT8


@_njit()
def _route(logits, top_k, softmax, experts, weights):
    """The router's choice (engine.model.moe.route): experts int64 [k] = the top-k of logits fp32
    [E], best first (ties to the lower id), weights fp32 [k] = softmax over those k, or their
    sigmoids renormalised to sum 1."""
    n = logits.shape[0]
    taken = np.zeros(n, dtype=np.bool_)
    for s in range(top_k):
        best = -1
        for e in range(n):
            if not taken[e] and (best < 0 or logits[e] > logits[best]):
                best = e
        taken[best] = True
        experts[s] = best
        weights[s] = logits[best]
    total = np.float32(0.0)
    if softmax:
        top = weights[0]
        for s in range(top_k):
            weights[s] = np.exp(weights[s] - top)
            total += weights[s]
    else:
        for s in range(top_k):
            weights[s] = np.float32(1.0) / (np.float32(1.0) + np.exp(-weights[s]))
            total += weights[s]
    for s in range(top_k):
        weights[s] = weights[s] / total


@_njit()
def moe_ffn(route_x, hm, threads, router_kind, router_b, router_s, top_k, softmax,
            n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb, fc2_rb, preds,
            tier_kinds, tier_rb, table, chosen, weights, stats):
    """A mixture's FFN for one token: y fp32 [d]. The router reads route_x fp32 [d] (`_route`)
    and fills chosen int64 [k] and weights fp32 [k]; then `moe_experts`."""
    _route(linear(router_kind, router_b, router_s, route_x, threads), top_k, softmax, chosen, weights)
    return moe_experts(hm, threads, chosen, weights, n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb,
                       fc2_rb, preds, tier_kinds, tier_rb, table, stats)


@_njit()
def moe_experts(hm, threads, chosen, weights, n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb, fc2_rb,
                preds, tier_kinds, tier_rb, table, stats):
    """The chosen experts (chosen int64 [k], weights fp32 [k]) of one token: y fp32 [d]. Each
    reads hm fp32 [d] (the FFN's normed input): its rows in both tiers, the CPU tier's part
    first, each part times the expert's weight, summed in that order (as TieredMoe). Inside an
    expert the gate rows (with `use_pred`, only the neurons its predictor selects) and the up
    and down rows of the neurons that fired. Fills stats int64 [k, 2 tiers, 2]: rows selected
    (gate rows read) and fired."""
    d = hm.shape[0]
    y = np.zeros(d, dtype=np.float32)
    plog = np.empty(0, dtype=np.float32)
    t = np.float32(pthr)
    stats[:] = 0  # a tier without rows of an expert leaves its counts at 0
    for s in range(chosen.shape[0]):
        e = chosen[s]
        w = weights[s]
        if use_pred:  # the expert's predictor: logits fp32 [n_ff] of its neurons
            p = preds[e]
            hidden = linear(fc1_kind, _bytes_at(p[P_FC1], rank, fc1_rb),
                            _f32s_at(p[P_FC1_S], rank if _scaled(fc1_kind) else 0), hm, threads)
            for j in range(rank):
                if hidden[j] < 0.0:
                    hidden[j] = 0.0
            plog = linear(fc2_kind, _bytes_at(p[P_FC2], n_ff, fc2_rb),
                          _f32s_at(p[P_FC2_S], n_ff if _scaled(fc2_kind) else 0), hidden, threads)
        for tier in range(2):
            row = table[tier, e]
            n = row[X_ROWS]
            if n == 0:
                continue
            kind = tier_kinds[tier]
            rb = tier_rb[tier]
            ns = n if kind == R_INT8 else 0
            use_ids = row[X_IDS] != 0
            ids = _ids_at(row[X_IDS], n if use_ids else 0)
            acts = np.empty(n, dtype=np.float32)
            part = _rows_call(kind, _bytes_at(row[X_GATE], n, rb), _f32s_at(row[X_GATE_S], ns),
                              _bytes_at(row[X_UP], n, rb), _f32s_at(row[X_UP_S], ns),
                              _bytes_at(row[X_DOWN], n, rb), _f32s_at(row[X_DOWN_S], ns),
                              hm, plog, ids, use_pred, use_ids, pthr, True, code, 0.0, acts, threads,
                              np.empty(0, dtype=np.int64), False)
            for j in range(d):
                y[j] += part[j] * w
            fired = 0
            for j in range(n):
                if acts[j] != 0.0:
                    fired += 1
            selected = n
            if use_pred:
                selected = 0
                for j in range(n):
                    if plog[ids[j] if use_ids else j] >= t:
                        selected += 1
            stats[s, tier, 0] = selected
            stats[s, tier, 1] = fired
    return y


@_njit(parallel=True, nogil=True)
def moe_experts_tokens(hms, chosen, weights, n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb, fc2_rb,
                       preds, tier_kinds, tier_rb, table, stats):
    """`moe_experts` for each token of a prompt: hms fp32 [T, d], chosen int64 [T, k], weights
    fp32 [T, k], stats int64 [T, k, 2, 2] -> ys fp32 [T, d]. The tokens are split across the
    threads, each token computed alone on one thread: an expert that a prompt's token chooses
    is too small a piece to split (a 16-token prompt gives about 2 tokens an expert), so
    split by tokens the threads work side by side instead of in turn."""
    ys = np.empty_like(hms)
    for t in prange(hms.shape[0]):
        ys[t] = moe_experts(hms[t], 1, chosen[t], weights[t], n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank,
                            fc1_rb, fc2_rb, preds, tier_kinds, tier_rb, table, stats[t])
    return ys


@_njit(nogil=True)
def decode_moe_layer(x, pos, threads, cos, sin,
                     attn_w, mlp_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
                     use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half,
                     route_first, router_kind, router_b, router_s, top_k, softmax,
                     n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb, fc2_rb, preds,
                     tier_kinds, tier_rb, table, chosen, weights, stats):
    """One mixture-of-experts layer's decode step (engine.hotcold.moe_tiers.TieredMoe's), x updated
    in place: attention, then `moe_ffn` with the router on the layer input before attention
    (`route_first`, SmallThinker) or on the FFN's normed input (Mixtral)."""
    d = x.shape[0]
    x_in = x.copy()
    _attend(x, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
            use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_cache, v_cache, kv_half)
    hm = _rms_norm(x, mlp_w, eps)
    y = moe_ffn(x_in if route_first else hm, hm, threads, router_kind, router_b, router_s, top_k, softmax,
                n_ff, code, pthr, use_pred, fc1_kind, fc2_kind, rank, fc1_rb, fc2_rb, preds,
                tier_kinds, tier_rb, table, chosen, weights, stats)
    rs = np.float32(res_scale)
    for j in range(d):
        x[j] = x[j] + (y[j] * rs if use_res_scale else y[j])


@_njit(nogil=True)
def decode_head(x, threads, norm_w, eps, logit_scale, use_logit_scale, head_kind, head_b, head_s):
    """Logits fp32 [vocab] of the last token: the final RMSNorm, MiniCPM's logit scale, the head."""
    h = _rms_norm(x, norm_w, eps)
    if use_logit_scale:
        s = np.float32(logit_scale)
        for j in range(h.shape[0]):
            h[j] = h[j] * s
    return linear(head_kind, head_b, head_s, h, threads)


def loaded_from_cache() -> bool:
    """Whether this process took the layer and head functions from numba's disk cache (none compiled)."""
    fns = (decode_layer, decode_head)
    return all(sum(f.stats.cache_misses.values()) == 0 for f in fns)


__all__ = ["decode_layer", "decode_layer_front", "decode_layer_rows", "decode_moe_layer", "moe_ffn", "moe_experts",
           "moe_experts_tokens", "decode_head", "linear", "M_FP32", "M_INT8_Q8", "M_INT8",
           "M_Q4_TILES", "M_Q4", "M_Q4X8", "M_Q4MIN_TILES", "M_Q4MIN", "M_Q4MIN_X8",
           "R_FP32", "R_INT8", "R_Q4", "FFN_ROWS", "FFN_DENSE_LINEAR", "FFN_DENSE_COMBINE"]
