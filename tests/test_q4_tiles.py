"""The many-token int8 x 4-bit product in tiles (engine.kernels.q4_tiles): when it declines, and
that its result does not depend on threads; its numbers are rows of the kernel case table."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_q4, numba_pool, q4_quantize, q4_tiles

pytestmark = pytest.mark.skipif(not cpu_q4.int8_activations(cpu_q4._kernels()),
                                reason="the int8 x 4-bit kernels need numba and AVX2")


# The product against fp64 (every shape and token count): rows `matmul-q4_tiles-*` of tests/kernel_cases.py.


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
