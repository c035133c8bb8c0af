"""4-bit rows (llama.cpp's Q4_0 blocks): the storage format.

A row of `cols` weights is stored as ceil(cols / 32) blocks of 18 bytes, byte for byte
ggml's `block_q4_0`: a little-endian fp16 scale d, then 16 bytes whose low nibbles are
weights 0..15 of the block and whose high nibbles are weights 16..31; weight = (nibble - 8) * d.
A row is therefore self-contained (gatherable: one contiguous run of bytes per neuron) and
a GGUF's Q4_0 rows are these rows unchanged. A row whose length is not a multiple of 32 is
padded with zero weights; the kernels pad x with zeros to match, so the pad adds nothing.
4.5 bits per weight: 0.56 bytes, against 1.03 for the int8 rows.
"""

from __future__ import annotations

import torch

from engine.kernels.tensor_kinds import Q4_0_BLOCK, Q4_0_BLOCK_BYTES

QK, BLOCK_BYTES = Q4_0_BLOCK, Q4_0_BLOCK_BYTES  # weights per block; fp16 scale + 16 bytes of nibbles
QUANT = "int4"


def n_blocks(cols: int) -> int:
    return (cols + QK - 1) // QK


def row_bytes(cols: int) -> int:
    """Bytes of one 4-bit row of `cols` weights."""
    return n_blocks(cols) * BLOCK_BYTES


def dequantize_rows_q4(q: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [n, row_bytes(cols)] -> fp32 [n, cols]."""
    n = q.shape[0]
    nb = n_blocks(cols)
    blocks = q.reshape(n, nb, BLOCK_BYTES)
    d = blocks[:, :, :2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
    nib = blocks[:, :, 2:].to(torch.int16)
    vals = torch.cat([nib & 15, nib >> 4], dim=2).to(torch.float32) - 8.0  # [n, nb, 32]
    return (vals * d).reshape(n, nb * QK)[:, :cols]


def padded(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x fp32 [..., cols] -> contiguous fp32 [..., nb * 32], the pad zero (the kernels' input)."""
    width = n_blocks(cols) * QK
    x = x.detach().to(device="cpu", dtype=torch.float32)
    if width == cols:
        return x.contiguous()
    out = torch.zeros(*x.shape[:-1], width, dtype=torch.float32)
    out[..., :cols] = x
    return out
