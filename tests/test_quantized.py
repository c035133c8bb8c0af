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


def _q4_1_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A matrix whose rows are Q4_1 blocks (ggml's reference rounding): what a Q4_1 GGUF decodes to."""
    from engine.kernels import cpu_q4_1

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05 + 0.01
    return torch.from_numpy(cpu_q4_1.dequantize_blocks(cpu_q4_1.quantize_blocks(w.numpy())).copy())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_q4_1_values_stay_q4_1_blocks_exactly_and_multiply_as_their_values(tokens, packed):
    from engine.kernels.quantized import Q4Matrix, Q4MinMatrix, quantize_matrix

    w = _q4_1_values(72, 256, tokens)
    m = Q4MinMatrix.exact(w, packed=packed)
    assert m is not None and m.shape == (72, 256) and m.rows.packed == packed
    # the file's values (to the fp32 rounding of each block's offset m + 8 d)
    torch.testing.assert_close(m.dequantize(), w, rtol=0, atol=1e-7)
    torch.testing.assert_close(m.dequantize(8, 24), w[8:24], rtol=0, atol=1e-7)
    assert m.nbytes == 72 * 8 * 18 + 72 * 8 * 4  # Q4_0's rows and an fp32 offset per block
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ w.double().T
    out = linear(x, m)
    # the 4-bit part multiplies int8 activations (blocks of 32, as llama.cpp's Q8): within their rounding
    assert (out.double() - ref).abs().max() <= 0.01 * ref.abs().max()
    for fmt in ("int4", "int8"):  # either CPU format keeps them: another rounding would only lose
        kept = quantize_matrix(w, fmt)
        assert isinstance(kept, Q4MinMatrix) and torch.equal(kept.offsets, m.offsets)
    plain = torch.randn(72, 256, generator=torch.Generator().manual_seed(3))  # not Q4_1 values
    assert Q4MinMatrix.exact(plain) is None and isinstance(quantize_matrix(plain, "int4"), Q4Matrix)
    assert isinstance(quantize_matrix(plain, "int8"), Int8Matrix)


def test_q4_1_blocks_split_into_q4_0_rows_and_offsets_decode_as_ggml_does():
    from engine.kernels import cpu_q4_1, q4_format

    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    raw = cpu_q4_1.quantize_blocks(w.numpy())
    q4, offsets = cpu_q4_1.split_blocks(raw)
    ours = q4_format.dequantize_rows_q4(torch.from_numpy(q4), 64) + torch.from_numpy(offsets).repeat_interleave(32, 1)
    assert torch.allclose(ours, torch.from_numpy(cpu_q4_1.dequantize_blocks(raw)), rtol=0, atol=1e-6)


def test_a_16_bit_matrix_that_is_not_q4_1_is_answered_from_its_probe_rows_without_a_copy():
    """Every matrix a load quantizes is first asked whether it holds Q4_1 blocks; a 16-bit one
    must not be widened whole to fp32 for the answer (a 7B FFN matrix: 180 MB), only its probe rows."""
    from torch.profiler import ProfilerActivity, profile

    from engine.kernels import cpu_q4_1

    w = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(5)).half()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert cpu_q4_1.split_exact(w) is None
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    assert allocated < w.numel() * 4 // 16  # the probe's 8 rows, not the matrix's fp32 copy (8 MB)
