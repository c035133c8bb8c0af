"""Sparse FFN and matrix-vector products over 4-bit rows (Q4_0 blocks) with Triton: the
hot tier's 4-bit storage, the same rows as `cpu_q4` (18 bytes per 32 weights per row).

Two launches per FFN, static grids, no host sync:
  1. `_q4_rows_kernel`: each program owns BLOCK_N neurons; it thresholds their predictor
     logits (of the layer, through row ids when the rows are a subset), dots the live gate
     rows with x block by block (scale decoded from its fp16 bits, nibbles unpacked in
     registers), then the up rows only where the gate fired -> act [n] (0 where skipped).
     The same kernel, ungated with no nonlinearity, is the dense matrix-vector product.
  2. `_q4_down_kernel`: one program per 32-wide block of the output; it walks the rows in
     tiles and sums act[i] * row i's block, masking the rows whose act is 0 (never read).
     A fixed summation order: results are deterministic.
Masked (not packed) tiles: the simple form first; `triton_ffn`'s packing is the model if
the hot tier's 4-bit rows are measured on a GPU. Tested on the CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch

from engine.activations import CODES, IDENTITY_CODE

from engine.kernels.q4_format import BLOCK_BYTES, QK, n_blocks, row_bytes
from .triton_ffn import ACTIVATIONS

_CODES = {**CODES, "identity": IDENTITY_CODE}
BLOCK_N = 32


@functools.cache
def _kernels():
    # imported on first use: triton may be missing, and TRITON_INTERPRET must be settled first
    import triton

    from . import triton_q4_kernels as k

    return triton, k._q4_rows_kernel, k._q4_down_kernel


def _padded(x: torch.Tensor, cols: int) -> torch.Tensor:
    width = n_blocks(cols) * QK
    out = torch.zeros(width, dtype=torch.float32, device=x.device)
    out[:cols] = x.reshape(-1)[:cols]
    return out


def _check(name: str, w: torch.Tensor, n: int, cols: int, device) -> None:
    if w.dtype != torch.uint8 or tuple(w.shape) != (n, row_bytes(cols)) or not w.is_contiguous() or w.device != device:
        raise ValueError(f"{name}: expected contiguous uint8 [{n}, {row_bytes(cols)}] on {device}, "
                         f"got {w.dtype} {tuple(w.shape)} on {w.device}")


def q4_activations_triton(x, gate, up, cols: int, pred_logits=None, pred_threshold: float = 0.0,
                          activation: str = "relu", act_threshold: float = 0.0, row_ids=None) -> torch.Tensor:
    """act fp32 [n] of 4-bit rows (gate None: ungated; activation "identity": plain dots)."""
    if activation not in _CODES:
        raise ValueError(f"unknown activation {activation!r}")
    n = up.shape[0]
    for name, w in (("gate", gate), ("up", up)):
        if w is not None:
            _check(name, w, n, cols, up.device)
    triton, rows_kernel, _ = _kernels()
    xp = _padded(x.float(), cols)
    out = torch.empty(n, dtype=torch.float32, device=up.device)
    if n == 0:
        return out
    use_pred = pred_logits is not None
    logits = pred_logits.float().contiguous() if use_pred else out
    ids = row_ids.contiguous() if row_ids is not None else out
    rows_kernel[(triton.cdiv(n, BLOCK_N),)](
        xp, gate if gate is not None else up, up, row_bytes(cols), n, n_blocks(cols), logits, ids,
        float(pred_threshold), float(act_threshold), out,
        USE_PRED=use_pred, USE_IDS=use_pred and row_ids is not None, GATED=gate is not None,
        ACT=_CODES[activation], BLOCK=BLOCK_N)
    return out


def q4_down_triton(act: torch.Tensor, down_t: torch.Tensor, cols: int) -> torch.Tensor:
    """sum_i act[i] * down row i -> fp32 [cols]; rows whose act is 0 are not read."""
    n = down_t.shape[0]
    _check("down_t", down_t, n, cols, down_t.device)
    triton, _, down_kernel = _kernels()
    nb = n_blocks(cols)
    out = torch.empty(nb * QK, dtype=torch.float32, device=down_t.device)
    down_kernel[(nb,)](act.float().contiguous(), down_t, nb * BLOCK_BYTES, n, out, BLOCK=BLOCK_N)
    return out[:cols]


def sparse_ffn_q4_triton(x, gate, up, down_t, cols: int, pred_logits=None, pred_threshold: float = 0.0,
                         activation: str = "relu", act_threshold: float = 0.0, row_ids=None) -> torch.Tensor:
    """`triton_ffn.sparse_ffn_triton` over 4-bit rows: y fp32 [cols]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    act = q4_activations_triton(x, gate, up, cols, pred_logits, pred_threshold, activation, act_threshold, row_ids)
    return q4_down_triton(act, down_t, cols)


def matvec_q4_triton(x: torch.Tensor, q: torch.Tensor, cols: int) -> torch.Tensor:
    """x [cols] times every 4-bit row of q -> fp32 [n] (a dense matrix on the hot tier)."""
    return q4_activations_triton(x, None, q, cols, activation="identity")
