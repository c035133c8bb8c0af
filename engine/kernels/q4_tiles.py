"""Many tokens times 4-bit rows (a dense prefill over Q4_0 weights), with one fp32 step per 8 blocks.

`cpu_q4.matmul_q4` runs one token at a time over each group of 4 rows and, per 32-weight block,
widens the int32 products to fp32 and multiplies them by the block's two scales: four vector
float operations per block, most of the work. Here one pass takes one row and K tokens: per 8
blocks the row's nibbles are unpacked once for the K tokens, each token's 8 integer block
products (vpmaddubsw, vpmaddwd) are summed horizontally into one vector of 8 block sums
(vphaddd), less the nibble offsets, and widened and scaled once (the row's 8 fp16 scales times
the token's 8 block scales). The activations are those of `cpu_q4.quantize_act_q4_rows`
(llama.cpp's Q8_0 blocks of 32), so the result is the one `matmul_q4` gives, summed in another
order.

    y = matmul_q4_tiles(x, q, cols)   # x fp32 [T, cols], q uint8 [n, row_bytes(cols)] -> [T, n]
                                      # or None where it does not run (no numba/AVX2, blocks
                                      # per row not a multiple of 8)
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cpu_q4, numba_jit, numba_pool, q4_format, q4_quantize

K_TOKENS = 4  # tokens per pass over a row (fewer tokens: one at a time)
_CHUNKS_PER_THREAD = 8

try:
    import numba
    from llvmlite import ir
    from numba import prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the module still imports; matmul_q4_tiles answers None
    numba = None


if numba is not None:
    def call(builder, name, ret, *args):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

    def _dot_row_tokens(tokens: int):
        @intrinsic
        def dot_row_tokens(typingctx, w, i, xq, xd, xo, t):
            """(row i of w) . (token t + k of x) for k < tokens, fp32. xo int32 [T, nb]: 8 x each
            block's sum of xq (the nibbles' offset of 8)."""
            sig = types.UniTuple(types.float32, tokens)(w, i, xq, xd, xo, t)

            def codegen(context, builder, signature, args):
                wty, _, xqty, xdty, xoty, _ = signature.args
                wa = context.make_array(wty)(context, builder, args[0])
                xqa = context.make_array(xqty)(context, builder, args[2])
                xda = context.make_array(xdty)(context, builder, args[3])
                xoa = context.make_array(xoty)(context, builder, args[4])
                i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
                f32 = ir.FloatType()
                v16i8, v32i8 = ir.VectorType(i8, 16), ir.VectorType(i8, 32)
                v16i16, v8i32, v8f32 = ir.VectorType(i16, 16), ir.VectorType(i32, 8), ir.VectorType(f32, 8)
                v8i16, v8f16 = ir.VectorType(i16, 8), ir.VectorType(ir.HalfType(), 8)
                zero = i64(0)
                row = context.cast(builder, args[1], signature.args[1], types.int64)
                tok0 = context.cast(builder, args[5], signature.args[5], types.int64)
                rp = cgutils.get_item_pointer(context, builder, wty, wa, [row, zero], wraparound=False)
                toks = [builder.add(tok0, i64(k)) for k in range(tokens)]
                xqp = [cgutils.get_item_pointer(context, builder, xqty, xqa, [tk, zero], wraparound=False) for tk in toks]
                xdp = [cgutils.get_item_pointer(context, builder, xdty, xda, [tk, zero], wraparound=False) for tk in toks]
                xop = [cgutils.get_item_pointer(context, builder, xoty, xoa, [tk, zero], wraparound=False) for tk in toks]
                nb = cgutils.unpack_tuple(builder, xda.shape)[1]
                groups = builder.sdiv(nb, i64(8))
                ones = ir.Constant(v16i16, [i16(1)] * 16)
                low4 = ir.Constant(v16i8, [i8(15)] * 16)
                four = ir.Constant(v16i8, [i8(4)] * 16)
                cat = ir.Constant(ir.VectorType(i32, 32), [i32(j) for j in range(32)])
                lo_halves = ir.Constant(v8i32, [i32(j) for j in (0, 1, 2, 3, 8, 9, 10, 11)])
                hi_halves = ir.Constant(v8i32, [i32(j) for j in (4, 5, 6, 7, 12, 13, 14, 15)])
                acc = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(tokens)]
                with cgutils.for_range(builder, groups) as grp:
                    g8 = builder.mul(grp.index, i64(8))
                    # the row's 8 blocks: nibbles unpacked, fp16 scales gathered and widened, once
                    qs = []
                    dwv = ir.Constant(v8i16, None)
                    for j in range(8):
                        p = builder.gep(rp, [builder.mul(builder.add(g8, i64(j)), i64(18))])
                        dwv = builder.insert_element(dwv, builder.load(builder.bitcast(p, i16.as_pointer()), align=1),
                                                     i32(j))
                        nib = builder.load(builder.bitcast(builder.gep(p, [i64(2)]), v16i8.as_pointer()), align=1)
                        qs.append(builder.shuffle_vector(builder.and_(nib, low4), builder.lshr(nib, four), cat))
                    dwf = builder.fpext(builder.bitcast(dwv, v8f16), v8f32)
                    for k in range(tokens):
                        sums = []
                        for j in range(8):
                            off = builder.mul(builder.add(g8, i64(j)), i64(32))
                            xv = builder.load(builder.bitcast(builder.gep(xqp[k], [off]), v32i8.as_pointer()), align=1)
                            p16 = call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, qs[j], xv)
                            sums.append(call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, p16, ones))
                        h = [call(builder, "llvm.x86.avx2.phadd.d", v8i32, sums[2 * j], sums[2 * j + 1]) for j in range(4)]
                        h0 = call(builder, "llvm.x86.avx2.phadd.d", v8i32, h[0], h[1])
                        h1 = call(builder, "llvm.x86.avx2.phadd.d", v8i32, h[2], h[3])
                        s = builder.add(builder.shuffle_vector(h0, h1, lo_halves), builder.shuffle_vector(h0, h1, hi_halves))
                        ov = builder.load(builder.bitcast(builder.gep(xop[k], [g8]), v8i32.as_pointer()), align=4)
                        xs = builder.load(builder.bitcast(builder.gep(xdp[k], [g8]), v8f32.as_pointer()), align=4)
                        f = builder.sitofp(builder.sub(s, ov), v8f32)
                        builder.store(call(builder, "llvm.fma.v8f32", v8f32, f, builder.fmul(dwf, xs),
                                           builder.load(acc[k])), acc[k])
                out = []
                for a in acc:
                    v = builder.load(a)
                    s = builder.extract_element(v, i32(0))
                    for lane in range(1, 8):
                        s = builder.fadd(s, builder.extract_element(v, i32(lane)))
                    out.append(s)
                return context.make_tuple(builder, signature.return_type, out)

            return sig, codegen

        return dot_row_tokens

    # module-level, so numba's disk cache keeps the kernel (a kernel built in a closure over
    # these intrinsics was compiled again, about 6 s, by every process that loaded an int4 model)
    dot_row_tokens_k = _dot_row_tokens(K_TOKENS)
    dot_row_tokens_1 = _dot_row_tokens(1)

    _njit = numba_jit.njit

    @_njit(parallel=True, fastmath=True)
    def tiles_kernel(w, xq, xd, xo, nchunks):
        """y[t, i] = row i of w (uint8 [n, nb * 18], nb % 8 == 0) . token t -> fp32 [T, n]:
        K_TOKENS tokens per pass, or one at a time when there are fewer."""
        n = w.shape[0]
        T = xq.shape[0]
        y = np.empty((T, n), dtype=np.float32)
        per = (n + nchunks - 1) // nchunks
        tiles = (T + K_TOKENS - 1) // K_TOKENS
        for c in prange(nchunks):
            for i in range(c * per, min(n, (c + 1) * per)):
                if T >= K_TOKENS:
                    for tp in range(tiles):
                        t = min(tp * K_TOKENS, T - K_TOKENS)  # the last tile re-runs tokens already done: same values
                        s = dot_row_tokens_k(w, i, xq, xd, xo, t)
                        for k in range(K_TOKENS):
                            y[t + k, i] = s[k]
                else:
                    for t in range(T):
                        y[t, i] = dot_row_tokens_1(w, i, xq, xd, xo, t)[0]
        return y


def _kernel():
    """The jitted kernel, or None (no numba, no AVX2, or the int8 kernels turned off)."""
    kern = cpu_q4._kernels()
    return tiles_kernel if numba is not None and kern is not None and kern.HAS_AVX2 else None


def matmul_q4_tiles(x: torch.Tensor, q: torch.Tensor, cols: int) -> torch.Tensor | None:
    """x fp32 [T, cols] times every 4-bit row of q uint8 [n, row_bytes(cols)] -> fp32 [T, n], x
    quantized to int8 blocks as `cpu_q4.matmul_q4` does; None where it does not run (no numba or
    AVX2, the int8 path turned off, no tokens or rows, blocks per row not a multiple of 8): the
    caller takes another path."""
    kern = cpu_q4._kernels()
    nb = q4_format.n_blocks(cols)
    if (not cpu_q4.int8_activations(kern) or x.shape[0] == 0 or nb % 8 or q.shape[0] == 0
            or not q.is_contiguous()):
        return None
    impl = _kernel()
    if impl is None:
        return None
    xp = q4_format.padded(x, cols).numpy()
    with numba_pool.lock:
        chunks = _CHUNKS_PER_THREAD * numba_pool.use_threads(kern)
        xq, xd, xm = cpu_q4.quantized_act_rows(kern, xp)
        xo = np.ascontiguousarray(xm[:, :, 0])
        return torch.from_numpy(impl(q.numpy(), xq, xd, xo, chunks))


def warmup() -> None:
    """Compile (or load from numba's disk cache) both kernels now, not in the first prompt."""
    q = q4_quantize.quantize_rows_q4(torch.ones(2, 8 * q4_format.QK))
    for tokens in (1, K_TOKENS):
        matmul_q4_tiles(torch.ones(tokens, 8 * q4_format.QK), q, 8 * q4_format.QK)
