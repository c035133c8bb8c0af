"""Dense weight matrices kept in int8 or 4-bit rows on the CPU tier.

A decode step reads every weight of the attention projections, the output head and the
predictors once, so on the CPU their bytes set the speed. Stored as int8 rows with one fp32 scale per row
(the format of the cold FFN rows, `engine.kernels.cpu_quant`), they take a quarter of the
RAM and of the time of fp32. A few tokens go through the int8 matrix-vector kernel, one
token at a time; many (a long prefill) through torch on a block of rows converted at a time.
On AVX2 hosts both go through the int8 x int8 kernel instead (the activation quantized in
blocks, as llama.cpp does), which reads each row once whatever the token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import cpu as cpu_kernels
from engine.kernels import cpu_q4, cpu_q4_1, cpu_q4x8, q4_format, q4_quantize, q4_tiles
from engine.kernels.cpu_quant import dequantize_rows_int8, quantize_rows_int8
from engine.kernels import host_memory

# Rows converted per step of a many-token product: bounds the fp32 copy to a few MB.
_BLOCK_ROWS = 1024
_PACK_ROWS = 4096  # rows quantized then packed per step (a multiple of cpu_q4x8.GROUP)
# Up to this many tokens, one int8 matrix-vector product per token beats converting the
# matrix for torch's product (32000 x 4096 head, 2 cores: 2 tokens 10 vs 55 ms for fp32
# weights, 16 tokens 79 vs 102 ms; 128 tokens favour the conversion).
_PER_TOKEN_MAX = 16


class QuantMatrix:
    """A weight matrix [n, d] in quantized rows `q` (one row of bytes per output): `linear`,
    `dequantize`, `to_dense`, `nbytes`, `shape`, `device`."""

    @property
    def device(self) -> torch.device:
        return self.q.device

    def to_dense(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The whole matrix as a plain tensor (moving to another tier)."""
        return self.dequantize().to(device, dtype)


@dataclass(eq=False, frozen=True)
class Int8Matrix(QuantMatrix):
    """A weight matrix [n, d]: q int8 [n, d] and scale fp32 [n], row i = q[i] * scale[i]."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Matrix":
        """From a float matrix on any device (the rows in host_memory: huge pages)."""
        return cls(*quantize_rows_int8(w, out_q=host_memory.empty(tuple(w.shape), torch.int8)))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows lo..hi as fp32."""
        return dequantize_rows_int8(self.q[lo:hi], self.scale[lo:hi])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, d] (CPU) @ this^T -> fp32 [T, n]."""
        x = x.float()
        out = cpu_kernels.matmul_int8(x, self.q, self.scale)  # int8 x int8, where the host can
        if out is not None:
            return out
        if x.shape[0] <= _PER_TOKEN_MAX:
            return torch.stack([cpu_kernels.matvec_int8(row, self.q, self.scale) for row in x])
        n = self.q.shape[0]
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for lo in range(0, n, _BLOCK_ROWS):
            hi = min(lo + _BLOCK_ROWS, n)
            # the row scales apply to output columns: scale after the product, not the rows
            out[:, lo:hi] = F.linear(x, self.q[lo:hi].float()).mul_(self.scale[lo:hi])
        return out


@dataclass(eq=False, frozen=True)
class Q4Matrix(QuantMatrix):
    """A weight matrix [n, cols] as 4-bit rows (`engine.kernels.cpu_q4`: ggml's Q4_0 blocks):
    q uint8 [n, row_bytes(cols)]. 4.5 bits per weight, half the bytes of int8 rows.

    `packed`: q holds the same bytes rearranged into groups of 8 interleaved rows
    (`engine.kernels.cpu_q4x8`), the layout of matrices only ever read whole on the CPU
    (`pack`, `quantize_matrix`): their product streams about twice as fast. Its rows are not
    gatherable; `dequantize(lo, hi)` and `to_dense` unpack them."""

    q: torch.Tensor
    cols: int
    packed: bool = False

    @classmethod
    def quantize(cls, w: torch.Tensor, packed: bool = False) -> "Q4Matrix":
        """From a float matrix on any device (the rows in host_memory: huge pages), packed on request."""
        out = host_memory.empty((w.shape[0], q4_format.row_bytes(w.shape[1])), torch.uint8) if w.dim() == 2 else None
        if not packed or out is None:
            m = cls(q4_quantize.quantize_rows_q4(w, out=out), w.shape[1])
            return m.pack() if packed else m
        # packed a block of rows at a time (whole groups): no second copy of the whole matrix
        for lo in range(0, w.shape[0], _PACK_ROWS):
            hi = min(lo + _PACK_ROWS, w.shape[0])
            cpu_q4x8.pack_rows(q4_quantize.quantize_rows_q4(w[lo:hi]), out=out[lo:hi])
        return cls(out, w.shape[1], packed=True)

    def pack(self) -> "Q4Matrix":
        """This matrix in the packed layout (itself when it is), on huge pages."""
        if self.packed:
            return self
        return Q4Matrix(cpu_q4x8.pack_rows(self.q, out=host_memory.empty(tuple(self.q.shape), torch.uint8)),
                        self.cols, packed=True)

    def rows(self) -> torch.Tensor:
        """The plain 4-bit rows (unpacked when packed: a new tensor), what files store."""
        return cpu_q4x8.unpack_rows(self.q) if self.packed else self.q

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[0], self.cols))

    @property
    def nbytes(self) -> int:
        return self.q.numel()

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows lo..hi as fp32."""
        if self.packed:
            lo, hi, _ = slice(lo, hi).indices(self.q.shape[0])
            return q4_format.dequantize_rows_q4(cpu_q4x8.unpack_rows(self.q, lo, hi), self.cols)
        return q4_format.dequantize_rows_q4(self.q[lo:hi], self.cols)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, cols] (CPU) @ this^T -> fp32 [T, n]."""
        x = x.float()
        if self.packed:
            # 8 interleaved rows a pass (cpu_q4x8), where the host can; else torch below
            out = cpu_q4x8.matmul_packed(x, self.q, self.cols)
        else:
            # int8 x 4-bit, where the host can: one fp32 step per 8 blocks (q4_tiles) where the rows
            # have whole groups of 8 blocks (a 22016 x 4096 matrix, 2 cores: 20 tokens 72-85 vs 150-158 ms,
            # 128 tokens 430-725 vs 1040 ms, one token 12.3 vs 13.8 ms), else matmul_q4
            out = q4_tiles.matmul_q4_tiles(x, self.q, self.cols)
            if out is None:
                out = cpu_q4.matmul_q4(x, self.q, self.cols)
        if out is not None:
            return out
        if x.shape[0] <= _PER_TOKEN_MAX and not self.packed:
            return torch.stack([cpu_q4.matvec_q4(row, self.q, self.cols) for row in x])
        n = self.q.shape[0]
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for lo in range(0, n, _BLOCK_ROWS):  # _BLOCK_ROWS: whole groups of 8 packed rows
            hi = min(lo + _BLOCK_ROWS, n)
            out[:, lo:hi] = F.linear(x, self.dequantize(lo, hi))
        return out


@dataclass(eq=False, frozen=True)
class Q4MinMatrix(QuantMatrix):
    """A weight matrix [n, cols] of ggml's Q4_1 blocks (a per-block minimum, weight = d * q + m),
    held exactly as `rows`, the Q4_0 rows of the same scales and nibbles (a Q4Matrix, packed
    or not), plus `offsets` fp32 [n, nb] = m + 8 d (`engine.kernels.cpu_q4_1`). Its product
    is the 4-bit rows' product plus the activation's block sums times the offsets."""

    rows: Q4Matrix
    offsets: torch.Tensor

    @classmethod
    def exact(cls, w: torch.Tensor, packed: bool = False) -> "Q4MinMatrix | None":
        """w as Q4_1 rows when its values are (a Q4_1 GGUF's, decoded), else None."""
        split = cpu_q4_1.split_exact(w)
        if split is None:
            return None
        q4, offsets = split
        q = host_memory.empty(tuple(q4.shape), torch.uint8)
        q.copy_(q4)
        rows = Q4Matrix(q, w.shape[1])
        return cls(rows.pack() if packed else rows, offsets)

    @property
    def q(self) -> torch.Tensor:
        return self.rows.q

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.offsets.numel() * 4

    def pack(self) -> "Q4MinMatrix":
        return self if self.rows.packed else Q4MinMatrix(self.rows.pack(), self.offsets)

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows lo..hi as fp32."""
        w = self.rows.dequantize(lo, hi)
        return w + self.offsets[lo:hi].repeat_interleave(q4_format.QK, dim=1)[:, : self.rows.cols]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, cols] (CPU) @ this^T -> fp32 [T, n]."""
        x = x.float()
        out = self.rows.linear(x)
        return out.addmm_(cpu_q4_1.block_sums(x, self.offsets.shape[1]), self.offsets.t())


# The CPU tier's matrix formats by name (--cpu-weights); fp32 is a plain tensor.
MATRIX_FORMATS = {"int8": Int8Matrix, "int4": Q4Matrix}


def quantize_matrix(w: torch.Tensor | QuantMatrix, fmt: str) -> QuantMatrix:
    """w in the CPU tier's format `fmt` (int8 or int4) for products with the whole matrix: a
    matrix already in it is kept, 4-bit ones packed (a GGUF's Q4_0 rows: one rearranging copy).
    Values that are Q4_1 blocks (a Q4_1 GGUF's) stay those blocks in either format
    (`Q4MinMatrix`, exact): int8 rows or Q4_0 rows would round them again."""
    cls = MATRIX_FORMATS[fmt]
    if isinstance(w, (Q4Matrix, Q4MinMatrix)) and cls is Q4Matrix:
        return w.pack()
    if isinstance(w, (cls, Q4MinMatrix)):
        return w
    if isinstance(w, torch.Tensor):
        kept = Q4MinMatrix.exact(w, packed=True)
        if kept is not None:
            return kept
    if cls is Q4Matrix:
        return Q4Matrix.quantize(w.to_dense("cpu", torch.float32) if isinstance(w, QuantMatrix) else w, packed=True)
    return cls.quantize(w.to_dense("cpu", torch.float32) if isinstance(w, QuantMatrix) else w)


def matrix_nbytes(w: torch.Tensor | QuantMatrix | None) -> int:
    if w is None:
        return 0
    if isinstance(w, QuantMatrix):
        return w.nbytes
    return w.numel() * w.element_size()
