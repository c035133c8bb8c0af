"""The many-token int8 x 4-bit product (engine.kernels.q4_tiles) against plain fp64 torch."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_q4, numba_pool, q4_format, q4_quantize, q4_tiles

pytestmark = pytest.mark.skipif(not cpu_q4.int8_activations(cpu_q4._kernels()),
                                reason="the int8 x 4-bit kernels need numba and AVX2")


@pytest.mark.parametrize("n, cols", [(1, 256), (3, 512), (37, 256), (200, 1000), (64, 4096)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9, 20])
def test_product_against_fp64_of_the_stored_rows(n, cols, tokens):
    g = torch.Generator().manual_seed(n * 100 + cols + tokens)
    w = torch.randn(n, cols, generator=g)
    q = q4_quantize.quantize_rows_q4(w)
    x = torch.randn(tokens, cols, generator=g) * torch.rand(tokens, 1, generator=g) * 3
    out = q4_tiles.matmul_q4_tiles(x, q, cols)
    assert out is not None and out.shape == (tokens, n) and out.dtype == torch.float32
    ref = x.double() @ q4_format.dequantize_rows_q4(q, cols).double().T
    # the activations in int8 blocks of 32: each product off by at most half a step (max|x_block| / 254)
    # per element times |w|; summed, a bound per output
    xb = q4_format.padded(x, cols).reshape(tokens, -1, 32).abs().amax(-1, keepdim=True) / 254
    step = xb.expand(-1, -1, 32).reshape(tokens, -1)[:, :cols].double()
    bound = step @ q4_format.dequantize_rows_q4(q, cols).double().abs().T
    assert ((out.double() - ref).abs() <= bound * 1.01 + 1e-4).all()
    # the same sums as the one-token-at-a-time kernel, in another order: fp32 rounding of the
    # sum of absolute products apart
    magnitude = x.double().abs() @ q4_format.dequantize_rows_q4(q, cols).double().abs().T
    assert ((out.double() - cpu_q4.matmul_q4(x, q, cols).double()).abs() <= 1e-6 * magnitude + 1e-6).all()


def test_rows_without_whole_groups_of_8_blocks_are_left_to_matmul_q4():
    q = q4_quantize.quantize_rows_q4(torch.randn(8, 96))  # 3 blocks a row
    assert q4_tiles.matmul_q4_tiles(torch.randn(5, 96), q, 96) is None


def test_turned_off_with_the_int8_activations(monkeypatch):
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    q = q4_quantize.quantize_rows_q4(torch.randn(8, 256))
    assert q4_tiles.matmul_q4_tiles(torch.randn(5, 256), q, 256) is None


def test_result_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    q = q4_quantize.quantize_rows_q4(torch.randn(301, 512, generator=g))
    x = torch.randn(7, 512, generator=g)
    before = numba_pool.num_threads()
    try:
        numba_pool.set_num_threads(1)
        one = q4_tiles.matmul_q4_tiles(x, q, 512)
        numba_pool.set_num_threads(2)
        two = q4_tiles.matmul_q4_tiles(x, q, 512)
    finally:
        numba_pool.set_num_threads(before)
    assert torch.equal(one, two)
