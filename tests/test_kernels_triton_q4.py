"""Triton kernels over 4-bit (Q4_0) rows: refusals. Their numerics (the sparse FFN with no
predictor, with logits, with the layer's logits by row id, and the matvec) are rows of
tests/kernel_cases.py (backend triton). Without CUDA they run under the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import q4_quantize
from engine.kernels.triton_ffn import available
from engine.kernels.triton_q4 import matvec_q4_triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not available(), reason="needs CUDA or TRITON_INTERPRET=1")


def test_rows_of_the_wrong_layout_are_refused():
    q = q4_quantize.quantize_rows_q4(torch.randn(4, 64)).to(DEVICE)
    with pytest.raises(ValueError):
        matvec_q4_triton(torch.randn(96, device=DEVICE), q, 96)
