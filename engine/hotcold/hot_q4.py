"""4-bit hot rows: the fast tier's FFN rows as Q4_0 blocks (the rows of `engine.kernels.cpu_q4`,
18 bytes per 32 weights), when the fast tier is a CUDA GPU and the CPU format is int4.

Decode computes them with the Triton kernels of `engine.kernels.triton_q4` straight from
the 4-bit rows (the predictor's logits thresholded inside the kernel, as `triton_ffn` does
for 16-bit rows); placement counts their 4-bit bytes. Rows move between the tiers as
codes: a neuron promoted from int4 cold rows or taken from a checkpoint's Q4_0 rows is the
same bytes on the GPU, never requantized.

With the CPU standing in for the fast device (`SparseRuntime.hot_weights = "int4"`, or
`THERMOCLINE_HOT_WEIGHTS=int4`: tests and benchmarks), the same rows run in `cpu_q4`'s
kernels (numba, or its torch fallback), or in the Triton kernels under
TRITON_INTERPRET=1 when `TRITON_ON_CPU` is set. Prefill and the oracle's batched path
read them dequantized (`dense()`: in the fast tier's dtype, a copy per call).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from engine.hotcold.hybrid_ffn import ColdRows, HotRows, concat_rows
from engine.hotcold.placement import hot_row_format
from engine.kernels import cpu_q4, q4_format, q4_quantize, q4_rows

HOT_INT4 = "int4"
HOT_WEIGHTS_ENV = "THERMOCLINE_HOT_WEIGHTS"  # int4: 4-bit hot rows on any fast device
TRITON_ON_CPU = False  # tests: the Triton kernels (interpreted) for 4-bit hot rows on the CPU


def hot_weights(fast: torch.device, cpu_weights: str) -> str | None:
    """The hot tier's row format: int4 on a CUDA fast tier with int4 CPU weights (or when
    THERMOCLINE_HOT_WEIGHTS=int4 asks for it), else None (the fast tier's compute dtype)."""
    if os.environ.get(HOT_WEIGHTS_ENV, "").strip().lower() == HOT_INT4:
        return HOT_INT4
    return hot_row_format(fast.type, cpu_weights)


class Q4HotRows(HotRows):
    """Hot neurons as 4-bit rows on the fast device (uint8 [n, row_bytes(dim)] each), with ids."""

    quant = HOT_INT4

    def __init__(self, q_gate: torch.Tensor | None, q_up: torch.Tensor, q_down: torch.Tensor, ids: torch.Tensor,
                 dim: int, dtype: torch.dtype):
        self.q_gate, self.q_up, self.q_down, self.ids = q_gate, q_up, q_down, ids
        self.dim, self.dtype, self.device = dim, dtype, q_up.device
        self.cpu_rows = None  # not the fp32 CPU kernels' rows
        # on a CPU fast device, cpu_q4's kernels read the same bytes
        self.q4_rows = q4_rows.Q4FfnRows(q_gate, q_up, q_down, dim) if self.device.type == "cpu" else None

    @classmethod
    def from_rows(cls, rows: q4_rows.Q4FfnRows, ids: torch.Tensor, device: torch.device,
                  dtype: torch.dtype) -> "Q4HotRows":
        """4-bit CPU rows (cold rows, a checkpoint's Q4_0 rows) on the fast device, as they are."""
        def move(t):
            if t is None:
                return None
            return t.to(device).contiguous() if device.type != "cpu" else t.contiguous().clone()

        return cls(move(rows.gate), move(rows.up), move(rows.down_t), ids.to(device), rows.dim, dtype)

    @classmethod
    def from_float(cls, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor, ids: torch.Tensor,
                   device: torch.device, dtype: torch.dtype) -> "Q4HotRows":
        """Float rows [n, d] quantized to Q4_0 (ggml's rounding) on the fast device."""
        q = q4_rows.Q4FfnRows(*(None if t is None else q4_quantize.quantize_rows_q4(t) for t in (gate, up, down_t)),
                             up.shape[1])
        return cls.from_rows(q, ids, device, dtype)

    @classmethod
    def empty(cls, gated: bool, dim: int, device: torch.device, dtype: torch.dtype) -> "Q4HotRows":
        z = torch.empty(0, q4_format.row_bytes(dim), dtype=torch.uint8, device=device)
        return cls(z if gated else None, z, z, torch.empty(0, dtype=torch.long, device=device), dim, dtype)

    # Dequantized matrices for the many-token paths: hybrid_ffn asks dense() once per call and
    # reads dtype/dim for metadata (no gate/up/down_t attributes: each would be a whole copy).
    def _dense(self, q: torch.Tensor | None) -> torch.Tensor | None:
        return None if q is None else q4_format.dequantize_rows_q4(q, self.dim).to(self.dtype)

    def dense(self, *parts: str) -> tuple[torch.Tensor | None, ...]:
        codes = {"gate": self.q_gate, "up": self.q_up, "down_t": self.q_down}
        return tuple(self._dense(codes[part]) for part in parts)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q_gate, self.q_up, self.q_down, self.ids)
                   if t is not None)

    def fp32_rows(self):
        def cpu32(q):
            return None if q is None else q4_format.dequantize_rows_q4(q.cpu(), self.dim)
        return cpu32(self.q_gate), cpu32(self.q_up), cpu32(self.q_down)

    def cpu_q4_rows(self, positions: torch.Tensor | None = None) -> q4_rows.Q4FfnRows:
        """These rows (or those at `positions`) as CPU 4-bit rows: the codes, copied."""
        def take(q):
            if q is None:
                return None
            q = q if positions is None else q[positions.to(q.device)]
            return q.to("cpu").contiguous().clone()
        return q4_rows.Q4FfnRows(take(self.q_gate), take(self.q_up), take(self.q_down), self.dim)

    def decode(self, x: torch.Tensor, logits: torch.Tensor | None, threshold: float, activation: str,
               act_threshold: float) -> torch.Tensor:
        """y fp32 [dim] on the fast device: the neurons whose logits reach `threshold` (all
        when logits is None), from the 4-bit rows."""
        if self.device.type == "cuda" or TRITON_ON_CPU:
            from engine.kernels.triton_q4 import sparse_ffn_q4_triton

            logits = None if logits is None else logits.float()
            return sparse_ffn_q4_triton(x, self.q_gate, self.q_up, self.q_down, self.dim, logits,
                                        threshold if logits is not None else 0.0, activation, act_threshold,
                                        row_ids=self.ids if logits is not None else None)
        xc = x.to("cpu", torch.float32)
        if logits is None:
            return cpu_q4.sparse_ffn(xc, self.q4_rows, None, activation, act_threshold)
        return cpu_q4.sparse_ffn_predicted(xc, self.q4_rows, logits.to("cpu", torch.float32), threshold,
                                           activation, act_threshold, row_ids=self.ids.cpu())


def move_neurons_q4(ffn, new_hot: np.ndarray, cold_format: str, to_cold) -> None:
    """`TierMoves._move_neurons` for 4-bit hot rows: promoted rows come from the cold tier
    (as codes when the cold rows are int4, else quantized), demoted ones go back as codes
    (int4 cold rows) or through `to_cold(gate, up, down_t)` from their dequantized values."""
    hot = ffn.hot
    old_hot_ids = hot.ids.cpu().numpy()
    new_hot = np.asarray(new_hot, dtype=np.int64)
    keep_hot = np.isin(old_hot_ids, new_hot)
    promote = np.setdiff1d(new_hot, old_hot_ids)
    cold_ids = ffn.cold.ids.numpy()
    keep_cold = ~np.isin(cold_ids, promote)

    promoted = ffn.cold.rows.select(torch.as_tensor(np.flatnonzero(~keep_cold)))
    if promoted.quant != q4_format.QUANT:
        promoted = q4_rows.Q4FfnRows.from_dense(*promoted.dequantized())
    stay = hot.cpu_q4_rows(torch.as_tensor(np.flatnonzero(keep_hot)))
    ids = np.concatenate([old_hot_ids[keep_hot], cold_ids[~keep_cold]])
    order = torch.as_tensor(np.argsort(ids, kind="stable"))
    merged = q4_rows.Q4FfnRows.concat([stay, promoted]).select(order)
    new_hot_rows = Q4HotRows.from_rows(merged, torch.as_tensor(ids[order.numpy()]), hot.device, hot.dtype)

    demote_pos = torch.as_tensor(np.flatnonzero(~keep_hot))
    kept = ffn.cold.rows.select(torch.as_tensor(np.flatnonzero(keep_cold)))
    parts = [kept]
    if len(demote_pos):
        if cold_format == q4_format.QUANT:
            parts.append(hot.cpu_q4_rows(demote_pos))
        else:
            g, u, d = hot.fp32_rows()
            parts.append(to_cold(None if g is None else g[demote_pos], u[demote_pos], d[demote_pos]))
    cold_all = np.concatenate([cold_ids[keep_cold], old_hot_ids[demote_pos.numpy()]])
    cold_order = torch.as_tensor(np.argsort(cold_all, kind="stable"))
    if len(parts) > 1:
        rows = concat_rows(parts).select(cold_order)
    else:
        rows = kept
    ffn.hot = new_hot_rows
    ffn.cold = ColdRows(rows, torch.as_tensor(cold_all[cold_order.numpy()]))

