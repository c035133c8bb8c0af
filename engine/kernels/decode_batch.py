"""One compiled call per CPU layer for a decode step of many sequences (continuous batching,
engine.runtime.batching), and one for the final norm and the head of all their rows.

`decode_layer`'s step for one token, over B tokens of B sequences, each at its own position
in its own KV cache. Every weight matrix is read once for all the rows where its product takes
many rows (int8 x int8 and the 4-bit kinds: those of the int8 and int4 CPU weights), attention
runs over the B x heads pairs in one parallel loop, and the sparse FFN computes each row over
its own predicted neurons with decode_layer's own call. Row b is decode_layer's arithmetic for
its token (the same kernels on the same row).

Why: the unfused batched step made about ten Python-level calls per sequence and layer (the
per-sequence attention: slices, rotary, the cache write, the attention kernel), each a launch
with a fixed cost. On the demo model a batched step of 8 took 14 ms against 1.3 ms for one
token through the fused decode, so the server decoded 8 streams no faster than one.

    decode_layer_batch(X, pos, threads, cos, sin, pthr, *attention, k_addr, v_addr, slots, kv_half,
                       *ffn, counts)                     # X fp32 [B, d] updated in place
    logits = decode_head_batch(X, threads, *head_args)   # fp32 [B, vocab]

The caches arrive as addresses (k_addr, v_addr int64 [B]: each sequence's layer cache
[kv_heads, slots[b], head_dim], fp16 bits or fp32), so a batch is one argument, not 2B.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange, types

from engine.kernels import cpu_numba as K
from engine.kernels import cpu_q4_numba as Q
from engine.kernels import cpu_q4x8 as QX
from engine.kernels import decode_layer as DL
from engine.kernels import q4_tiles as QT

DL.stamp_with_kernels(__file__, DL.DEPENDENCIES + (DL.__file__,))

_njit = DL.numba_jit.njit
_i16_at, _f32_at = DL._pointer_to(types.int16), DL._pointer_to(types.float32)


@_njit()
def linear_many(kind, wb, scale, X, threads):
    """Y fp32 [T, n]: row t is decode_layer.linear(kind, wb, scale, X[t]) for X fp32 [T, cols]
    (C-contiguous). The int8 x int8 and 4-bit kernels read each weight row once for all T rows;
    fp32 and int8 x fp32 rows are read once per row (their kernels take one vector)."""
    T, cols = X.shape
    n = wb.shape[0]
    base = kind - DL.Q4MIN_SHIFT if kind >= DL.M_Q4MIN_TILES else kind
    chunks = DL._DENSE_CHUNKS_PER_THREAD * threads
    if base == DL.M_FP32 or base == DL.M_INT8:
        Y = np.empty((T, n), dtype=np.float32)
        for t in range(T):
            if base == DL.M_FP32:
                Y[t] = K.matvec_rows(wb.view(np.float32), X[t], chunks)
            else:
                Y[t] = K.matvec_rows_int8(wb.view(np.int8), scale, X[t], chunks)
        return Y
    if base == DL.M_INT8_Q8:
        return K.linear_q8(wb.view(np.int8), scale, X, chunks)
    nb = wb.shape[1] // 18
    width = nb * 32
    xp = X
    if width != cols:  # 4-bit rows hold whole blocks: the pad is zero
        xp = np.zeros((T, width), dtype=np.float32)
        xp[:, :cols] = X
    if base == DL.M_Q4:
        Y = Q.linear_q4(wb, xp, chunks)
    else:
        xq = np.empty((T, width), dtype=np.int8)
        xd = np.empty((T, nb), dtype=np.float32)
        xm = np.empty((T, nb, 8), dtype=np.int32)
        Q.quantize_act_q4_rows(xp, xq, xd, xm)
        if base == DL.M_Q4X8:
            Y = QX.matmul_q4x8(wb, xq, xd, xm, chunks)
        else:
            Y = QT.tiles_kernel(wb, xq, xd, np.ascontiguousarray(xm[:, :, 0]), chunks)
    if kind >= DL.M_Q4MIN_TILES:  # Q4_1: + the block offsets times the input's block sums (as linear)
        off = scale.reshape((n, nb))
        for t in range(T):
            sums = np.zeros(nb, dtype=np.float32)
            for j in range(cols):
                sums[j // 32] += X[t, j]
            for i in range(n):
                acc = np.float32(0.0)
                for b in range(nb):
                    acc += off[i, b] * sums[b]
                Y[t, i] += acc
    return Y


@_njit(parallel=True, fastmath=True)
def attend_rows(Q_, k_addr, v_addr, slots, kv_heads, pos, half, scale, out):
    """Every (sequence, query head) pair at once: Q_ fp32 [B, H, hd] over sequence b's cache at
    positions 0..pos[b] -> out fp32 [B, H, hd]; query head h reads kv head h // (H // kv_heads)."""
    B, H, hd = Q_.shape
    group = H // kv_heads
    for idx in prange(B * H):
        b = idx // H
        h = idx - b * H
        if half:
            kc = numba.carray(_i16_at(k_addr[b]), (kv_heads, slots[b], hd))
            vc = numba.carray(_i16_at(v_addr[b]), (kv_heads, slots[b], hd))
            K._head_attention(Q_[b, h], kc, vc, h // group, pos[b] + 1, scale, out[b, h])
        else:
            kc32 = numba.carray(_f32_at(k_addr[b]), (kv_heads, slots[b], hd))
            vc32 = numba.carray(_f32_at(v_addr[b]), (kv_heads, slots[b], hd))
            K._head_attention(Q_[b, h], kc32, vc32, h // group, pos[b] + 1, scale, out[b, h])


@_njit()
def _write_row(addr, half, slots, h, pos, vec):
    """Position `pos` of kv head h of a sequence's layer cache (at `addr`) = vec [hd]."""
    hd = vec.shape[0]
    kvh = h + 1  # only rows 0..h are addressed: the view need not know the cache's head count
    if half:
        c16 = numba.carray(_i16_at(addr), (kvh, slots, hd))
        for j in range(hd):
            v = min(max(vec[j], np.float32(-DL._F16_MAX)), np.float32(DL._F16_MAX))  # no inf in the cache
            c16[h, pos, j] = DL._float_to_half_bits(v)
    else:
        c32 = numba.carray(_f32_at(addr), (kvh, slots, hd))
        for j in range(hd):
            c32[h, pos, j] = vec[j]


@_njit()
def _attend_batch(X, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale,
                  res_scale, use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_addr, v_addr, slots,
                  kv_half):
    """decode_layer._attend for every row: X[b] += attention(norm(X[b])) over sequence b's cache."""
    B, d = X.shape
    q_size = n_heads * head_dim
    kv_size = kv_heads * head_dim
    Hn = np.empty((B, d), dtype=np.float32)
    for b in range(B):
        Hn[b] = DL._rms_norm(X[b], attn_w, eps)
    qkv = linear_many(qkv_kind, qkv_b, qkv_s, Hn, threads)
    Qr = np.empty((B, n_heads, head_dim), dtype=np.float32)
    kv = np.empty(head_dim, dtype=np.float32)
    for b in range(B):
        p = pos[b]
        for hh in range(n_heads):
            DL._rotate(qkv[b, hh * head_dim: (hh + 1) * head_dim], Qr[b, hh], cos, sin, p, use_rope)
        for g in range(kv_heads):
            lo = q_size + g * head_dim
            DL._rotate(qkv[b, lo: lo + head_dim], kv, cos, sin, p, use_rope)
            _write_row(k_addr[b], kv_half, slots[b], g, p, kv)
            _write_row(v_addr[b], kv_half, slots[b], g, p, qkv[b, lo + kv_size: lo + kv_size + head_dim])
    att = np.empty((B, n_heads, head_dim), dtype=np.float32)
    attend_rows(Qr, k_addr, v_addr, slots, kv_heads, pos, kv_half, attn_scale, att)
    o = linear_many(out_kind, out_b, out_s, att.reshape((B, q_size)), threads)
    rs = np.float32(res_scale)
    for b in range(B):
        for j in range(d):
            X[b, j] = X[b, j] + (o[b, j] * rs if use_res_scale else o[b, j])


@_njit(nogil=True)
def decode_layer_batch(X, pos, threads, cos, sin, pthr,
                       attn_w, mlp_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale, res_scale,
                       use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_addr, v_addr, slots, kv_half,
                       ffn_kind, n_ff, gated, code, act_thr,
                       fc1_kind, fc1_b, fc1_s, fc2_kind, fc2_b, fc2_s,
                       rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, row_ids,
                       hot_kind, hot_gate_b, hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s, hot_ids,
                       gu_kind, gu_b, gu_s, dn_kind, dn_b, dn_s, counts):
    """decode_layer for B sequences' tokens: X fp32 [B, d] (their residual streams) updated in
    place, sequence b at position pos[b]; counts int64 [B, 2] receives each row's FFN neurons
    computed and those of them among the hot rows (decode_layer's two results)."""
    B, d = X.shape
    _attend_batch(X, pos, threads, cos, sin, attn_w, eps, use_rope, n_heads, kv_heads, head_dim, attn_scale,
                  res_scale, use_res_scale, qkv_kind, qkv_b, qkv_s, out_kind, out_b, out_s, k_addr, v_addr, slots,
                  kv_half)
    rs = np.float32(res_scale)
    Hm = np.empty((B, d), dtype=np.float32)
    for b in range(B):
        Hm[b] = DL._rms_norm(X[b], mlp_w, eps)
    Y = np.empty((B, d), dtype=np.float32)
    if ffn_kind == DL.FFN_ROWS:
        # the predictor reads the residual stream, as in decode_layer
        hidden = linear_many(fc1_kind, fc1_b, fc1_s, X, threads)
        for b in range(B):
            for j in range(hidden.shape[1]):
                if hidden[b, j] < 0.0:
                    hidden[b, j] = 0.0
        logits = linear_many(fc2_kind, fc2_b, fc2_s, hidden, threads)
        t = np.float32(pthr)
        for b in range(B):  # each row over its own predicted neurons (decode_layer's call)
            count = 0
            for j in range(logits.shape[1]):
                if logits[b, j] >= t:
                    count += 1
            y = DL._ffn_rows(rows_kind, gate_b, gate_s, up_b, up_s, down_b, down_s, Hm[b], logits[b], row_ids, pthr,
                             gated, code, act_thr, threads)
            count_hot = 0
            if hot_ids.shape[0]:
                for j in range(hot_ids.shape[0]):
                    if logits[b, hot_ids[j]] >= t:
                        count_hot += 1
                y_hot = DL._ffn_rows(hot_kind, hot_gate_b, hot_gate_s, hot_up_b, hot_up_s, hot_down_b, hot_down_s,
                                     Hm[b], logits[b], hot_ids, pthr, gated, code, act_thr, threads)
                for j in range(d):
                    y[j] = y_hot[j] + y[j]
            Y[b] = y
            counts[b, 0] = count
            counts[b, 1] = count_hot
    else:
        pre = linear_many(gu_kind, gu_b, gu_s, Hm, threads)
        thr = np.float32(act_thr)
        act = np.empty((B, n_ff), dtype=np.float32)
        for b in range(B):
            for i in range(n_ff):
                if gated:
                    u = pre[b, n_ff + i]
                    if code == DL._DRELU and u < 0.0:
                        u = np.float32(0.0)
                    act[b, i] = K._nonlinearity(pre[b, i], code, thr) * u
                else:
                    act[b, i] = K._nonlinearity(pre[b, i], code, thr)
            counts[b, 0] = n_ff
            counts[b, 1] = 0
        if ffn_kind == DL.FFN_DENSE_LINEAR:
            Y = linear_many(dn_kind, dn_b, dn_s, act, threads)
        else:
            for b in range(B):
                Y[b] = K.combine_rows(act[b], dn_b.view(np.float32), DL._DENSE_CHUNKS_PER_THREAD * threads)
    for b in range(B):
        for j in range(d):
            X[b, j] = X[b, j] + (Y[b, j] * rs if use_res_scale else Y[b, j])


@_njit(nogil=True)
def decode_head_batch(X, threads, norm_w, eps, logit_scale, use_logit_scale, head_kind, head_b, head_s):
    """Logits fp32 [B, vocab] of each row: decode_layer.decode_head's arithmetic, the head's
    weights read once for all rows."""
    B, d = X.shape
    H = np.empty((B, d), dtype=np.float32)
    for b in range(B):
        H[b] = DL._rms_norm(X[b], norm_w, eps)
        if use_logit_scale:
            s = np.float32(logit_scale)
            for j in range(d):
                H[b, j] = H[b, j] * s
    return linear_many(head_kind, head_b, head_s, H, threads)


__all__ = ["decode_layer_batch", "decode_head_batch", "linear_many", "attend_rows"]
