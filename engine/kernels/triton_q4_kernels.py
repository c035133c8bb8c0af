"""Triton kernels of `triton_q4` (4-bit Q4_0 rows); only the @triton.jit functions live
here. Imported lazily, after TRITON_INTERPRET is settled (see `triton_kernels`)."""

import triton
import triton.language as tl

from engine.activations import CODES, IDENTITY_CODE

# the kernels' activation codes, from engine/activations.py (constexpr: Triton folds the branches)
FATRELU = tl.constexpr(CODES["fatrelu"])
DRELU = tl.constexpr(CODES["drelu"])
RELU2 = tl.constexpr(CODES["relu2"])
SILU = tl.constexpr(CODES["silu"])
IDENTITY = tl.constexpr(IDENTITY_CODE)


@triton.jit
def _scale(w_ptr, base, live):
    """fp16 scale bits at bytes base, base+1 of each row -> fp32 (no inf/nan stored)."""
    lo = tl.load(w_ptr + base, mask=live, other=0).to(tl.int32)
    hi = tl.load(w_ptr + base + 1, mask=live, other=0).to(tl.int32)
    h = lo | (hi << 8)
    e = (h >> 10) & 31
    m = h & 1023
    mant = tl.where(e > 0, m + 1024, m).to(tl.float32)
    val = mant * tl.exp2(tl.where(e > 0, e - 25, -24).to(tl.float32))
    return tl.where((h & 0x8000) != 0, -val, val)


@triton.jit
def _q4_dot(w_ptr, row_off, live, x_ptr, nb, BLOCK: tl.constexpr):
    offs16 = tl.arange(0, 16)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(0, nb):
        base = row_off + b * 18
        s = _scale(w_ptr, base, live)
        q = tl.load(w_ptr + base[:, None] + 2 + offs16[None, :], mask=live[:, None], other=136).to(tl.int32)
        xl = tl.load(x_ptr + b * 32 + offs16).to(tl.float32)
        xh = tl.load(x_ptr + b * 32 + 16 + offs16).to(tl.float32)
        v = ((q & 15) - 8).to(tl.float32) * xl[None, :] + ((q >> 4) - 8).to(tl.float32) * xh[None, :]
        acc += s * tl.sum(v, axis=1)
    return acc


@triton.jit
def _q4_rows_kernel(x_ptr, gate_ptr, up_ptr, rb, n, nb, logits_ptr, ids_ptr, pthr, act_thr, out_ptr,
                    USE_PRED: tl.constexpr, USE_IDS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    if USE_PRED:
        if USE_IDS:
            at = tl.load(ids_ptr + offs, mask=live, other=0)
        else:
            at = offs
        lg = tl.load(logits_ptr + at, mask=live, other=0.0).to(tl.float32)
        live = live & (lg >= pthr)
    row_off = offs.to(tl.int64) * rb
    if GATED:
        g = _q4_dot(gate_ptr, row_off, live, x_ptr, nb, BLOCK)
    else:
        g = _q4_dot(up_ptr, row_off, live, x_ptr, nb, BLOCK)
    if ACT == SILU:
        s = g / (1.0 + tl.exp(-g))
        a = tl.where((act_thr > 0.0) & (tl.abs(s) < act_thr), 0.0, s)
    elif ACT == FATRELU:
        a = tl.where(g >= act_thr, g, 0.0)
    elif ACT == RELU2:
        r = tl.maximum(g, 0.0)
        a = r * r
    elif ACT == IDENTITY:
        a = g
    else:
        a = tl.maximum(g, 0.0)
    if GATED:
        fired = live & (a != 0.0)
        u = _q4_dot(up_ptr, row_off, fired, x_ptr, nb, BLOCK)
        if ACT == DRELU:
            u = tl.maximum(u, 0.0)
        a = a * u
    a = tl.where(live, a, 0.0)
    tl.store(out_ptr + offs, a, mask=offs < n)


@triton.jit
def _q4_down_kernel(act_ptr, down_ptr, rb, n, out_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs16 = tl.arange(0, 16)
    acc_lo = tl.zeros([16], dtype=tl.float32)
    acc_hi = tl.zeros([16], dtype=tl.float32)
    for r0 in range(0, n, BLOCK):
        offs = r0 + tl.arange(0, BLOCK)
        a = tl.load(act_ptr + offs, mask=offs < n, other=0.0)
        live = a != 0.0
        base = offs.to(tl.int64) * rb + b * 18
        s = _scale(down_ptr, base, live) * a
        q = tl.load(down_ptr + base[:, None] + 2 + offs16[None, :], mask=live[:, None], other=136).to(tl.int32)
        acc_lo += tl.sum(s[:, None] * ((q & 15) - 8).to(tl.float32), axis=0)
        acc_hi += tl.sum(s[:, None] * ((q >> 4) - 8).to(tl.float32), axis=0)
    tl.store(out_ptr + b * 32 + offs16, acc_lo)
    tl.store(out_ptr + b * 32 + 16 + offs16, acc_hi)
