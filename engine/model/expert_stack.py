"""One layer's experts in a CPU row format, stacked per matrix: the layout a mixture's
cold tier holds (engine.hotcold.moe_tiers.ColdExperts.stack) and the MoE prepared file
stores (engine.loading.prepared_moe).

gate, up and down_t are [E, n, d] int8 with fp32 scales [E, n] (row = q * scale), or
uint8 [E, n, row_bytes(d)] Q4_0 rows (ggml's blocks, engine.kernels.q4_format). Expert e's
rows are `stack.gate[e]` ...: contiguous slices, so `expert(e)` gives the CPU kernels'
storage of one expert as views, no copy. Rows are quantized one by one, so an expert's
rows here are bit for bit the ones `CpuFfnRows.from_dense` / `Q4FfnRows.from_dense` make
from the same floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu as cpu_kernels
from engine.kernels import host_memory, q4_format, q4_rows
from engine.kernels.cpu_quant import quantize_rows_int8
from engine.kernels.q4_quantize import quantize_rows_q4

FORMATS = ("int8", q4_format.QUANT)
PARTS = ("gate", "up", "down_t")


@dataclass(eq=False)
class ExpertStack:
    quant: str  # "int8" or "int4"
    dim: int  # d: the model's hidden size (a 4-bit row holds row_bytes(d) bytes)
    gate: torch.Tensor
    up: torch.Tensor
    down_t: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.quant not in FORMATS:
            raise ValueError(f"unknown expert format {self.quant!r}; expected one of {FORMATS}")
        e, n = self.up.shape[:2]
        width = q4_format.row_bytes(self.dim) if self.quant == q4_format.QUANT else self.dim
        dtype = torch.uint8 if self.quant == q4_format.QUANT else torch.int8
        for name in PARTS:
            t = getattr(self, name)
            if tuple(t.shape) != (e, n, width) or t.dtype != dtype or not t.is_contiguous() or t.is_cuda:
                raise ValueError(f"{name}: expected contiguous CPU {dtype} {[e, n, width]}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if self.quant == "int8":
            for name in ("gate_scale", "up_scale", "down_scale"):
                s = getattr(self, name)
                if s is None or tuple(s.shape) != (e, n) or s.dtype != torch.float32 or not s.is_contiguous():
                    raise ValueError(f"{name}: int8 experts need fp32 [{e}, {n}] scales")

    @classmethod
    def quantize(cls, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor, quant: str) -> "ExpertStack":
        """Float stacks [E, n, d] (a DenseMoe's) into the CPU format, on huge pages."""
        e, n, d = up.shape

        def rows(t):  # [E*n, d] float rows -> the format's [E, n, ...] (+ scales [E, n])
            flat = t.reshape(e * n, d)
            if quant == q4_format.QUANT:
                out = host_memory.empty((e * n, q4_format.row_bytes(d)), torch.uint8)
                return quantize_rows_q4(flat, out=out).view(e, n, -1), None
            q, scale = quantize_rows_int8(flat, out_q=host_memory.empty((e * n, d), torch.int8))
            return q.view(e, n, d), scale.view(e, n)

        (g, gs), (u, us), (dn, ds) = rows(gate), rows(up), rows(down_t)
        return cls(quant, d, g, u, dn, gs, us, ds)

    @property
    def num_experts(self) -> int:
        return self.up.shape[0]

    @property
    def n_ff(self) -> int:
        return self.up.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored arrays by part name (scales as `<part>_scale`, down's as `down_t_scale`)."""
        out = {p: getattr(self, p) for p in PARTS}
        if self.quant == "int8":
            out.update(gate_scale=self.gate_scale, up_scale=self.up_scale, down_t_scale=self.down_scale)
        return out

    def expert(self, e: int) -> cpu_kernels.CpuFfnRows | q4_rows.Q4FfnRows:
        """Expert e's rows in the CPU kernels' storage: views of the stack."""
        if self.quant == q4_format.QUANT:
            return q4_rows.Q4FfnRows(self.gate[e], self.up[e], self.down_t[e], self.dim)
        return cpu_kernels.CpuFfnRows(self.gate[e], self.up[e], self.down_t[e], self.gate_scale[e],
                                      self.up_scale[e], self.down_scale[e], quant="int8")
