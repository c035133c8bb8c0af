"""4-bit rows (llama.cpp's Q4_0 blocks) on the CPU: the dispatch of their products.

The rooms: `q4_format` (the bytes of a row), `q4_quantize` (ggml's rounding), `q4_rows`
(`Q4FfnRows`, a layer's rows), `cpu_q4_numba` (the kernels); this file chooses, per call, the
numba kernel (int8 x 4-bit on AVX2 hosts, else fp32 activations) or, without numba, torch,
which dequantizes the rows it needs and computes the same result.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.activations import CODES as ACTIVATION_CODES
from engine.kernels import numba_pool, reference
from engine.kernels.call_args import as_numpy, check_ffn_call, check_predicted_call, id_array, predicted_in_torch
from engine.kernels.q4_format import QK, dequantize_rows_q4, padded
from engine.kernels.q4_rows import Q4FfnRows


def _kernels():
    """The 4-bit kernels' module (cpu_q4_numba), or None (no numba, or THERMOCLINE_NO_NUMBA=1)."""
    if numba_pool.kernels() is None:
        return None
    from engine.kernels import cpu_q4_numba  # needs numba: imported once numba_pool has loaded it

    return cpu_q4_numba


_DENSE_CHUNKS_PER_THREAD = 8
_DEQUANT_ROWS = 2048


def matvec_q4(x: torch.Tensor, q: torch.Tensor, cols: int) -> torch.Tensor:
    """x fp32 [cols] times every 4-bit row of q uint8 [n, row_bytes(cols)] -> fp32 [n]."""
    kern = _kernels()
    xp = padded(x, cols)
    if kern is None:
        out = torch.empty(q.shape[0], dtype=torch.float32)
        for lo in range(0, q.shape[0], _DEQUANT_ROWS):
            hi = min(lo + _DEQUANT_ROWS, q.shape[0])
            out[lo:hi] = torch.mv(dequantize_rows_q4(q[lo:hi], cols), xp[:cols])
        return out
    if q.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32)
    with numba_pool.lock:
        chunks = _DENSE_CHUNKS_PER_THREAD * numba_pool.use_threads(kern)
        if int8_activations(kern):
            return torch.from_numpy(kern.matvec_q4_avx2(q.numpy(), *_quantized_act(kern, xp.numpy()), chunks))
        return torch.from_numpy(kern.matvec_rows_q4(q.numpy(), xp.numpy(), chunks))


def matmul_q4(x: torch.Tensor, q: torch.Tensor, cols: int) -> torch.Tensor | None:
    """x fp32 [T, cols] times every 4-bit row of q -> fp32 [T, n] with x quantized to int8
    blocks (the int8 x 4-bit kernel, each row read once for all tokens); None where that
    kernel does not run (no numba or AVX2, or it is turned off): the caller takes another path."""
    kern = _kernels()
    if not int8_activations(kern) or q.shape[0] == 0 or not q.is_contiguous():
        return None
    xp = padded(x, cols).numpy()
    with numba_pool.lock:
        return torch.from_numpy(kern.linear_q4(q.numpy(), xp, _DENSE_CHUNKS_PER_THREAD * numba_pool.use_threads(kern)))


# The int8 x 4-bit kernels (AVX2); tests turn it off to check the fp32 kernels too.
USE_INT8_ACTIVATIONS = True


def int8_activations(kern) -> bool:
    """Whether the numba kernels take the int8-activation path (AVX2 host)."""
    return USE_INT8_ACTIVATIONS and kern is not None and kern.HAS_AVX2


def _quantized_act(kern, xp: np.ndarray):
    """x fp32 [nb * 32] -> (xq, xd, xm) as `quantize_act_q4` fills them."""
    nb = xp.shape[0] // QK
    xq = np.empty(nb * QK, dtype=np.int8)
    xd = np.empty(nb, dtype=np.float32)
    xm = np.empty((nb, 8), dtype=np.int32)
    kern.quantize_act_q4(xp, xq, xd, xm)
    return xq, xd, xm


def quantized_act_rows(kern, xp: np.ndarray):
    """x fp32 [T, nb * 32] -> (xq, xd, xm) as `quantize_act_q4_rows` fills them (the many-token
    products' input: q4_tiles, cpu_q4x8). Call it holding numba_pool.lock."""
    tokens, width = xp.shape
    nb = width // QK
    xq = np.empty((tokens, width), dtype=np.int8)
    xd = np.empty((tokens, nb), dtype=np.float32)
    xm = np.empty((tokens, nb, 8), dtype=np.int32)
    kern.quantize_act_q4_rows(xp, xq, xd, xm)
    return xq, xd, xm


_EMPTY_IDS = np.empty(0, dtype=np.int64)
_EMPTY_F32 = np.empty(0, dtype=np.float32)


def _torch_ffn(x, rows: Q4FfnRows, active, activation, act_threshold, out_acts):
    g, u, d = rows.dequantized()
    return reference.sparse_ffn(x, g, u, d, active, activation, act_threshold, out_acts)


def _launch(kern, x, rows: Q4FfnRows, idx, pred, pred_ids, pthr, activation, act_threshold, acts, nchunks: int | None = None):
    xp = padded(x, rows.dim).numpy()
    gate, up, down = rows._numpy_views()
    use_idx, use_pred = idx is not None, pred is not None
    k = idx.shape[0] if use_idx else rows.n_neurons
    with numba_pool.lock:
        nchunks = max(1, min(numba_pool.use_threads(kern), k)) if nchunks is None else nchunks
        if int8_activations(kern):
            y = kern.ffn_rows_q4_act(xp, gate, up, down, idx if use_idx else _EMPTY_IDS,
                                      use_idx, pred if use_pred else _EMPTY_F32,
                                      pred_ids if pred_ids is not None else _EMPTY_IDS, use_pred,
                                      pred_ids is not None, float(pthr), rows.gated,
                                      ACTIVATION_CODES[activation], float(act_threshold), acts, nchunks)
            return torch.from_numpy(y[:rows.dim])
        y = kern.ffn_rows_q4(xp, gate, up, down, idx if use_idx else _EMPTY_IDS, use_idx,
                             pred if use_pred else _EMPTY_F32, pred_ids if pred_ids is not None else _EMPTY_IDS,
                             use_pred, pred_ids is not None, float(pthr), rows.gated,
                             ACTIVATION_CODES[activation], float(act_threshold), acts, nchunks)
    return torch.from_numpy(y[:rows.dim])


def sparse_ffn(x: torch.Tensor, rows: Q4FfnRows, active: torch.Tensor | None, activation: str,
               act_threshold: float = 0.0, out_acts: torch.Tensor | None = None) -> torch.Tensor:
    """`cpu.sparse_ffn` over 4-bit rows: y fp32 [d] over the neurons `active` (or all)."""
    idx = id_array("active", active) if active is not None else None
    k = rows.n_neurons if active is None else idx.shape[0]
    check_ffn_call(x, rows, activation, out_acts, k)
    kern = _kernels()
    if kern is None:
        return _torch_ffn(x, rows, active, activation, act_threshold, out_acts)
    acts = out_acts.numpy() if out_acts is not None else np.empty(k, dtype=np.float32)
    return _launch(kern, x, rows, idx, None, None, 0.0, activation, act_threshold, acts)


def sparse_ffn_predicted(x: torch.Tensor, rows: Q4FfnRows, pred_logits: torch.Tensor, pred_threshold: float,
                         activation: str, act_threshold: float = 0.0, out_acts: torch.Tensor | None = None,
                         row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`cpu.sparse_ffn_predicted` over 4-bit rows (selection by logits inside the kernel)."""
    n = rows.n_neurons
    ids = check_predicted_call(x, rows, activation, out_acts, pred_logits, row_ids)
    kern = _kernels()
    if kern is None:
        return predicted_in_torch(lambda active, acts: _torch_ffn(x, rows, active, activation, act_threshold, acts),
                                  pred_logits, ids, pred_threshold, out_acts)
    pred = as_numpy(pred_logits, torch.float32)
    acts = out_acts.numpy() if out_acts is not None else np.empty(n, dtype=np.float32)
    return _launch(kern, x, rows, None, pred, ids, pred_threshold, activation, act_threshold, acts)


def sparse_ffn_each(xs: torch.Tensor, rows: Q4FfnRows, activation: str, pred_logits: torch.Tensor | None = None,
                    pred_threshold: float = 0.0, row_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """`sparse_ffn` over every row (with pred_logits [T, ...]: `sparse_ffn_predicted`) for each
    token of xs fp32 [T, d] alone, in one kernel call: the same bits as a call per token. None
    where the int8-activation kernels do not run (the caller goes token by token)."""
    kern = _kernels()
    if kern is None or not int8_activations(kern) or xs.dim() != 2 or not len(xs):
        return None
    n = rows.n_neurons
    if pred_logits is None:
        check_ffn_call(xs[0], rows, activation, None, n)
        ids = None
    else:
        if pred_logits.dim() != 2 or pred_logits.shape[0] != xs.shape[0]:
            raise ValueError(f"pred_logits: expected [{xs.shape[0]}, ...], got {tuple(pred_logits.shape)}")
        ids = check_predicted_call(xs[0], rows, activation, None, pred_logits[0], row_ids)
    xp = padded(xs, rows.dim).numpy()
    gate, up, down = rows._numpy_views()
    acts = np.empty((xs.shape[0], n), dtype=np.float32)
    with numba_pool.lock:
        nchunks = max(1, min(numba_pool.use_threads(kern), n))
        ys = kern.ffn_rows_q4_act_each(xp, gate, up, down,
                                       _EMPTY_F32[None] if pred_logits is None else as_numpy(pred_logits, torch.float32),
                                       ids if ids is not None else _EMPTY_IDS, pred_logits is not None, ids is not None,
                                       float(pred_threshold), rows.gated, ACTIVATION_CODES[activation], 0.0, acts,
                                       nchunks)
    return torch.from_numpy(ys[:, :rows.dim])


def warmup(sparse: bool = True, decode: bool = True) -> None:
    """Compile (or load from the disk cache) the 4-bit kernels on tiny inputs: the many-token
    product, and with `sparse` the gathered rows', with `decode` the one-token product (which
    the fused decode replaces: Engine.load leaves it out where the decode is fused)."""
    if _kernels() is None:
        return
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 32, generator=g)
    rows = Q4FfnRows.from_dense(w[0], w[1], w[2])
    x = torch.randn(32, generator=g)
    if sparse:
        sparse_ffn(x, rows, torch.tensor([1, 5]), "relu")
        sparse_ffn_predicted(x, rows, torch.randn(8, generator=g), 0.0, "relu")
        sparse_ffn_each(torch.randn(2, 32, generator=g), rows, "relu")  # a mixture's prompt, expert by expert
    if decode:
        matvec_q4(x, rows.up, 32)
    matmul_q4(x[None], rows.up, 32)
