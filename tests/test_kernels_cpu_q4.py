"""4-bit (Q4_0) rows on the CPU: the format against gguf's own Q4_0 code, the row container,
refusals. The kernels' numerics (numba with int8 or fp32 activations, the torch fallback; by
ids and by logits) are rows of tests/kernel_cases.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.kernels import cpu, cpu_q4, q4_format, q4_quantize, q4_rows


needs_numba = pytest.mark.skipif(not cpu.available(), reason="numba missing or disabled")


def _rows(n, d, gated, seed):
    g = torch.Generator().manual_seed(seed)
    s = d ** -0.5
    gate = torch.randn(n, d, generator=g) * s if gated else None
    return torch.randn(d, generator=g), gate, torch.randn(n, d, generator=g) * s, torch.randn(n, d, generator=g), g


@pytest.mark.parametrize("cols", [32, 64, 4096, 100])
def test_rows_are_ggml_q4_0_blocks(cols):
    """Quantized rows are gguf's Q4_0 bytes (padded to whole blocks), and dequantize as gguf does."""
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(7, cols, generator=g) * 3
    w[0] = 0.0  # an all-zero row: scale 0
    w[1, :5] = torch.tensor([-9.0, 9.0, 1.0, 0.0, -1.0])  # ties of the largest magnitude: the first wins
    q = q4_quantize.quantize_rows_q4(w)
    assert q.dtype == torch.uint8 and q.shape == (7, q4_format.row_bytes(cols))
    width = q4_format.n_blocks(cols) * 32
    wp = np.zeros((7, width), dtype=np.float32)
    wp[:, :cols] = w.numpy()
    theirs = gguf.quants.quantize(wp, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(q.numpy(), theirs)
    deq = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q4_0)[:, :cols]
    assert np.array_equal(q4_format.dequantize_rows_q4(q, cols).numpy(), deq)
    # at most half a step (|max| / 8 / 2) per block away, plus the top clamp (one step at +max)
    err = (q4_format.dequantize_rows_q4(q, cols) - w).abs()
    assert err.max() <= w.abs().max() / 8 + 1e-6


def test_select_and_concat_keep_rows_exactly():
    x, gate, up, down_t, _ = _rows(40, 64, True, 3)
    rows = q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
    assert rows.nbytes == 3 * 40 * q4_format.row_bytes(64)
    assert q4_rows.Q4FfnRows.from_dense(None, up, down_t).nbytes == 2 * 40 * q4_format.row_bytes(64)
    ids = torch.tensor([5, 1, 39])
    sub = rows.select(ids)
    for a, b in zip(sub.dequantized(), rows.dequantized()):
        assert torch.equal(a, b[ids])
    both = q4_rows.Q4FfnRows.concat([rows.select(torch.tensor([0, 1])), rows.select(torch.tensor([2]))])
    assert torch.equal(both.up, rows.up[:3])
    with pytest.raises(IndexError):
        rows.select(torch.tensor([40]))
    with pytest.raises(ValueError):
        q4_rows.Q4FfnRows(None, rows.up, rows.down_t[:, :-1], 64)


@needs_numba
def test_out_of_range_ids_raise():
    x, gate, up, down_t, _ = _rows(8, 32, True, 5)
    rows = q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
    with pytest.raises(IndexError):
        cpu_q4.sparse_ffn(x, rows, torch.tensor([8]), "relu")


def test_matmul_q4_declines_without_int8_activations(monkeypatch):
    """Without the int8 x 4-bit kernel (no AVX2 host or no numba, or turned off as here) the
    many-token product says None and its caller takes another path; with it, its cases are rows
    `matmul-q4_rows-*` of tests/kernel_cases.py (against fp64, and each token against the
    one-token kernel bit for bit)."""
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    assert cpu_q4.matmul_q4(torch.zeros(1, 32), torch.zeros(3, q4_format.row_bytes(32), dtype=torch.uint8), 32) is None


@needs_numba
@pytest.mark.parametrize("predicted", [False, True])
def test_each_token_in_one_call_gives_each_tokens_own_bits(predicted, monkeypatch):
    """`sparse_ffn_each` (a mixture's prompt, one expert's tokens in one kernel call) computes
    each token exactly as its own `sparse_ffn` / `sparse_ffn_predicted` call; without the
    int8-activation kernels it says None and the caller goes token by token."""
    g = torch.Generator().manual_seed(3)
    d, n, tokens = 96, 40, 5  # d not a multiple of 32: the padded input
    w = torch.randn(3, n, d, generator=g)
    rows = q4_rows.Q4FfnRows.from_dense(w[0], w[1], w[2])
    xs = torch.randn(tokens, d, generator=g)
    layer_logits = torch.randn(tokens, 3 * n, generator=g)  # the expert's neurons are some of these
    row_ids = torch.randperm(3 * n, generator=g)[:n]
    if predicted:
        got = cpu_q4.sparse_ffn_each(xs, rows, "drelu", layer_logits, 0.3, row_ids)
        want = [cpu_q4.sparse_ffn_predicted(xs[t], rows, layer_logits[t], 0.3, "drelu", row_ids=row_ids)
                for t in range(tokens)]
    else:
        got = cpu_q4.sparse_ffn_each(xs, rows, "relu")
        want = [cpu_q4.sparse_ffn(xs[t], rows, None, "relu") for t in range(tokens)]
    assert got is not None and got.shape == (tokens, d)
    assert all(torch.equal(got[t], want[t]) for t in range(tokens))
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    assert cpu_q4.sparse_ffn_each(xs, rows, "relu") is None
