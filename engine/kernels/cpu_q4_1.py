"""4-bit rows with a per-block minimum (ggml's Q4_1) as Q4_0 rows plus one offset per block.

ggml's `block_q4_1` holds 32 weights as an fp16 scale d, an fp16 minimum m and 16 bytes of
nibbles laid out as Q4_0's (low nibbles weights 0..15, high nibbles 16..31): weight = d * q + m.
That is Q4_0's weight d * (q - 8) plus the block's offset m + 8 d. So a Q4_1 row is kept
exactly as the Q4_0 row of the same scale and nibbles (`engine.kernels.cpu_q4`, whose
kernels, packed layout and int8 x 4-bit products it reuses) and an fp32 offset per block;
a product adds the offsets times the activation's block sums, a matrix 32 times smaller.

Why: SmolLM2's GGUF and other "_1" files are Q4_1. Requantizing their values into Q4_0
rounds every weight a second time (perplexity +45% on SmolLM2-135M); these rows hold the
file's values (exactly, but for the fp32 rounding of m + 8 d: an ulp; 5.5 bits a weight: Q4_0's 4.5 and a 4-byte offset per block).
Rows are found from values (`split_exact`): ggml's reference rounding (llama-quantize
without an imatrix) gives back the same blocks from the decoded values, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.q4_format import BLOCK_BYTES as Q4_0_BYTES, QK

BLOCK_BYTES = 20  # ggml's block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles
_PROBE_ROWS = 8  # rows tried before a whole matrix is: most matrices are not Q4_1 values


def split_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 Q4_1 rows [n, nb * 20] -> (Q4_0 rows uint8 [n, nb * 18], offsets fp32 [n, nb])."""
    n, nbytes = raw.shape
    nb = nbytes // BLOCK_BYTES
    blocks = np.ascontiguousarray(raw).reshape(n, nb, BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q4 = np.empty((n, nb, Q4_0_BYTES), dtype=np.uint8)
    q4[:, :, 0:2] = blocks[:, :, 0:2]
    q4[:, :, 2:] = blocks[:, :, 4:]
    return q4.reshape(n, nb * Q4_0_BYTES), m + np.float32(8.0) * d


def quantize_blocks(w: np.ndarray) -> np.ndarray:
    """fp32 [n, nb * 32] -> Q4_1 rows uint8 [n, nb * 20]: ggml's reference rounding (the gguf package)."""
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)


def dequantize_blocks(raw: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(raw.shape[0], -1)


def split_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(Q4_0 rows, offsets) holding the matrix w [n, cols] exactly, where its rows are Q4_1
    blocks (values a Q4_1 file decodes to); None otherwise (tried on a few rows first)."""
    if w.dim() != 2 or w.shape[1] % QK or w.shape[0] == 0 or w.dtype not in (torch.float32, torch.float16,
                                                                                torch.bfloat16):
        return None
    # The probe's rows alone are widened first: most matrices fail it, and a 16-bit one's
    # fp32 copy would be twice its size (a 7B layer's FFN matrix: 180 MB for 8 rows' answer).
    probe = w[:_PROBE_ROWS].detach().to("cpu", torch.float32).numpy()
    if not np.isfinite(probe).all() or not _holds_exactly(probe):
        return None
    values = w.detach().to("cpu", torch.float32).numpy()
    raw = quantize_blocks(values)
    if not np.array_equal(dequantize_blocks(raw), values):
        return None
    q4, offsets = split_blocks(raw)
    return torch.from_numpy(q4), torch.from_numpy(offsets)


def _holds_exactly(values: np.ndarray) -> bool:
    """The values are Q4_1 blocks: ggml's rounding gives back the same values."""
    return bool(np.array_equal(dequantize_blocks(quantize_blocks(values)), values))


def block_sums(x: torch.Tensor, nb: int) -> torch.Tensor:
    """x fp32 [T, cols] -> sums of each block of 32 columns [T, nb] (zero padded)."""
    t, cols = x.shape
    if cols < nb * QK:
        x = torch.nn.functional.pad(x, (0, nb * QK - cols))
    return x.reshape(t, nb, QK).sum(-1)
