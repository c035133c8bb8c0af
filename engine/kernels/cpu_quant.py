"""Symmetric per-row int8 quantisation of FFN rows (the CPU kernels' default storage).

Row i is stored as q[i, :] int8 in [-127, 127] and scale[i] fp32 = max|w[i, :]| / 127, so
q[i, :] * scale[i] is the row. An all-zero row gets scale 0 and q 0. Half the bytes of f16,
a quarter of fp32; the relative error per element is at most 1/254 of the row's max.
"""

from __future__ import annotations

import torch
from engine.kernels import numba_pool

# Rows converted per step: bounds the fp32 temporaries (of non-fp32 input) to a few MB.
_ROWS_PER_STEP = 512


def quantize_rows_int8(w: torch.Tensor, out_q: torch.Tensor | None = None,
                       out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, d] (any float dtype) -> (q int8 [n, d], scale fp32 [n]); fills out_* if given."""
    if w.dim() != 2:
        raise ValueError(f"expected rows [n, d], got shape {tuple(w.shape)}")
    n, d = w.shape
    q = torch.empty((n, d), dtype=torch.int8) if out_q is None else out_q
    scale = torch.empty(n, dtype=torch.float32) if out_scale is None else out_scale

    kern = numba_pool.kernels("quantize_rows_int8")
    for lo in range(0, n, _ROWS_PER_STEP):
        hi = min(n, lo + _ROWS_PER_STEP)
        block = w[lo:hi].detach().to(device="cpu", dtype=torch.float32).contiguous()
        if kern is not None and q.is_contiguous():  # one pass per row, ~memory speed
            with numba_pool.lock:
                numba_pool.use_threads(kern)
                kern.quantize_rows_int8(block.numpy(), q[lo:hi].numpy(), scale[lo:hi].numpy())
            continue
        # torch: same fp32 operations, several passes (round/clamp/convert are slow here)
        s = block.abs().amax(dim=1) / 127.0
        scale[lo:hi] = s
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        q[lo:hi] = torch.round(block * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [n, d], scale fp32 [n]) -> fp32 [n, d]."""
    return q.to(torch.float32) * scale[:, None]
