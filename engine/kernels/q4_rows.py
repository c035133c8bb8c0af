"""4-bit rows' container: one layer's FFN rows (or a subset of its neurons) as Q4_0 rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import host_memory
from engine.kernels.call_args import FfnRowsShape
from engine.kernels.q4_format import QUANT, dequantize_rows_q4, row_bytes
from engine.kernels.q4_quantize import quantize_rows_q4


@dataclass(eq=False, frozen=True)
class Q4FfnRows(FfnRowsShape):
    """One layer's FFN rows (or a subset of its neurons) as 4-bit rows: gate/up/down_t
    uint8 [n, row_bytes(dim)] (gate None when ungated), contiguous on the CPU. The same
    interface as `cpu.CpuFfnRows` (quant "int4")."""

    gate: torch.Tensor | None
    up: torch.Tensor
    down_t: torch.Tensor
    dim: int
    quant: str = QUANT

    def __post_init__(self):
        n = self.up.shape[0]
        shape = (n, row_bytes(self.dim))
        for name in ("gate", "up", "down_t"):
            t = getattr(self, name)
            if t is None:
                continue
            if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous() or t.is_cuda:
                raise ValueError(f"{name}: expected contiguous CPU uint8 {list(shape)}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        object.__setattr__(self, "_np", None)

    @classmethod
    def from_dense(cls, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor) -> "Q4FfnRows":
        """Quantize float rows [n, d] (any dtype, any device) into 4-bit rows on huge pages."""
        def quantize(t):
            if t is None:
                return None
            return quantize_rows_q4(t, out=host_memory.empty((t.shape[0], row_bytes(t.shape[1])), torch.uint8))

        return cls(quantize(gate), quantize(up), quantize(down_t), up.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.gate, self.up, self.down_t) if t is not None)

    def select(self, neuron_ids: torch.Tensor) -> "Q4FfnRows":
        """Copies of rows `neuron_ids`, in that order (no requantisation: rows are self-contained)."""
        ids = self.checked_ids(neuron_ids)

        def pick(t):
            return host_memory.gather_rows(t, ids) if t is not None else None

        return Q4FfnRows(pick(self.gate), pick(self.up), pick(self.down_t), self.dim)

    @staticmethod
    def concat(parts: list["Q4FfnRows"]) -> "Q4FfnRows":
        def cat(name):
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors)
        return Q4FfnRows(cat("gate"), cat("up"), cat("down_t"), parts[0].dim)

    def dequantized(self, lo: int = 0, hi: int | None = None, parts: tuple[str, ...] = ("gate", "up", "down_t")
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(gate, up, down_t) rows lo..hi as fp32 copies (None for those not in `parts`)."""
        def deq(name):
            t = getattr(self, name)
            return None if t is None or name not in parts else dequantize_rows_q4(t[lo:hi], self.dim)
        return deq("gate"), deq("up"), deq("down_t")

    def _numpy_views(self):
        if self._np is None:
            up = self.up.numpy()
            object.__setattr__(self, "_np", (self.gate.numpy() if self.gate is not None else up, up,
                                             self.down_t.numpy()))
        return self._np
