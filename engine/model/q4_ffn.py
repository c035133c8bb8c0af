"""A layer's FFN straight from a checkpoint's Q4_0 rows (a GGUF import), for the sparse
engine's int4 CPU tier, with no fp32 copy of the layer.

Gate and up rows are the checkpoint's bytes, whatever scales its quantizer chose (an
imatrix file's blocks survive; a dequantize-requantize round trip is exact only for ggml's
reference rounding). So are the down projection's rows when the file stores them
transposed (PowerInfer's `ffn_down_t`). A plain llama.cpp file stores `ffn_down` with its
blocks along the intermediate dimension, the wrong way for neuron rows: those are
requantized (ggml's rounding), the one lossy step, a few hundred columns at a time so the
fp32 temporaries stay a few MB. Neurons the fast tier takes in its float dtype get their
exact values (`float_rows`), the down rows read again from the checkpoint's blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import q4_format, q4_quantize, q4_rows
from engine.kernels import host_memory

_COLS_PER_STEP = 512  # columns of the down projection per step: [d, 512] fp32 is 8 MB at d = 4096


def transposed_q4_rows(source, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """The 4-bit rows of the transpose of `name` ([rows, cols]): uint8 [cols, row_bytes(rows)],
    quantized a column range at a time from the checkpoint's values."""
    rows, cols = shape
    out = host_memory.empty((cols, q4_format.row_bytes(rows)), torch.uint8)
    for lo in range(0, cols, _COLS_PER_STEP):
        hi = min(cols, lo + _COLS_PER_STEP)
        q4_quantize.quantize_rows_q4(source.transposed_rows(name, lo, hi), out=out[lo:hi])
    return out


def q4_rows_of(source, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """4-bit rows of a matrix stored otherwise (Q8_0, a Q6_K head): quantized a step of rows
    at a time from its exact values, the same bytes as quantizing the whole fp32 matrix
    (rows are quantized one by one) without that 500 MB copy of a 32000 x 4096 head."""
    rows, cols = shape
    out = host_memory.empty((rows, q4_format.row_bytes(cols)), torch.uint8)
    for lo in range(0, rows, _COLS_PER_STEP * 2):
        hi = min(rows, lo + _COLS_PER_STEP * 2)
        q4_quantize.quantize_rows_q4(source.rows(name, lo, hi), out=out[lo:hi])
    return out


def exact_transposed_rows(source, name: str, rows: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the transpose of `name` as fp32 [len(ids), rows], exact (the
    checkpoint's values), read a column range at a time."""
    ids_np = np.asarray(ids, dtype=np.int64)
    out = torch.empty(len(ids_np), rows, dtype=torch.float32)
    if not len(ids_np):
        return out
    for lo in range(int(ids_np.min()) // _COLS_PER_STEP * _COLS_PER_STEP, int(ids_np.max()) + 1, _COLS_PER_STEP):
        hi = lo + _COLS_PER_STEP
        pos = np.flatnonzero((ids_np >= lo) & (ids_np < hi))
        if len(pos):
            part = source.transposed_rows(name, lo, min(hi, int(ids_np.max()) + 1))
            out[torch.from_numpy(pos)] = part[torch.from_numpy(ids_np[pos] - lo)]
    return out


class Q4StagedFfn:
    """What `Converter.ffn` hands the sparse split for a layer stored as Q4_0: its 4-bit
    rows (`q4_rows`, engine.kernels.q4_rows.Q4FfnRows) in place of DenseFfn's fp32 matrices."""

    def __init__(self, rows: q4_rows.Q4FfnRows, source, down_name: str | None):
        self.q4_rows = rows
        self.n_ff = rows.up.shape[0]
        self.gated = rows.gate is not None
        self._source, self._down_name = source, down_name  # down_name: its rows were requantized

    def float_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate, up, down_t) fp32 rows of neurons `ids`, the checkpoint's exact values."""
        gate, up, down_t = self.q4_rows.select(ids).dequantized()
        if self._down_name is not None:
            down_t = exact_transposed_rows(self._source, self._down_name, self.q4_rows.dim, ids)
        return gate, up, down_t
