"""The interleaved 4-bit layout (engine.kernels.cpu_q4x8) and its products, against plain fp64 torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import cpu_q4, cpu_q4x8, numba_pool, q4_format, q4_quantize
from engine.kernels.quantized import Q4Matrix, quantize_matrix

HAS_KERNELS = cpu_q4.int8_activations(cpu_q4._kernels())
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="the int8 x 4-bit kernels need numba and AVX2")


def _as_q8(x: torch.Tensor) -> torch.Tensor:
    """x [T, d] as the int8 x 4-bit kernels compute with it, written here independently: llama.cpp's
    Q8_0 blocks of 32 (fp32 scale max|x| / 127, values rint(x / scale)), dequantized in fp64."""
    t, d = x.shape
    width = -(-d // 32) * 32
    xp = np.zeros((t, width), dtype=np.float32)
    xp[:, :d] = x.numpy()
    blocks = xp.reshape(t, -1, 32)
    s = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127.0)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    return torch.from_numpy((q.astype(np.float64) * s.astype(np.float64)).reshape(t, -1)[:, :d])


def _weights(n, cols, seed, zero_blocks=True):
    """Random weights with some all-zero blocks (scale 0) and blocks whose largest value is
    positive (a negative scale) as well as negative."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, cols, generator=g) * torch.rand(n, 1, generator=g) * 2
    if zero_blocks and n > 2 and cols >= 32:
        w[1, :32] = 0
        w[n - 1, -min(cols, 40):] = 0
    return w


@pytest.mark.parametrize("n, cols", [(1, 32), (7, 64), (8, 32), (13, 100), (24, 256), (37, 300), (64, 4096)])
def test_pack_keeps_every_byte_and_unpacks_any_row_range(n, cols):
    q = q4_quantize.quantize_rows_q4(_weights(n, cols, n + cols))
    p = cpu_q4x8.pack_rows(q)
    assert p.shape == q.shape and p.dtype == torch.uint8
    assert torch.equal(p.flatten().sort().values, q.flatten().sort().values)  # a rearrangement
    full = cpu_q4x8.packed_rows(n)
    assert torch.equal(p[full:], q[full:])  # the tail rows stay plain
    assert torch.equal(cpu_q4x8.unpack_rows(p), q)
    for lo, hi in ((0, 1), (3, n - 2), (n - 1, n), (5, 17), (n, n)):
        lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
        assert torch.equal(cpu_q4x8.unpack_rows(p, lo, hi), q[lo:hi])


def test_layout_interleaves_four_bytes_of_each_row():
    """Group 0, block 0: the 8 rows' scales side by side, then 4-byte pieces of each row's nibbles."""
    nb = 3
    q = torch.arange(8 * nb * 18, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, nb * 18)
    p = cpu_q4x8.pack_rows(q).flatten()
    for r in range(8):
        for b in range(nb):
            assert torch.equal(p[b * 16 + 2 * r: b * 16 + 2 * r + 2], q[r, b * 18: b * 18 + 2])
            for c in range(4):
                o = nb * 16 + b * 128 + c * 32 + r * 4
                assert torch.equal(p[o:o + 4], q[r, b * 18 + 2 + 4 * c: b * 18 + 6 + 4 * c])


# The packed product against fp64 (every shape and token count): rows `matmul-q4x8-*` of tests/kernel_cases.py.


@needs_kernels
def test_extreme_blocks_do_not_saturate_16_bit_sums():
    """Every nibble 15 (or 0) against activations at +-127: the largest 16-bit lane sums the kernel makes."""
    cols, n = 256, 16
    # ggml's rounding maps a block's value of largest magnitude (-1 here) to nibble 0 and
    # 7/8 of it, the opposite sign, to nibble 15: all nibbles 15 but one a block
    w = torch.full((n, cols), 0.875)
    w[:, ::32] = -1.0
    q = q4_quantize.quantize_rows_q4(w)
    assert (q.reshape(n, -1, 18)[:, :, 3:] == 0xFF).all()
    x = torch.full((3, cols), 5.0)
    x[1, 1::2] = -5.0  # mixed signs
    x[2] = -x[2]  # every 16-bit lane at -(8 x 2 x 15 x 127)
    y = cpu_q4x8.matmul_packed(x, cpu_q4x8.pack_rows(q), cols)
    ref = _as_q8(x) @ q4_format.dequantize_rows_q4(q, cols).double().T
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-4)


@needs_kernels
def test_result_does_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    p = cpu_q4x8.pack_rows(q4_quantize.quantize_rows_q4(torch.randn(301, 512, generator=g)))
    x = torch.randn(7, 512, generator=g)
    before = numba_pool.num_threads()
    try:
        numba_pool.set_num_threads(1)
        one = cpu_q4x8.matmul_packed(x, p, 512)
        numba_pool.set_num_threads(2)
        two = cpu_q4x8.matmul_packed(x, p, 512)
    finally:
        numba_pool.set_num_threads(before)
    assert torch.equal(one, two)


def test_kernels_turned_off_with_the_int8_activations(monkeypatch):
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    p = cpu_q4x8.pack_rows(q4_quantize.quantize_rows_q4(torch.randn(8, 256)))
    assert cpu_q4x8.matmul_packed(torch.randn(5, 256), p, 256) is None


@pytest.mark.parametrize("path", ["kernels", "fp32 kernels off", "no numba"])
@pytest.mark.parametrize("n, cols", [(4100, 96), (13, 4096), (5, 40)])
def test_packed_matrix_computes_the_plain_one(monkeypatch, path, n, cols):
    """Q4Matrix packed: linear (every path), dequantize of any range, quantize_matrix packs."""
    if path == "kernels" and not HAS_KERNELS:
        pytest.skip("no AVX2 host or numba")
    if path != "kernels":
        monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    if path == "no numba":
        monkeypatch.setattr(cpu_q4, "_kernels", lambda: None)
    w = _weights(n, cols, n + cols)
    plain = Q4Matrix.quantize(w)
    packed = Q4Matrix.quantize(w, packed=True)
    assert packed.packed and not plain.packed and packed.shape == plain.shape and packed.nbytes == plain.nbytes
    assert torch.equal(quantize_matrix(plain, "int4").q, packed.q)
    assert quantize_matrix(packed, "int4") is packed
    assert torch.equal(packed.dequantize(), plain.dequantize())
    assert torch.equal(packed.dequantize(3, n - 1), plain.dequantize(3, n - 1))
    assert torch.equal(packed.dequantize(n - 2), plain.dequantize(n - 2))
    assert torch.equal(packed.to_dense("cpu", torch.float32), plain.dequantize())
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, cols, generator=g)
    wd = plain.dequantize().double()
    seen = _as_q8(x) if path == "kernels" else x.double()
    magnitude = seen.abs() @ wd.abs().T
    for tokens in (1, 2, 6):
        y = packed.linear(x[:tokens])
        assert y.shape == (tokens, n)
        assert ((y.double() - seen[:tokens] @ wd.T).abs() <= 2e-6 * magnitude[:tokens] + 1e-5).all()
