"""The checkpoint's quantized tensor kinds (torch-free: the GGUF import writes them).

A weight `NAME` of a checkpoint may be stored as ggml blocks instead of floats: the uint8
tensor `NAME.q4_0` or `NAME.q8_0`, shape [rows, row bytes], whose rows are NAME's rows
(a row of `cols` weights is cols / 32 blocks: Q4_0 an fp16 scale and 16 bytes of nibbles,
18 bytes; Q8_0 an fp16 scale and 32 int8, 34 bytes; or `NAME.q4_1` ... `NAME.q6_k`, the
blocks of engine.kernels.ggml_quants), or `NAME.t.q4_0` / `NAME.t.q8_0`,
whose rows are those of NAME's transpose (PowerInfer's `ffn_down_t`, the engine's down_t
rows). `engine.loading.weights.WeightSource` answers them under NAME.
"""

from __future__ import annotations

from engine.kernels.ggml_quants import REFERENCE_KINDS

# ggml's block_q4_0: 32 weights in an fp16 scale + 16 bytes of nibbles. The one home of these
# numbers (torch-free): engine.kernels.cpu_q4 and engine.hotcold.placement take them from here.
Q4_0_BLOCK, Q4_0_BLOCK_BYTES = 32, 18
# stored-name suffix -> (kind, weights per block, bytes per block): ggml's block_q4_0 / block_q8_0,
# and the types decoded by ggml's reference (engine.kernels.ggml_quants: Q4_1 ... Q6_K)
QUANT_KINDS = {"q4_0": ("Q4_0", Q4_0_BLOCK, Q4_0_BLOCK_BYTES), "q8_0": ("Q8_0", 32, 34), **REFERENCE_KINDS}
TRANSPOSED = "t"  # NAME.t.q4_0: rows of NAME's transpose


def quant_name(name: str, kind: str, transposed: bool = False) -> str:
    """The stored name of weight `name` in quantized kind `kind` (Q4_0 or Q8_0)."""
    return f"{name}.{TRANSPOSED + '.' if transposed else ''}{kind.lower()}"


def parse_quant_name(stored: str) -> tuple[str, str, bool] | None:
    """(weight name, suffix, transposed) of a stored quantized tensor's name, else None."""
    base, _, suffix = stored.rpartition(".")
    if suffix not in QUANT_KINDS or not base:
        return None
    if base.endswith("." + TRANSPOSED):
        return base[: -len(TRANSPOSED) - 1], suffix, True
    return base, suffix, False
