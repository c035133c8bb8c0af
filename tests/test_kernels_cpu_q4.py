"""4-bit (Q4_0) rows on the CPU: the format against gguf's own Q4_0 code, the kernels
(numba and torch fallback) against a float64 FFN over the dequantized rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu, cpu_q4, q4_format, q4_quantize, q4_rows


ACTS = ("relu", "fatrelu", "drelu", "relu2")
# (n_neurons, dim): whole blocks, a padded last block, one block, long rows
SHAPES = [(64, 256), (300, 200), (33, 32), (517, 1000)]
FAT = 0.1
needs_numba = pytest.mark.skipif(not cpu.available(), reason="numba missing or disabled")


def _rows(n, d, gated, seed):
    g = torch.Generator().manual_seed(seed)
    s = d ** -0.5
    gate = torch.randn(n, d, generator=g) * s if gated else None
    return torch.randn(d, generator=g), gate, torch.randn(n, d, generator=g) * s, torch.randn(n, d, generator=g), g


def _nonlinearity(v, activation, thr):
    if activation == "fatrelu":
        return torch.where(v >= thr, v, torch.zeros_like(v))
    r = v.clamp_min(0.0)
    return r * r if activation == "relu2" else r


def _ffn64(x, gate, up, down_t, active, activation):
    """The plain FFN in float64 with neurons outside `active` zeroed."""
    x64 = x.double()
    u = F.linear(x64, up.double())
    if gate is None:
        a = _nonlinearity(u, activation, FAT)
    else:
        u = torch.relu(u) if activation == "drelu" else u
        a = _nonlinearity(F.linear(x64, gate.double()), activation, FAT) * u
    mask = torch.zeros_like(a)
    mask[active if active is not None else slice(None)] = 1.0
    return (a * mask) @ down_t.double(), a * mask


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


def _as_q8(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 x 4-bit kernels compute with it, written here independently: llama.cpp's
    Q8_0 blocks of 32 (fp32 scale max|x| / 127, values rint(x / scale)), dequantized in fp64."""
    d = x.shape[-1]
    width = -(-d // 32) * 32
    xp = np.zeros(width, dtype=np.float32)
    xp[:d] = x.numpy()
    blocks = xp.reshape(-1, 32)
    s = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127.0)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    return torch.from_numpy((q.astype(np.float64) * s.astype(np.float64)).reshape(-1)[:d])


def _check_paths(monkeypatch, fn):
    """fn(seen) on every kernel path; seen(x) is the activation as that path computes with it."""
    if cpu_q4.int8_activations(cpu_q4._kernels()):
        fn(_as_q8)  # numba, int8 x 4-bit (AVX2 hosts)
    monkeypatch.setattr(cpu_q4, "USE_INT8_ACTIVATIONS", False)
    fn(torch.Tensor.double)  # numba with fp32 activations, when available
    monkeypatch.setattr(cpu_q4, "_kernels", lambda: None)
    fn(torch.Tensor.double)  # the torch fallback


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("gated", [True, False])
def test_sparse_ffn_q4_matches_float64(monkeypatch, n, d, gated):
    x, gate, up, down_t, g = _rows(n, d, gated, n * 7 + d)
    rows = q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
    assert rows.nbytes == (3 if gated else 2) * n * q4_format.row_bytes(d)
    dg, du, dd = rows.dequantized()
    perm = torch.randperm(n, generator=g)
    sets = {"all": None, "empty": torch.empty(0, dtype=torch.long), "one": torch.tensor([n - 1]),
            "10%": perm[: max(1, n // 10)].sort().values, "50%-unsorted-int32": perm[: n // 2].to(torch.int32)}
    scale = float(dd.abs().max()) * d ** 0.5

    def run(seen):
        for activation in ACTS:
            if activation == "drelu" and not gated:
                continue
            for name, active in sets.items():
                ref, a_ref = _ffn64(seen(x), dg, du, dd, None if active is None else active.long(), activation)
                k = n if active is None else active.numel()
                acts = torch.empty(k)
                y = cpu_q4.sparse_ffn(x, rows, active, activation, FAT, out_acts=acts)
                assert y.shape == (d,) and y.dtype == torch.float32
                assert (y.double() - ref).abs().max() <= 1e-4 * scale, (activation, name)
                want = a_ref if active is None else a_ref[active.long()]
                torch.testing.assert_close(acts.double(), want, atol=1e-4, rtol=1e-4)

    _check_paths(monkeypatch, run)


@pytest.mark.parametrize("n,d", SHAPES[:3])
def test_predicted_selection_matches_the_id_path(monkeypatch, n, d):
    """Selection by logits (of this subset, or of the layer through row_ids) == the same ids."""
    x, gate, up, down_t, g = _rows(n, d, True, 11 + n)
    rows = q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
    layer_logits = torch.randn(3 * n, generator=g)
    row_ids = torch.randperm(3 * n, generator=g)[:n]

    def run(_seen):
        logits = layer_logits[row_ids]
        active = torch.nonzero(logits >= 0.3).squeeze(1)
        want = cpu_q4.sparse_ffn(x, rows, active, "relu")
        acts = torch.empty(n)
        got = cpu_q4.sparse_ffn_predicted(x, rows, layer_logits, 0.3, "relu", out_acts=acts, row_ids=row_ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.all(acts[logits < 0.3] == 0)
        got2 = cpu_q4.sparse_ffn_predicted(x, rows, logits, 0.3, "relu")
        torch.testing.assert_close(got2, want, atol=1e-5, rtol=1e-5)

    _check_paths(monkeypatch, run)


# The one-token product over 4-bit rows on every path: rows `matvec-int4-*` of tests/kernel_cases.py.


def test_select_and_concat_keep_rows_exactly():
    x, gate, up, down_t, _ = _rows(40, 64, True, 3)
    rows = q4_rows.Q4FfnRows.from_dense(gate, up, down_t)
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


@pytest.mark.parametrize("n,d,tokens", [(1, 32, 1), (7, 96, 3), (301, 1000, 17), (1030, 256, 40)])
def test_matmul_q4_many_tokens_matches_float64(n, d, tokens):
    """The many-token int8 x 4-bit product: each token as the one-token kernel computes it."""
    if not cpu_q4.int8_activations(cpu_q4._kernels()):
        assert cpu_q4.matmul_q4(torch.zeros(1, d), torch.zeros(n, q4_format.row_bytes(d), dtype=torch.uint8), d) is None
        pytest.skip("no AVX2 host or numba: the int8 x 4-bit kernel does not run")
    g = torch.Generator().manual_seed(n * 3 + tokens)
    w = torch.randn(n, d, generator=g)
    x = torch.randn(tokens, d, generator=g)
    q = q4_quantize.quantize_rows_q4(w)
    wd = q4_format.dequantize_rows_q4(q, d).double()
    y = cpu_q4.matmul_q4(x, q, d)
    assert y.shape == (tokens, n)
    for t in range(tokens):
        assert torch.equal(y[t], cpu_q4.matvec_q4(x[t], q, d))
        ref = wd @ _as_q8(x[t])
        assert (y[t].double() - ref).abs().max() <= 1e-5 * float(w.abs().max()) * d ** 0.5
