"""4-bit rows: the quantizer (ggml's Q4_0 reference rounding).

The signed value of largest magnitude in a block maps to -8, d = max / -8,
q = min(15, trunc(x / d + 8.5)), so our rows equal gguf's `quantize` bit for bit. numba
computes the nibbles and the fp32 scales in one pass (its kernel in this file: numba's disk
cache is per file); without numba, numpy does the same operations.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import numba_jit, numba_pool
from engine.kernels.q4_format import BLOCK_BYTES, QK, n_blocks, row_bytes

_ROWS_PER_STEP = 512  # rows converted per step: bounds fp32 temporaries to a few MB


def _quantize_block_rows(w: np.ndarray) -> np.ndarray:
    """fp32 [n, nb * 32] -> uint8 [n, nb * 18] (ggml's reference rounding, vectorised)."""
    n, cols = w.shape
    nb = cols // QK
    blocks = w.reshape(n * nb, QK)
    imax = np.abs(blocks).argmax(axis=1)[:, None]
    mx = np.take_along_axis(blocks, imax, axis=1)
    d = mx / np.float32(-8.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / d).astype(np.float32)
    q = np.trunc(blocks * inv + np.float32(8.5)).astype(np.int16).clip(0, 15).astype(np.uint8)
    out = np.empty((n * nb, BLOCK_BYTES), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(n * nb, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return out.reshape(n, nb * BLOCK_BYTES)


try:
    import numba
    from numba import prange
except Exception:  # noqa: BLE001 - ImportError, or a broken numba install: numpy computes instead
    numba = None


def _kernels():
    """This module (its jitted kernel), or None (no numba, or THERMOCLINE_NO_NUMBA=1)."""
    import sys

    if numba is None or numba_pool.kernels() is None:
        return None
    return sys.modules[__name__]


if numba is not None:
    @numba_jit.njit(parallel=True)
    def quantize_q4_blocks(w, out):
        """ggml's Q4_0 reference rounding (no fastmath: the same fp32 operations as gguf's
        numpy code, so the bytes agree): per block of 32, the value of largest magnitude
        (the first such) maps to -8, d = max / -8, q = min(15, trunc(x / d + 8.5)).
        Fills the nibbles of out uint8 [n, nb * 18]; returns d fp32 [n, nb] (the caller
        stores it as fp16 in bytes 0-1 of each block)."""
        n, width = w.shape
        nb = width // 32
        d = np.empty((n, nb), dtype=np.float32)
        for i in prange(n):
            for b in range(nb):
                amax = np.float32(0.0)
                mx = np.float32(0.0)
                for j in range(32):
                    v = w[i, b * 32 + j]
                    if abs(v) > amax:
                        amax = abs(v)
                        mx = v
                db = mx / np.float32(-8.0)
                d[i, b] = db
                inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
                o = b * 18
                for j in range(16):
                    lo = np.int32(np.trunc(w[i, b * 32 + j] * inv + np.float32(8.5)))
                    hi = np.int32(np.trunc(w[i, b * 32 + 16 + j] * inv + np.float32(8.5)))
                    lo = min(max(lo, 0), 15)
                    hi = min(max(hi, 0), 15)
                    out[i, o + 2 + j] = np.uint8(lo | (hi << 4))
        return d


def quantize_rows_q4(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w [n, cols] (any float dtype, any device) -> uint8 [n, row_bytes(cols)]."""
    if w.dim() != 2:
        raise ValueError(f"expected rows [n, cols], got shape {tuple(w.shape)}")
    n, cols = w.shape
    width = n_blocks(cols) * QK
    q = torch.empty((n, row_bytes(cols)), dtype=torch.uint8) if out is None else out
    kern = _kernels()
    for lo in range(0, n, _ROWS_PER_STEP):
        hi = min(n, lo + _ROWS_PER_STEP)
        block = np.zeros((hi - lo, width), dtype=np.float32)
        block[:, :cols] = w[lo:hi].detach().to(device="cpu", dtype=torch.float32).numpy()
        if not np.isfinite(block).all():
            raise ValueError("weights hold inf or nan; they cannot be quantized")
        if kern is None:
            q[lo:hi] = torch.from_numpy(_quantize_block_rows(block))
            continue
        # numba: the nibbles and the fp32 scales in one pass; numpy rounds the scales to fp16
        rows = np.empty((hi - lo, width // QK * BLOCK_BYTES), dtype=np.uint8)
        d = kern.quantize_q4_blocks(block, rows)
        blocks = rows.reshape(hi - lo, width // QK, BLOCK_BYTES)
        blocks[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(hi - lo, width // QK, 2)
        q[lo:hi] = torch.from_numpy(rows)
    return q
