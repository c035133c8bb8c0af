"""Triton kernels over 4-bit (Q4_0) rows against a float64 computation over the same
dequantized rows. Without CUDA they run under the Triton interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.kernels import q4_format, q4_quantize
from engine.kernels.triton_ffn import available
from engine.kernels.triton_q4 import matvec_q4_triton, q4_activations_triton, sparse_ffn_q4_triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not available(), reason="needs CUDA or TRITON_INTERPRET=1")
FAT = 0.1


def _nonlinearity(v, activation):
    if activation == "fatrelu":
        return torch.where(v >= FAT, v, torch.zeros_like(v))
    r = v.clamp_min(0.0)
    return r * r if activation == "relu2" else r


def _q4(t):
    q = q4_quantize.quantize_rows_q4(t)
    return q.to(DEVICE), q4_format.dequantize_rows_q4(q, t.shape[1]).double()


@pytest.mark.parametrize("n,d", [(70, 96), (33, 100)])
@pytest.mark.parametrize("activation,gated", [(a, g) for a in ("relu", "fatrelu", "drelu", "relu2")
                                               for g in (True, False) if g or a != "drelu"])  # dReLU is gated
@pytest.mark.parametrize("predicted", ["none", "logits", "layer-logits-by-id"])
def test_sparse_ffn_q4_matches_float64(n, d, activation, gated, predicted):
    g = torch.Generator().manual_seed(n * 31 + d)
    gate_q, gate64 = _q4(torch.randn(n, d, generator=g) * d ** -0.5) if gated else (None, None)
    up_q, up64 = _q4(torch.randn(n, d, generator=g) * d ** -0.5)
    down_q, down64 = _q4(torch.randn(n, d, generator=g))
    x = torch.randn(d, generator=g)
    logits = ids = None
    mask = torch.ones(n, dtype=torch.bool)
    if predicted == "logits":
        logits = torch.randn(n, generator=g)
        mask = logits >= 0.2
    elif predicted == "layer-logits-by-id":
        layer = torch.randn(3 * n, generator=g)
        ids = torch.randperm(3 * n, generator=g)[:n]
        logits, mask = layer, layer[ids] >= 0.2
    u = F.linear(x.double(), up64)
    if gated:
        u = torch.relu(u) if activation == "drelu" else u
        a = _nonlinearity(F.linear(x.double(), gate64), activation) * u
    else:
        a = _nonlinearity(u, activation)
    a = a * mask
    ref = a @ down64
    dev = torch.device(DEVICE)
    act = q4_activations_triton(x.to(dev), gate_q, up_q, d, None if logits is None else logits.to(dev), 0.2,
                                activation, FAT, None if ids is None else ids.to(dev))
    torch.testing.assert_close(act.cpu().double(), a, atol=1e-4, rtol=1e-4)
    y = sparse_ffn_q4_triton(x.to(dev), gate_q, up_q, down_q, d, None if logits is None else logits.to(dev), 0.2,
                             activation, FAT, None if ids is None else ids.to(dev))
    assert y.shape == (d,) and y.dtype == torch.float32
    assert (y.cpu().double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


# The Triton one-token product over 4-bit rows: rows `matvec-int4-*` (backend triton) of tests/kernel_cases.py.


def test_rows_of_the_wrong_layout_are_refused():
    q = q4_quantize.quantize_rows_q4(torch.randn(4, 64)).to(DEVICE)
    with pytest.raises(ValueError):
        matvec_q4_triton(torch.randn(96, device=DEVICE), q, 96)
