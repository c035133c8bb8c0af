"""numba kernels over 4-bit rows (the format of `q4_format`): the FFN rows and the products.

In this one file for the same disk-cache reason as `cpu_numba` (numba's cache is per file:
each kernel stays with the helpers it compiles). `ffn_rows_q4` is `cpu_numba.ffn_rows` over
4-bit rows (gathered by ids or by predictor logits, three passes, thread-private partial
sums); `matvec_rows_q4` the dense matrix-vector product of a decode step. The fp16 scale is
decoded from its bits in registers (numba has no fp16 arithmetic on the CPU). Importing this
module needs numba; `cpu_q4` (the dispatch) imports it only when numba_pool has the kernels,
and computes with torch otherwise.
"""

from __future__ import annotations

import numba  # noqa: F401 - read as kern.numba (numba_pool: the thread count)
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels import numba_jit
from engine.kernels.cpu_numba import HAS_AVX2  # noqa: F401 - read as kern.HAS_AVX2 (the host's, one home)
from engine.kernels.cpu_numba import prefetch_line

_njit = numba_jit.njit

# 2^(e - 25) for fp16 exponent e (1..30), 2^-24 for subnormals: value = mantissa * pow2[e]
pow2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)

@intrinsic
def prefetch(typingctx, rows, i, j):
    """Prefetch the line holding rows[i, j] into L2 (as cpu_numba's, see there why L2)."""
    sig = types.void(rows, i, j)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        arr = context.make_array(arrty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arrty, arr, [args[1], args[2]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        suffix = "p0" if str(i8p) == "ptr" else "p0i8"
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch." + suffix)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen

@_njit(inline="always")
def scale_of(w, i, o):
    """The fp16 scale at bytes o, o+1 of row i, as fp32 (inf/nan never stored)."""
    h = np.int32(w[i, o]) | (np.int32(w[i, o + 1]) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e != 0:
        m += 1024
    v = np.float32(m) * pow2[e]
    return -v if h & 0x8000 else v

@_njit(inline="always", fastmath=True)
def row_dot(w, i, x, ahead):
    """Row i . x (x padded to whole blocks); prefetches row `ahead` (>= 0) meanwhile."""
    nb = x.shape[0] // 32
    s = np.float32(0.0)
    for b in range(nb):
        o = b * 18
        if ahead >= 0 and (o & 63) < 18:
            prefetch(w, ahead, o)
        xb = b * 32
        p = np.float32(0.0)
        for j in range(16):
            q = np.int32(w[i, o + 2 + j])
            p += np.float32((q & 15) - 8) * x[xb + j] + np.float32((q >> 4) - 8) * x[xb + 16 + j]
        s += scale_of(w, i, o) * p
    return s

@_njit(inline="always", fastmath=True)
def row_axpy(part, c, a, w, i, ahead):
    """part[c] += a * row i (part padded to whole blocks); prefetches row `ahead`."""
    nb = part.shape[1] // 32
    for b in range(nb):
        o = b * 18
        if ahead >= 0 and (o & 63) < 18:
            prefetch(w, ahead, o)
        xb = b * 32
        ad = a * scale_of(w, i, o)
        for j in range(16):
            q = np.int32(w[i, o + 2 + j])
            part[c, xb + j] += ad * np.float32((q & 15) - 8)
            part[c, xb + 16 + j] += ad * np.float32((q >> 4) - 8)


@_njit(inline="always", fastmath=True)
def nonlinearity(g, code, thr):
    if code == 5:  # silu (CATS threshold when thr > 0)
        s = g / (np.float32(1.0) + np.exp(-g))
        return np.float32(0.0) if thr > 0.0 and abs(s) < thr else s
    if code == 1:  # fatrelu
        return g if g >= thr else np.float32(0.0)
    r = g if g > 0.0 else np.float32(0.0)
    if code == 3:  # relu2
        return r * r
    return r

@_njit(inline="always")
def next_live(acts, t, hi):
    while t < hi and acts[t] == 0.0:
        t += 1
    return t

@_njit(inline="always")
def positions(idx, use_idx, n, pred, pred_ids, use_pred, use_pred_ids):
    """The positions a row kernel walks (k ids, or all n rows), once every id is checked
    to be a row and every predictor id a logit: out-of-range ids would read arbitrary
    memory. (cpu_numba.ffn_rows checks the same in its own file: numba's disk cache
    tracks only the defining file, so a helper shared across files could go stale.)"""
    k = idx.shape[0] if use_idx else n
    if use_idx:
        for t in range(k):
            if idx[t] < 0 or idx[t] >= n:
                raise IndexError("active neuron id out of range")
    if use_pred and use_pred_ids:
        for t in range(n):
            if pred_ids[t] < 0 or pred_ids[t] >= pred.shape[0]:
                raise IndexError("row id out of range of the predictor logits")
    return k

@_njit(inline="always", fastmath=True)
def rows_pass(kind, w, idx, use_idx, acts, lo, hi, x, part, c, code, thr):
    """kind 0: acts[t] = nonlin(row . x); 1: acts[t] *= row . x (dReLU clamps it at 0);
    2: part[c] += acts[t] * row; over the positions whose acts[t] is nonzero. The row
    of the next live position is prefetched while this one is computed."""
    t = next_live(acts, lo, hi)
    while t < hi:
        i = idx[t] if use_idx else t
        t2 = next_live(acts, t + 1, hi)
        nxt = -1
        if t2 < hi:
            nxt = idx[t2] if use_idx else t2
        if kind == 2:
            row_axpy(part, c, acts[t], w, i, nxt)
        else:
            v = row_dot(w, i, x, nxt)
            if kind == 0:
                acts[t] = nonlinearity(v, code, thr)
            else:
                if code == 2 and v < 0.0:
                    v = np.float32(0.0)
                acts[t] *= v
        t = t2

@_njit(parallel=True, fastmath=True)
def ffn_rows_q4(x, gate, up, down, idx, use_idx, pred, pred_ids, use_pred, use_pred_ids, pthr,
                gated, code, thr, acts, nchunks):
    """`cpu_numba.ffn_rows` over 4-bit rows: x fp32 [nb * 32] (padded); gate/up/down
    uint8 [n, nb * 18]; returns y fp32 [nb * 32]."""
    width = x.shape[0]
    k = positions(idx, use_idx, up.shape[0], pred, pred_ids, use_pred, use_pred_ids)
    thr = np.float32(thr)
    pthr = np.float32(pthr)
    part = np.empty((nchunks, width), dtype=np.float32)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for j in range(width):
            part[c, j] = 0.0
        lo = min(k, c * per)
        hi = min(k, lo + per)
        for t in range(lo, hi):
            sel = True
            if use_pred:
                lg = pred[pred_ids[t]] if use_pred_ids else pred[t]
                sel = lg >= pthr
            acts[t] = 1.0 if sel else 0.0
        if gated:
            rows_pass(0, gate, idx, use_idx, acts, lo, hi, x, part, c, code, thr)
            rows_pass(1, up, idx, use_idx, acts, lo, hi, x, part, c, code, thr)
        else:
            rows_pass(0, up, idx, use_idx, acts, lo, hi, x, part, c, code, thr)
        rows_pass(2, down, idx, use_idx, acts, lo, hi, x, part, c, code, thr)
    y = np.zeros(width, dtype=np.float32)
    for c in range(nchunks):  # fixed order: the result does not depend on thread timing
        for j in range(width):
            y[j] += part[c, j]
    return y

@_njit(parallel=True, fastmath=True)
def matvec_rows_q4(w, x, nchunks):
    """y[i] = row i . x for every row of w uint8 [n, nb * 18]; x fp32 [nb * 32]. Two rows
    per pass over x: two independent sums keep the vector units busy."""
    n = w.shape[0]
    nb = x.shape[0] // 32
    y = np.empty(n, dtype=np.float32)
    per = (n + nchunks - 1) // nchunks
    for c in prange(nchunks):
        lo = c * per
        hi = min(n, lo + per)
        i = lo
        while i + 1 < hi:
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for b in range(nb):
                o = b * 18
                xb = b * 32
                p0 = np.float32(0.0)
                p1 = np.float32(0.0)
                for j in range(16):
                    xl = x[xb + j]
                    xh = x[xb + 16 + j]
                    q0 = np.int32(w[i, o + 2 + j])
                    q1 = np.int32(w[i + 1, o + 2 + j])
                    p0 += np.float32((q0 & 15) - 8) * xl + np.float32((q0 >> 4) - 8) * xh
                    p1 += np.float32((q1 & 15) - 8) * xl + np.float32((q1 >> 4) - 8) * xh
                s0 += scale_of(w, i, o) * p0
                s1 += scale_of(w, i + 1, o) * p1
            y[i] = s0
            y[i + 1] = s1
            i += 2
        if i < hi:
            y[i] = row_dot(w, i, x, -1)
    return y


# ---- int8 x 4-bit products (llama.cpp's Q4_0 x Q8_0 scheme, AVX2) ---------------------
# The kernels above convert every nibble to fp32 before its multiply-add: about six
# vector instructions per 8 weights, compute-bound at a quarter of what memory gives.
# Quantizing the activation to int8 in blocks of 32 (one fp32 scale a block, as the
# weights' blocks) lets a block of one row run as: load 16 bytes, split the nibbles
# (shift, and), vpmaddubsw (unsigned nibble x signed int8), vpmaddwd, subtract 8 x the
# block's activation sum (the nibbles' offset, precomputed once per vector instead of
# subtracting 8 from every nibble), convert, one fp32 multiply-add by d_w * d_x. LLVM
# does not find this from a plain loop, so the block loop is written in LLVM IR; four
# rows (any four, gathered or consecutive) share each activation load.

def _call(builder, name, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

# The block loops prefetch, at each block, the same block of the rows the caller computes
# next (the next group of four, or the next gathered row): one group's work ahead, about
# the latency of DRAM. Prefetching 512 bytes ahead within the row instead left the dense
# product waiting on memory (32000 x 4096 head, one thread: 8.3 vs 14.2 ms of CPU).

def _prefetch(builder, ptr):
    prefetch_line(builder, ptr, locality=2)

@intrinsic
def dot4_q4_avx2(typingctx, w, i0, i1, i2, i3, xq, xd, xm, n0, n1, n2, n3):
    """(w[i_k] . x) for k = 0..3, fp32: w uint8 [n, nb * 18] 4-bit rows; x quantized by
    `quantize_act_q4`: xq int8 [nb * 32], xd fp32 [nb] block scales, xm int32 [nb, 8]
    (lane 0: 8 x the block's sum of xq, the rest 0). Rows n0..n3 (the next four the
    caller computes; valid rows) are prefetched block by block meanwhile. The four fp16
    scales of a block are widened in one instruction (a vector built from zeros: a scalar
    widening merged into a live register and tied the rows to one accumulator's chain)."""
    sig = types.UniTuple(types.float32, 4)(w, i0, i1, i2, i3, xq, xd, xm, n0, n1, n2, n3)

    def codegen(context, builder, signature, args):
        wty, xqty, xdty, xmty = signature.args[0], signature.args[5], signature.args[6], signature.args[7]
        wa = context.make_array(wty)(context, builder, args[0])
        xqa = context.make_array(xqty)(context, builder, args[5])
        xda = context.make_array(xdty)(context, builder, args[6])
        xma = context.make_array(xmty)(context, builder, args[7])
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        f32 = ir.FloatType()
        v16i8, v32i8 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
        v16i16, v8i32, v8f32 = ir.VectorType(i16, 16), ir.VectorType(i32, 8), ir.VectorType(f32, 8)
        zero = i64(0)
        rows = [context.cast(builder, args[1 + k], signature.args[1 + k], types.int64) for k in range(4)]
        rptrs = [cgutils.get_item_pointer(context, builder, wty, wa, [r, zero], wraparound=False) for r in rows]
        ahead = [context.cast(builder, args[8 + k], signature.args[8 + k], types.int64) for k in range(4)]
        aptrs = [cgutils.get_item_pointer(context, builder, wty, wa, [r, zero], wraparound=False) for r in ahead]
        v8i16, v8f16, v4f32 = ir.VectorType(i16, 8), ir.VectorType(ir.HalfType(), 8), ir.VectorType(f32, 4)
        first4 = ir.Constant(ir.VectorType(i32, 4), [i32(j) for j in range(4)])
        xqp = cgutils.get_item_pointer(context, builder, xqty, xqa, [zero], wraparound=False)
        xdp = cgutils.get_item_pointer(context, builder, xdty, xda, [zero], wraparound=False)
        xmp = cgutils.get_item_pointer(context, builder, xmty, xma, [zero, zero], wraparound=False)
        nb = cgutils.unpack_tuple(builder, xda.shape)[0]
        ones = ir.Constant(v16i16, [i16(1)] * 16)
        low4 = ir.Constant(v16i8, [i8(15)] * 16)
        four = ir.Constant(v16i8, [i8(4)] * 16)
        cat = ir.Constant(ir.VectorType(i32, 32), [i32(j) for j in range(32)])
        acc = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(4)]

        with cgutils.for_range(builder, nb) as blk:
            b = blk.index
            xv = builder.load(builder.bitcast(builder.gep(xqp, [builder.mul(b, i64(32))]), v32i8.as_pointer()),
                              align=1)
            mv = builder.load(builder.bitcast(builder.gep(xmp, [builder.mul(b, i64(8))]), v8i32.as_pointer()),
                              align=4)
            xs = builder.load(builder.gep(xdp, [b]))
            wo = builder.mul(b, i64(18))
            ps = [builder.gep(rptrs[k], [wo]) for k in range(4)]
            # d_w * d_x of the four rows: their fp16 scales gathered into one vector, widened at once
            h = ir.Constant(v8i16, [i16(0)] * 8)
            for k in range(4):
                h = builder.insert_element(h, builder.load(builder.bitcast(ps[k], i16.as_pointer()), align=1), i32(k))
            dw = builder.fpext(builder.shuffle_vector(builder.bitcast(h, v8f16), ir.Constant(v8f16, None), first4),
                               v4f32)
            xs4 = builder.shuffle_vector(builder.insert_element(ir.Constant(v4f32, None), xs, i32(0)),
                                         ir.Constant(v4f32, None), ir.Constant(ir.VectorType(i32, 4), [i32(0)] * 4))
            d4 = builder.fmul(dw, xs4)
            for k in range(4):
                p = ps[k]
                _prefetch(builder, builder.gep(aptrs[k], [wo]))
                nib = builder.load(builder.bitcast(builder.gep(p, [i64(2)]), v16i8.as_pointer()), align=1)
                q = builder.shuffle_vector(builder.and_(nib, low4), builder.lshr(nib, four), cat)
                p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, q, xv)
                p32 = builder.sub(_call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, p16, ones), mv)
                sc = builder.shuffle_vector(d4, ir.Constant(v4f32, None),
                                            ir.Constant(ir.VectorType(i32, 8), [i32(k)] * 8))
                f = builder.sitofp(p32, v8f32)
                builder.store(_call(builder, "llvm.fma.v8f32", v8f32, f, sc, builder.load(acc[k])), acc[k])
        sums = []
        for k in range(4):
            v = builder.load(acc[k])
            s = builder.extract_element(v, i32(0))
            for lane in range(1, 8):
                s = builder.fadd(s, builder.extract_element(v, i32(lane)))
            sums.append(s)
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen

@intrinsic
def axpy_q4_avx2(typingctx, part, c, a, w, i, ahead):
    """part[c, :] += a * row i of w (uint8 [n, nb * 18] 4-bit rows; part fp32 [C, nb * 32]):
    per block, the nibbles less 8 widened to fp32 in registers, one multiply-add by a * d_w
    per 8 weights. Written in vector IR so the block is one straight run of AVX2 code.
    Row `ahead` (the next one the caller adds; a valid row) is prefetched block by block."""
    sig = types.void(part, c, a, w, i, ahead)

    def codegen(context, builder, signature, args):
        pty, wty = signature.args[0], signature.args[3]
        pa = context.make_array(pty)(context, builder, args[0])
        wa = context.make_array(wty)(context, builder, args[3])
        i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
        f32 = ir.FloatType()
        v16i8, v32i8 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
        v32f32 = ir.VectorType(f32, 32)
        zero = i64(0)
        cc = context.cast(builder, args[1], signature.args[1], types.int64)
        row = context.cast(builder, args[4], signature.args[4], types.int64)
        av = context.cast(builder, args[2], signature.args[2], types.float32)
        pp = cgutils.get_item_pointer(context, builder, pty, pa, [cc, zero], wraparound=False)
        rp = cgutils.get_item_pointer(context, builder, wty, wa, [row, zero], wraparound=False)
        nxt = context.cast(builder, args[5], signature.args[5], types.int64)
        ap = cgutils.get_item_pointer(context, builder, wty, wa, [nxt, zero], wraparound=False)
        nb = builder.sdiv(cgutils.unpack_tuple(builder, pa.shape)[1], i64(32))
        low4 = ir.Constant(v16i8, [i8(15)] * 16)
        four = ir.Constant(v16i8, [i8(4)] * 16)
        eight = ir.Constant(v32i8, [i8(8)] * 32)
        cat = ir.Constant(ir.VectorType(i32, 32), [i32(j) for j in range(32)])
        splat0 = ir.Constant(ir.VectorType(i32, 32), [i32(0)] * 32)
        with cgutils.for_range(builder, nb) as blk:
            b = blk.index
            p = builder.gep(rp, [builder.mul(b, i64(18))])
            _prefetch(builder, builder.gep(ap, [builder.mul(b, i64(18))]))
            dw = builder.fpext(builder.bitcast(builder.load(builder.bitcast(p, i16.as_pointer()), align=1),
                                               ir.HalfType()), f32)
            nib = builder.load(builder.bitcast(builder.gep(p, [i64(2)]), v16i8.as_pointer()), align=1)
            q = builder.sub(builder.shuffle_vector(builder.and_(nib, low4), builder.lshr(nib, four), cat), eight)
            sc = builder.insert_element(ir.Constant(v32f32, None), builder.fmul(av, dw), i32(0))
            sc = builder.shuffle_vector(sc, ir.Constant(v32f32, None), splat0)
            dst = builder.bitcast(builder.gep(pp, [builder.mul(b, i64(32))]), v32f32.as_pointer())
            acc = builder.load(dst, align=4)
            builder.store(_call(builder, "llvm.fma.v32f32", v32f32, builder.sitofp(q, v32f32), sc, acc), dst,
                          align=4)
        return context.get_dummy_value()

    return sig, codegen

@_njit()
def quantize_act_q4(x, xq, xd, xm):
    """x fp32 [nb * 32] -> xq int8 [nb * 32] in blocks of 32 (llama.cpp's Q8_0: scale
    max|x| / 127, xq = rint(x / scale)), xd fp32 [nb] the scales, xm int32 [nb, 8]:
    lane 0 is 8 x the block's sum of xq (the nibble offset's share), the rest 0."""
    nb = xd.shape[0]
    for b in range(nb):
        m = np.float32(0.0)
        for j in range(32):
            a = abs(x[b * 32 + j])
            if a > m:
                m = a
        s = m / np.float32(127.0)
        xd[b] = s
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        tot = 0
        for j in range(32):
            v = np.rint(x[b * 32 + j] * inv)
            if v > 127.0:
                v = 127.0
            elif v < -127.0:
                v = -127.0
            q = np.int8(v)
            xq[b * 32 + j] = q
            tot += np.int32(q)
        xm[b, 0] = 8 * tot
        for lane in range(1, 8):
            xm[b, lane] = 0

@_njit(parallel=True, fastmath=True)
def matvec_q4_avx2(w, xq, xd, xm, nchunks):
    """y[i] = row i . x for every row of w uint8 [n, nb * 18] (n >= 1), x as
    `quantize_act_q4` leaves it. Four rows per pass."""
    n = w.shape[0]
    y = np.empty(n, dtype=np.float32)
    groups = (n + 3) // 4
    per = (groups + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for g in range(c * per, min(groups, (c + 1) * per)):
            i = g * 4
            s = dot4_q4_avx2(w, i, min(i + 1, n - 1), min(i + 2, n - 1), min(i + 3, n - 1), xq, xd, xm,
                             min(i + 4, n - 1), min(i + 5, n - 1), min(i + 6, n - 1), min(i + 7, n - 1))
            for k in range(min(4, n - i)):
                y[i + k] = s[k]
    return y

@_njit()
def quantize_act_q4_rows(x, xq, xd, xm):
    """`quantize_act_q4` for each row of x fp32 [T, nb * 32] (xq [T, ..], xd [T, nb], xm [T, nb, 8])."""
    for t in range(x.shape[0]):
        quantize_act_q4(x[t], xq[t], xd[t], xm[t])

@_njit()
def linear_q4(w, x, nchunks):
    """`matmul_q4_avx2` of x fp32 [T, nb * 32] (padded) quantized by `quantize_act_q4_rows`,
    in one call from Python: one transition per product instead of two, no Python-side buffers."""
    T, width = x.shape
    nb = width // 32
    xq = np.empty((T, width), dtype=np.int8)
    xd = np.empty((T, nb), dtype=np.float32)
    xm = np.empty((T, nb, 8), dtype=np.int32)
    quantize_act_q4_rows(x, xq, xd, xm)
    return matmul_q4_avx2(w, xq, xd, xm, nchunks)

# A many-token product reads each group of 4 rows from memory once and runs every token
# over it while it sits in L1 (4 rows of 4096 weights: 9 KB).
@_njit(parallel=True, fastmath=True)
def matmul_q4_avx2(w, xq, xd, xm, nchunks):
    """y[t, i] = row i . x[t] for every row of w uint8 [n, nb * 18] (n >= 1) and token t
    of x as `quantize_act_q4_rows` leaves it -> fp32 [T, n]."""
    n = w.shape[0]
    T = xq.shape[0]
    y = np.empty((T, n), dtype=np.float32)
    groups = (n + 3) // 4
    per = (groups + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for g in range(c * per, min(groups, (c + 1) * per)):
            i = g * 4
            for t in range(T):
                a = i + 4 if t == 0 else i  # the first token's pass prefetches the next group
                s = dot4_q4_avx2(w, i, min(i + 1, n - 1), min(i + 2, n - 1), min(i + 3, n - 1), xq[t], xd[t],
                                 xm[t], min(a, n - 1), min(a + 1, n - 1), min(a + 2, n - 1), min(a + 3, n - 1))
                for k in range(min(4, n - i)):
                    y[t, i + k] = s[k]
    return y

@_njit(inline="always")
def row_at(idx, use_idx, sel, j, m):
    """The row of selection position j, clamped to the last (m >= 1)."""
    t = sel[min(j, m - 1)]
    return idx[t] if use_idx else t

@_njit(inline="always", fastmath=True)
def dots_pass(kind, w, idx, use_idx, sel, m, acts, xq, xd, xm, code, thr):
    """Over the positions sel[0..m): kind 0: acts[t] = nonlin(row . x); kind 1:
    acts[t] *= row . x (dReLU clamps it at 0). Four rows per call of the product, which
    prefetches the next group's rows meanwhile (the first group's first lines here)."""
    for k in range(min(m, 4)):
        prefetch(w, idx[sel[k]] if use_idx else sel[k], 0)
        prefetch(w, idx[sel[k]] if use_idx else sel[k], 64)
    for g in range(0, m, 4):
        r0 = row_at(idx, use_idx, sel, g, m)
        r1 = row_at(idx, use_idx, sel, g + 1, m)
        r2 = row_at(idx, use_idx, sel, g + 2, m)
        r3 = row_at(idx, use_idx, sel, g + 3, m)
        s = dot4_q4_avx2(w, r0, r1, r2, r3, xq, xd, xm, row_at(idx, use_idx, sel, g + 4, m),
                         row_at(idx, use_idx, sel, g + 5, m), row_at(idx, use_idx, sel, g + 6, m),
                         row_at(idx, use_idx, sel, g + 7, m))
        for k in range(min(4, m - g)):
            t = sel[g + k]
            v = s[k]
            if kind == 0:
                acts[t] = nonlinearity(v, code, thr)
            else:
                if code == 2 and v < 0.0:
                    v = np.float32(0.0)
                acts[t] *= v

@_njit()
def ffn_rows_q4_act(x, gate, up, down, idx, use_idx, pred, pred_ids, use_pred, use_pred_ids, pthr, gated, code,
                    thr, acts, nchunks):
    """`ffn_rows_q4_avx2` of x fp32 [nb * 32] (padded), quantized here: one call from Python."""
    nb = x.shape[0] // 32
    xq = np.empty(nb * 32, dtype=np.int8)
    xd = np.empty(nb, dtype=np.float32)
    xm = np.empty((nb, 8), dtype=np.int32)
    quantize_act_q4(x, xq, xd, xm)
    return ffn_rows_q4_avx2(xq, xd, xm, gate, up, down, idx, use_idx, pred, pred_ids, use_pred, use_pred_ids,
                            pthr, gated, code, thr, acts, nchunks)

@_njit()
def ffn_rows_q4_act_each(xs, gate, up, down, pred, pred_ids, use_pred, use_pred_ids, pthr, gated, code, thr, acts,
                         nchunks):
    """`ffn_rows_q4_act` over every row for each token of xs fp32 [T, nb * 32] (padded) alone:
    ys fp32 [T, nb * 32], acts fp32 [T, n]; with `use_pred`, token t's rows those pred[t]
    selects (pred fp32 [T, m]). A prompt's tokens of one expert in one call from Python, the
    same bits as a call per token."""
    ys = np.empty_like(xs)
    no_ids = np.empty(0, dtype=np.int64)
    no_pred = np.empty(0, dtype=np.float32)
    for t in range(xs.shape[0]):
        ys[t] = ffn_rows_q4_act(xs[t], gate, up, down, no_ids, False, pred[t] if use_pred else no_pred, pred_ids,
                                use_pred, use_pred_ids, pthr, gated, code, thr, acts[t], nchunks)
    return ys


@_njit(parallel=True, fastmath=True)
def ffn_rows_q4_avx2(xq, xd, xm, gate, up, down, idx, use_idx, pred, pred_ids, use_pred, use_pred_ids,
                     pthr, gated, code, thr, acts, nchunks):
    """`ffn_rows_q4` with the gate and up products on int8 x 4-bit (x quantized by
    `quantize_act_q4`); the down rows are added in fp32 as there. Returns y fp32 [nb * 32]."""
    width = xq.shape[0]
    k = positions(idx, use_idx, up.shape[0], pred, pred_ids, use_pred, use_pred_ids)
    thr = np.float32(thr)
    pthr = np.float32(pthr)
    part = np.empty((nchunks, width), dtype=np.float32)
    per = (k + nchunks - 1) // nchunks
    for c in prange(nchunks):
        for j in range(width):
            part[c, j] = 0.0
        lo = min(k, c * per)
        hi = min(k, lo + per)
        sel = np.empty(max(1, hi - lo), dtype=np.int64)
        m = 0
        for t in range(lo, hi):
            on = True
            if use_pred:
                lg = pred[pred_ids[t]] if use_pred_ids else pred[t]
                on = lg >= pthr
            acts[t] = 0.0
            if on:
                sel[m] = t
                m += 1
        dots_pass(0, gate if gated else up, idx, use_idx, sel, m, acts, xq, xd, xm, code, thr)
        live = 0
        for s_ in range(m):
            if acts[sel[s_]] != 0.0:
                sel[live] = sel[s_]
                live += 1
        if gated and live:
            dots_pass(1, up, idx, use_idx, sel, live, acts, xq, xd, xm, code, thr)
        for s_ in range(live):
            t = sel[s_]
            a = acts[t]
            if a != 0.0:
                axpy_q4_avx2(part, c, a, down, idx[t] if use_idx else t, row_at(idx, use_idx, sel, s_ + 1, live))
    y = np.zeros(width, dtype=np.float32)
    for c in range(nchunks):  # fixed order: the result does not depend on thread timing
        for j in range(width):
            y[j] += part[c, j]
    return y
