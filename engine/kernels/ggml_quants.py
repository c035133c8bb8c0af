"""The GGUF quant types users' files hold beyond Q4_0 and Q8_0, kept as their blocks.

Q4_1, Q5_0, Q5_1 (32 weights a block) and the K-quants Q4_K, Q5_K, Q6_K (256 weights a
super-block) are what llama-quantize writes for Q4_K_M / Q5_K_M files and the older
"_1" types. No engine kernel reads their bits: the checkpoint keeps them as the file's
rows of blocks (`NAME.q4_k`, ...; a row is self-contained, so rows may be reordered),
and a load converts them once, a step of rows at a time, into the user's CPU format
(fp32 / int8 / int4 rows). The decode is ggml's own reference (the `gguf` package), exact
in fp32. Torch-free: the GGUF import and the model registry read the table.
"""

from __future__ import annotations

import numpy as np

# stored-name suffix -> (GGUF type name, weights per block, bytes per block)
REFERENCE_KINDS = {
    "q4_1": ("Q4_1", 32, 20),
    "q5_0": ("Q5_0", 32, 22),
    "q5_1": ("Q5_1", 32, 24),
    "q4_k": ("Q4_K", 256, 144),
    "q5_k": ("Q5_K", 256, 176),
    "q6_k": ("Q6_K", 256, 210),
}
TYPE_NAMES = tuple(kind for kind, _, _ in REFERENCE_KINDS.values())


def dequantize_rows(rows: np.ndarray, suffix: str) -> np.ndarray:
    """uint8 rows of blocks [n, row bytes] of a REFERENCE_KINDS type -> fp32 [n, cols]."""
    import gguf

    kind, _, _ = REFERENCE_KINDS[suffix]
    values = gguf.quants.dequantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType[kind])
    return values.astype(np.float32, copy=False).reshape(rows.shape[0], -1)
