"""4-bit matrices read whole (attention projections, the head, dense FFNs, predictors) in an
interleaved layout: groups of 8 rows whose blocks sit side by side, so one AVX2 register holds
a piece of the same block of all 8 rows and the products need no horizontal sums.

Layout of a packed matrix of n rows of `cols` weights: the same bytes as its plain 4-bit rows
(`cpu_q4`: ggml's block_q4_0, RB = 18 * nb bytes a row, nb = ceil(cols / 32)), and the same
tensor shape uint8 [n, RB], rearranged group by group. Rows 8g..8g+7 (g < n // 8) occupy the
8 * RB bytes of tensor rows 8g..8g+7 as:

    nb x 16 bytes   block b's 8 fp16 scales, row 0 first (one vcvtph2ps widens them)
    nb x 128 bytes  block b's nibbles: 4 pieces of 32 bytes; piece c holds bytes 4c..4c+3
                    of each row's 16 nibble bytes, row 0 first

so piece c's low nibbles are weights 4c..4c+3 and its high nibbles weights 16+4c..16+4c+3
of each of the 8 rows, one row per 32-bit lane. The last n % 8 rows stay plain rows. A
packed matrix is never gathered by rows: `unpack_rows` gives plain rows back where a row
range is needed (dequantize, another tier).

Products (llama.cpp's Q8_0 x Q4_0 scheme, the activation quantized to int8 blocks by
`cpu_q4.quantize_act_q4_rows`; the idea of interleaving rows at load is ggml's "q4_0_8x8"
repacking): per block and 8 rows, the 4 pieces are split into low and high nibbles (and,
shift), each multiplied by the activation's matching 4 bytes broadcast to every lane
(vpmaddubsw), the 8 products summed in 16 bits (each lane at most 8 x 2 x 15 x 128 = 30720
< 32767, so nothing saturates), one vpmaddwd gives the 8 rows' block sums, less 8 x the
activation block's sum (the nibbles' offset), converted and multiplied-added by the 8 rows'
scales times the activation block's scale: the accumulator's lanes are the 8 rows' results.
About 45 vector instructions per block of 8 rows, against about 12 per block of one row in
`cpu_q4.dot4_q4_avx2`. Many tokens share each unpacked block (`K_TOKENS` at a time).
The integer block products are those of `cpu_q4`'s kernels; only the fp32 sums' order differs.

Measured on the 2-core EPYC (bench.vs_llamacpp's 2-layer 7B-shape model, sparse int4, fused
decode, the same process alternating layouts): 12.6 ms a token packed, 14.7 ms as rows.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cpu_q4, numba_jit, numba_pool, q4_format, q4_quantize

GROUP = 8  # rows per interleaved group
K_TOKENS = 4  # tokens per pass over a group (fewer tokens: one at a time)
_CHUNKS_PER_THREAD = 8
PREFETCH_AHEAD = 4096  # bytes ahead of the block read that each block prefetches (1 thread, 32000 x 4096:
# 0: 8.2, 2048: 8.9, 3072: 9.5, 4096: 10.5, 6144: 10.3 GB/s on a loaded 2-core EPYC)


# ---------------------------------------------------------------------- layout (torch)
def packed_rows(n: int) -> int:
    """Rows of an n-row matrix that sit in interleaved groups (the rest stay plain)."""
    return n // GROUP * GROUP


def pack_rows(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain 4-bit rows uint8 [n, RB] -> the packed layout (same shape; into `out` if given)."""
    n, rb = q.shape
    nb = rb // q4_format.BLOCK_BYTES
    ng = n // GROUP
    out = torch.empty_like(q) if out is None else out
    if ng:
        full = q[:ng * GROUP].reshape(ng, GROUP, nb, q4_format.BLOCK_BYTES)
        dst = out[:ng * GROUP].reshape(ng, GROUP * rb)
        dst[:, :nb * 16].view(ng, nb, GROUP, 2).copy_(full[:, :, :, :2].permute(0, 2, 1, 3))
        dst[:, nb * 16:].view(ng, nb, 4, GROUP, 4).copy_(
            full[:, :, :, 2:].reshape(ng, GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4))
    out[ng * GROUP:] = q[ng * GROUP:]
    return out


def unpack_rows(q: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Rows lo..hi of a packed matrix uint8 [n, RB] as plain 4-bit rows (a new tensor)."""
    n, rb = q.shape
    hi = n if hi is None else min(hi, n)
    lo = max(0, min(lo, hi))
    nb = rb // q4_format.BLOCK_BYTES
    full = packed_rows(n)
    g0, g1 = lo // GROUP, (min(hi, full) + GROUP - 1) // GROUP
    parts = []
    if g1 > g0:
        src = q[g0 * GROUP:g1 * GROUP].reshape(g1 - g0, GROUP * rb)
        rows = torch.empty((g1 - g0, GROUP, nb, q4_format.BLOCK_BYTES), dtype=torch.uint8)
        rows[:, :, :, :2] = src[:, :nb * 16].reshape(g1 - g0, nb, GROUP, 2).permute(0, 2, 1, 3)
        rows[:, :, :, 2:] = (src[:, nb * 16:].reshape(g1 - g0, nb, 4, GROUP, 4).permute(0, 3, 1, 2, 4)
                             .reshape(g1 - g0, GROUP, nb, 16))
        rows = rows.reshape((g1 - g0) * GROUP, rb)
        parts.append(rows[lo - g0 * GROUP:min(hi, full) - g0 * GROUP])
    if hi > full:
        parts.append(q[max(lo, full):hi])
    if not parts:
        return torch.empty((0, rb), dtype=torch.uint8)
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


# ---------------------------------------------------------------------- numba kernels
try:
    import numba
    from llvmlite import ir
    from numba import prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except Exception:  # noqa: BLE001 - no numba: torch computes from the unpacked rows instead
    numba = None


if numba is not None:
    from engine.kernels.cpu_numba import prefetch_line

    def _call(builder, name, ret, *args):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

    def _splat(builder, value, vty):
        v = builder.insert_element(ir.Constant(vty, None), value, ir.IntType(32)(0))
        return builder.shuffle_vector(v, ir.Constant(vty, None),
                                      ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count))

    def _prefetch(builder, ptr):
        prefetch_line(builder, ptr, locality=3)

    def _group_tokens(tokens: int, ahead: int = PREFETCH_AHEAD):
        @intrinsic
        def group_tokens(typingctx, w, g, xq, xd, xm, y, t0):
            """Rows 8g..8g+7 of the packed w uint8 [n, RB] times tokens t0..t0+tokens-1 of x
            (xq int8 [T, nb * 32], xd fp32 [T, nb], xm int32 [T, nb, 8] lane 0: 8 x the block's
            sum of xq, as `cpu_q4.quantize_act_q4_rows` fills them) -> y[t, 8g..8g+7]."""
            sig = types.void(w, g, xq, xd, xm, y, t0)

            def codegen(context, builder, signature, args):
                wty, gty, xqty, xdty, xmty, yty, tty = signature.args
                wa = context.make_array(wty)(context, builder, args[0])
                xqa = context.make_array(xqty)(context, builder, args[2])
                xda = context.make_array(xdty)(context, builder, args[3])
                xma = context.make_array(xmty)(context, builder, args[4])
                ya = context.make_array(yty)(context, builder, args[5])
                i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
                f32 = ir.FloatType()
                v32i8, v16i16, v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
                v8i16, v8f16, v8f32 = ir.VectorType(i16, 8), ir.VectorType(ir.HalfType(), 8), ir.VectorType(f32, 8)
                zero = i64(0)
                grp = context.cast(builder, args[1], gty, types.int64)
                tok0 = context.cast(builder, args[6], tty, types.int64)
                nb = cgutils.unpack_tuple(builder, xda.shape)[1]
                base = cgutils.get_item_pointer(context, builder, wty, wa, [zero, zero], wraparound=False)
                gp = builder.gep(base, [builder.mul(grp, builder.mul(nb, i64(GROUP * q4_format.BLOCK_BYTES)))])
                nibs = builder.gep(gp, [builder.mul(nb, i64(16))])
                toks = [builder.add(tok0, i64(k)) for k in range(tokens)]
                xqp = [cgutils.get_item_pointer(context, builder, xqty, xqa, [t, zero], wraparound=False) for t in toks]
                xdp = [cgutils.get_item_pointer(context, builder, xdty, xda, [t, zero], wraparound=False) for t in toks]
                xmp = [cgutils.get_item_pointer(context, builder, xmty, xma, [t, zero, zero], wraparound=False)
                       for t in toks]
                low4 = ir.Constant(v32i8, [i8(15)] * 32)
                four = ir.Constant(v32i8, [i8(4)] * 32)
                ones = ir.Constant(v16i16, [i16(1)] * 16)
                acc = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(tokens)]
                with cgutils.for_range(builder, nb) as blk:
                    b = blk.index
                    sp = builder.bitcast(builder.gep(gp, [builder.mul(b, i64(16))]), v8i16.as_pointer())
                    dw = builder.fpext(builder.bitcast(builder.load(sp, align=2), v8f16), v8f32)
                    bp = builder.gep(nibs, [builder.mul(b, i64(128))])
                    if ahead:
                        for line in (0, 64):
                            _prefetch(builder, builder.gep(bp, [i64(ahead + line)]))
                        _prefetch(builder, builder.gep(builder.bitcast(sp, i8.as_pointer()), [i64(ahead)]))
                    qs = []
                    for c in range(4):
                        v = builder.load(builder.bitcast(builder.gep(bp, [i64(32 * c)]), v32i8.as_pointer()), align=1)
                        qs.append((builder.and_(v, low4), builder.lshr(v, four)))
                    for k in range(tokens):
                        xb = builder.gep(xqp[k], [builder.mul(b, i64(32))])
                        prods = []
                        for c in range(4):
                            for half, q in ((0, qs[c][0]), (16, qs[c][1])):
                                p = builder.bitcast(builder.gep(xb, [i64(half + 4 * c)]), i32.as_pointer())
                                xv = builder.bitcast(_splat(builder, builder.load(p, align=1), v8i32), v32i8)
                                prods.append(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, q, xv))
                        while len(prods) > 1:  # a tree: short dependency chains
                            prods = [builder.add(prods[j], prods[j + 1]) for j in range(0, len(prods), 2)]
                        s = _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, prods[0], ones)
                        off = builder.load(builder.gep(xmp[k], [builder.mul(b, i64(8))]))
                        s = builder.sub(s, _splat(builder, off, v8i32))
                        xs = _splat(builder, builder.load(builder.gep(xdp[k], [b])), v8f32)
                        builder.store(_call(builder, "llvm.fma.v8f32", v8f32, builder.sitofp(s, v8f32),
                                            builder.fmul(dw, xs), builder.load(acc[k])), acc[k])
                col = builder.mul(grp, i64(GROUP))
                for k in range(tokens):
                    yp = cgutils.get_item_pointer(context, builder, yty, ya, [toks[k], col], wraparound=False)
                    builder.store(builder.load(acc[k]), builder.bitcast(yp, v8f32.as_pointer()), align=4)
                return context.get_dummy_value()

            return sig, codegen

        return group_tokens

    # module-level, so numba's disk cache keeps the kernels that use them
    group_tokens_k = _group_tokens(K_TOKENS)
    group_tokens_1 = _group_tokens(1)

    @intrinsic
    def half_to_float(typingctx, bits):
        """fp32 of the fp16 bit pattern `bits` (uint16/int32)."""
        sig = types.float32(bits)

        def codegen(context, builder, signature, args):
            h = builder.trunc(args[0], ir.IntType(16)) if args[0].type.width > 16 else args[0]
            return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())

        return sig, codegen

    _njit = numba_jit.njit

    @_njit(fastmath=True)
    def plain_row_dot(w, i, xq, xd, xm, t):
        """Plain 4-bit row i . token t (the same integer block products; the tail rows)."""
        nb = xd.shape[1]
        s = np.float32(0.0)
        for b in range(nb):
            o = b * 18
            acc = np.int32(0)
            for j in range(16):
                q = np.int32(w[i, o + 2 + j])
                acc += (q & 15) * np.int32(xq[t, b * 32 + j]) + (q >> 4) * np.int32(xq[t, b * 32 + 16 + j])
            d = half_to_float(np.int32(w[i, o]) | (np.int32(w[i, o + 1]) << 8))
            s += np.float32(acc - xm[t, b, 0]) * (d * xd[t, b])
        return s

    @_njit(parallel=True, fastmath=True)
    def matmul_q4x8(w, xq, xd, xm, nchunks):
        """y[t, i] = row i of the packed w uint8 [n, nb * 18] . token t of x (quantized by
        `cpu_q4.quantize_act_q4_rows`: xq [T, nb * 32], xd [T, nb], xm [T, nb, 8]) -> fp32 [T, n]."""
        n = w.shape[0]
        T = xq.shape[0]
        y = np.empty((T, n), dtype=np.float32)
        ng = n // 8
        per = (ng + nchunks - 1) // nchunks
        tiles = (T + K_TOKENS - 1) // K_TOKENS
        for c in prange(nchunks):
            for g in range(c * per, min(ng, (c + 1) * per)):
                if T >= K_TOKENS:
                    for tp in range(tiles):
                        group_tokens_k(w, g, xq, xd, xm, y, min(tp * K_TOKENS, T - K_TOKENS))  # the last tile
                        # re-runs tokens already done: the same values
                else:
                    for t in range(T):
                        group_tokens_1(w, g, xq, xd, xm, y, t)
        for i in range(ng * 8, n):
            for t in range(T):
                y[t, i] = plain_row_dot(w, i, xq, xd, xm, t)
        return y


def _kernels():
    """(cpu_q4's kernels, this module) where the packed kernels run: numba, AVX2 and the int8
    activations on (`cpu_q4.int8_activations`); else None."""
    import sys

    kern = cpu_q4._kernels()
    if numba is None or not cpu_q4.int8_activations(kern):
        return None
    return kern, sys.modules[__name__]


def matmul_packed(x: torch.Tensor, q: torch.Tensor, cols: int) -> torch.Tensor | None:
    """x fp32 [T, cols] times every row of the packed matrix q uint8 [n, row_bytes(cols)] ->
    fp32 [T, n]; None where the kernels do not run (the caller dequantizes instead)."""
    kerns = _kernels()
    if kerns is None or x.shape[0] == 0 or q.shape[0] == 0 or not q.is_contiguous():
        return None
    kern, mod = kerns
    xp = q4_format.padded(x, cols).numpy()
    with numba_pool.lock:
        chunks = _CHUNKS_PER_THREAD * numba_pool.use_threads(kern)
        xq, xd, xm = cpu_q4.quantized_act_rows(kern, xp)
        return torch.from_numpy(mod.matmul_q4x8(q.numpy(), xq, xd, xm, chunks))


def warmup() -> None:
    """Compile (or load from numba's disk cache) the kernels now, not in the first prompt."""
    if _kernels() is None:
        return
    q = pack_rows(q4_quantize.quantize_rows_q4(torch.ones(9, q4_format.QK)))
    for tokens in (1, K_TOKENS):
        matmul_packed(torch.ones(tokens, q4_format.QK), q, q4_format.QK)
