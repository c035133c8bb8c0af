"""The prepared files' layout versions move with the names their matrices are stored under:
a file of an older layout must be rebuilt, never read with names it does not hold (or by an
older engine that ignores names it does not know)."""

from __future__ import annotations

import torch

from engine.kernels import cpu_q4_1
from engine.kernels.quantized import Int8Matrix, Q4Matrix, Q4MinMatrix
from engine.loading import prepared

# Per (file, layout version): the suffixes a matrix `NAME` may be stored under. A new storage
# kind joins the next version's row, and the version constant moves with it.
LAYOUTS = {
    ("dense", 3): {"", ".q", ".scale", ".q4", ".q4x8"},
    ("dense", 4): {"", ".q", ".scale", ".q4", ".q4x8", ".q4min"},  # Q4_1 matrices kept (Q4MinMatrix)
    ("dense-mode", 3): {"", ".q", ".scale", ".q4", ".q4x8", ".q4min"},
}


def _stored_suffixes() -> set[str]:
    """Every suffix `_matrix_parts` writes, over every matrix kind a CPU tier holds."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q4_1 = torch.from_numpy(cpu_q4_1.dequantize_blocks(cpu_q4_1.quantize_blocks(w.numpy())).copy())
    kinds = [w, Int8Matrix.quantize(w), Q4Matrix.quantize(w), Q4Matrix.quantize(w, packed=True),
             Q4MinMatrix.exact(q4_1), Q4MinMatrix.exact(q4_1, packed=True)]
    return {name[len("m"):] for kind in kinds for name in prepared._matrix_parts("m", kind)}


def test_the_layout_versions_name_what_the_files_hold():
    held = _stored_suffixes()
    assert LAYOUTS[("dense", prepared.DENSE_LAYOUT_VERSION)] == held
    assert LAYOUTS[("dense-mode", prepared.DENSE_MODE_LAYOUT_VERSION)] == held
