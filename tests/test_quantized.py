"""Int8 weight matrices of the CPU tier: products equal those of the dequantized matrix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import linear
from engine.kernels.quantized import Int8Matrix, matrix_nbytes


@pytest.mark.parametrize("tokens", [1, 2, 7, 20])  # 20: the converted-block path
def test_linear_equals_the_dequantized_product(tokens):
    g = torch.Generator().manual_seed(tokens)
    w = torch.randn(2500, 96, generator=g)  # more rows than one dequantized block
    m = Int8Matrix.quantize(w)
    x = torch.randn(tokens, 96, generator=g)
    bias = torch.randn(2500, generator=g)
    ref = F.linear(x.double(), m.dequantize().double(), bias.double())
    out = linear(x, m, bias)
    assert out.shape == (tokens, 2500) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert (m.dequantize() - w).abs().max() <= w.abs().amax(1).max() / 254 + 1e-6  # half a step per row


def test_bytes_and_tier_moves():
    w = torch.randn(64, 32)
    m = Int8Matrix.quantize(w)
    assert m.shape == (64, 32) and m.device.type == "cpu"
    assert m.nbytes == matrix_nbytes(m) == 64 * 32 + 64 * 4
    dense = m.to_dense("cpu", torch.bfloat16)
    assert dense.dtype == torch.bfloat16 and torch.equal(dense, m.dequantize().to(torch.bfloat16))
    again = Int8Matrix.quantize(m.dequantize())  # demoted again after a promotion: the same rows
    assert torch.equal(again.dequantize(), m.dequantize())
