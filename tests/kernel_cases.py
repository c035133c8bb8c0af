"""The kernel case table (llama.cpp test-backend-ops style): one list of cases with an op axis,
one fp64 reference per op, one error measure, for every backend present.

`tests/test_kernel_cases.py` checks every case on every backend; `python -m bench.kernel_cases
--json` times the same table (median ms per case and backend; a sparse FFN case next to the
dense torch FFN over the same rows, measured in the same run).

Ops:
- `sparse_ffn`: an activation, gated or not, the weight format (fp32, int8 and int4 rows on the
  CPU; fp16, bf16, fp32 and int4 rows for Triton), sizes, the fraction of neurons selected. The
  reference is `_reference` below: the FFN in fp64 over the rows the backend really holds
  (dequantized), written out from docs/ARCHITECTURE.md independently of the engine.
- `matvec`: x times every row of a matrix in a row format (fp32, int8 with a scale a row, Q4_0 on
  the CPU and in Triton), and `combine` (a weighted sum of rows).
- `matmul_q4`: many tokens times a Q4_0 matrix with int8 activations (llama.cpp's Q4_0 x Q8_0),
  in each 4-bit layout (plain rows, tiles, 8 rows interleaved); the reference rounds x to Q8_0
  blocks as written out here, so only the fp32 sums' rounding remains.
- `matmul_int8`: many tokens times int8 rows with int8 activations in blocks of 128.
- `decode_linear_q4_1`: one token times ggml's Q4_1 blocks (weight = d q + m) as the fused decode
  reads them (`engine.kernels.decode_layer.linear`: the Q4_0 rows of d and q with int8
  activations, plus the block offsets m + 8d times the fp32 input's block sums), in each 4-bit
  layout; the reference rounds x to Q8_0 blocks for the first part only.
- `decode_attention`: one query token against the first `length` slots of a KV cache (fp16 or
  fp32, contiguous or strided), grouped query heads.
The error is max |y - ref| over the output, divided by the largest sum of the magnitudes of
what was summed for one output (sum_i |act_i| * |down_t[i]|; sum_j |w_ij x_j|; sum_p p_p |v_p|),
so a bound holds at any scale.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from typing import Callable

import torch
import torch.nn.functional as F

FAT_THRESHOLD = 0.1


@dataclass(frozen=True)
class KernelCase:
    activation: str
    gated: bool
    weights: str      # fp32 | int8 | int4 | fp16 | bf16 (decode_attention: the cache, fp16 | fp32 | fp32-strided)
    n: int            # neurons / rows (decode_attention: query heads)
    d: int            # model dimension / row length (decode_attention: head dimension)
    fraction: float   # share of neurons the predictor selects
    tol: float        # error bound (see the module docstring)
    op: str = "sparse_ffn"
    kv_heads: int = 0  # decode_attention
    length: int = 0    # decode_attention: positions read

    @property
    def id(self) -> str:
        if self.op == "matvec":
            return f"matvec-{self.weights}-{self.n}x{self.d}"
        if self.op == "decode_linear_q4_1":
            return f"decode-q4_1-{self.weights}-{self.n}x{self.d}"
        if self.op in ("matmul_q4", "matmul_int8"):
            return f"matmul-{self.weights}-{self.n}x{self.d}-t{self.length}"
        if self.op == "decode_attention":
            return f"attention-{self.weights}-{self.n}q{self.kv_heads}kv{self.d}-len{self.length}"
        return (f"{self.activation}-{'gated' if self.gated else 'ungated'}-{self.weights}-"
                f"{self.n}x{self.d}-{self.fraction:g}")


# Sizes: dims that are and are not multiples of the kernels' blocks (32 for Q4_0, 256 for the
# numba dot, Triton's tiles), small enough for the Triton interpreter.
_SIZES = [(64, 256), (200, 96), (130, 100)]
_FRACTIONS = [0.05, 0.35, 1.0]
CASES = [
    KernelCase(act, gated, weights, *_SIZES[i % 3], _FRACTIONS[i % 3], 1e-4)
    for i, (act, gated, weights) in enumerate(product(("relu", "fatrelu", "drelu", "relu2", "silu"), (True, False),
                                                      ("fp32", "int8", "int4", "fp16", "bf16")))
    if gated or act != "drelu"  # dReLU is a gated activation
] + [
    # a decode step's dense products: x times rows of fp32, int8 or Q4_0 (one row, rows of any
    # length), and `combine` (sum_i a_i w_i)
    KernelCase("", False, weights, n, d, 1.0, 1e-5, op="matvec") for weights, shapes in (
        ("int8", ((1, 8), (300, 1000), (2500, 257))),
        ("int4", ((1, 32), (7, 96), (1000, 256), (301, 1000), (4099, 64), (65, 96), (200, 130))),
        ("fp32", ((1, 1), (7, 33), (300, 256), (2048, 130))),
        ("combine", ((1, 1), (7, 33), (300, 256), (2048, 130))))
    for n, d in shapes
] + [
    # many tokens (`length`) times a Q4_0 matrix, int8 activations, in each 4-bit layout
    KernelCase("", False, layout, n, cols, 1.0, 2e-6, op="matmul_q4", length=tokens)
    for layout, shapes, token_counts in (
        ("q4_rows", ((1, 32), (7, 96), (13, 100), (64, 4096), (301, 1000), (1030, 256)), (1, 3, 9, 17, 40)),
        ("q4x8", ((1, 32), (5, 64), (8, 32), (13, 100), (37, 300), (64, 4096), (203, 1000), (1030, 256)),
         (1, 2, 3, 4, 5, 9)),
        ("q4_tiles", ((1, 256), (3, 512), (37, 256), (200, 1000), (64, 4096)), (1, 2, 3, 4, 5, 9, 20)))
    for n, cols in shapes for tokens in token_counts
] + [
    # many tokens (`length`) times int8 rows, int8 activations in blocks of 128
    KernelCase("", False, "int8", n, d, 1.0, 1e-5, op="matmul_int8", length=tokens)
    for n, d, tokens in ((4, 128, 1), (5, 128, 3), (7, 256, 1), (64, 384, 2), (130, 512, 9), (257, 1024, 17),
                         (1000, 4096, 1), (33, 4096, 40))
] + [
    # one token times Q4_1 blocks in the fused decode (SmolLM2-135M's qkv, gate_up, down shapes among them)
    KernelCase("", False, layout, n, cols, 1.0, 2e-6, op="decode_linear_q4_1", length=1)
    for layout, shapes in (("q4_rows", ((1, 32), (13, 96), (37, 256), (960, 576))),
                           ("q4_tiles", ((3, 256), (37, 512), (576, 1536))),  # blocks a multiple of 8
                           ("q4x8", ((1, 32), (13, 96), (37, 256), (960, 576), (3072, 576), (576, 1536))))
    for n, cols in shapes
] + [
    # decode attention over the CPU KV cache; positions past `length` hold other data
    KernelCase("", False, cache, heads, head_dim, 1.0, 1e-5, op="decode_attention", kv_heads=kv, length=length)
    for cache in ("fp16", "fp32", "fp32-strided")
    for heads, kv, head_dim, length in ((4, 4, 16, 1), (8, 2, 64, 37), (32, 32, 128, 300), (6, 3, 80, 5),
                                        (16, 1, 32, 129))
]


@dataclass
class Layer:
    x: torch.Tensor             # fp32 [d]
    gate: torch.Tensor | None   # fp32 [n, d]
    up: torch.Tensor
    down_t: torch.Tensor
    selected: torch.Tensor      # bool [n]: the neurons the predictor picked
    logits: torch.Tensor        # fp32 [n]; selected == logits >= threshold
    threshold: float
    act_threshold: float


def build_layer(case: KernelCase, seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    scale = case.d ** -0.5  # unit-variance pre-activations, so FATReLU's threshold bites
    gate = torch.randn(case.n, case.d, generator=g) * scale if case.gated else None
    up = torch.randn(case.n, case.d, generator=g) * scale
    down_t = torch.randn(case.n, case.d, generator=g)
    x = torch.randn(case.d, generator=g)
    logits = torch.randn(case.n, generator=g)
    threshold = float("-inf") if case.fraction >= 1 else torch.quantile(logits, 1 - case.fraction).item()
    act_threshold = FAT_THRESHOLD if case.activation in ("fatrelu", "silu") else 0.0  # silu: CATS's threshold
    return Layer(x, gate, up, down_t, logits >= threshold, logits, threshold, act_threshold)


def _nonlinearity(v: torch.Tensor, activation: str, threshold: float) -> torch.Tensor:
    if activation == "silu":  # x * sigmoid(x); CATS: |value| below the threshold becomes 0
        s = v * torch.sigmoid(v)
        return torch.where(s.abs() < threshold, torch.zeros_like(s), s) if threshold > 0 else s
    if activation == "fatrelu":
        return torch.where(v >= threshold, v, torch.zeros_like(v))
    r = v.clamp_min(0.0)
    return r * r if activation == "relu2" else r


def _reference(x, gate, up, down_t, selected, activation, act_threshold) -> tuple[torch.Tensor, float]:
    """(y fp64 [d], the error scale) over the selected neurons."""
    x64 = x.double()
    u = F.linear(x64, up.double())
    if gate is None:
        a = _nonlinearity(u, activation, act_threshold)
    else:
        u = torch.relu(u) if activation == "drelu" else u
        a = _nonlinearity(F.linear(x64, gate.double()), activation, act_threshold) * u
    a = torch.where(selected.cpu(), a, torch.zeros_like(a))
    down = down_t.double()
    return a @ down, float((a.abs() @ down.abs()).max()) + 1e-12


def relative_error(y: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    return float((y.detach().cpu().double() - ref).abs().max()) / scale


# --------------------------------------------------------------------------------- backends
@contextmanager
def numba_disabled():
    """The CPU kernels' torch fallback (what runs without numba or with THERMOCLINE_NO_NUMBA=1)."""
    from engine.kernels import numba_pool

    saved, numba_pool._numba = numba_pool._numba, False
    try:
        yield
    finally:
        numba_pool._numba = saved


@dataclass
class Prepared:
    run: Callable[[], torch.Tensor]  # y fp32
    rows: tuple                      # sparse_ffn: (gate, up, down_t) as the backend holds them, dequantized
    reference: Callable[[], tuple[torch.Tensor, float]] | None = None  # other ops: (y fp64, the error scale)


def _matvec(case: KernelCase, numba: bool) -> Prepared:
    """x times every row of a matrix: fp32 rows (`cpu.matvec`), int8 rows with a scale each
    (`cpu.matvec_int8`), Q4_0 rows (`cpu_q4.matvec_q4`, with int8 activations where the backend
    has them on: the reference then rounds x to Q8_0 blocks too), or `combine` (sum_i a_i w_i)."""
    from engine.kernels import cpu, cpu_q4, q4_format, q4_quantize

    g = torch.Generator().manual_seed(case.n + case.d)
    w = torch.randn(case.n, case.d, generator=g)
    x = torch.randn(case.d, generator=g)
    if case.weights == "combine":
        a = torch.relu(torch.randn(case.n, generator=g))
        terms = a.double()[:, None] * w.double()
        return Prepared(lambda: cpu.combine(a, w), (), lambda: (terms.sum(0), float(terms.abs().sum(0).max()) + 1e-12))
    if case.weights == "fp32":
        held, run = w.double(), lambda: cpu.matvec(x, w)
    elif case.weights == "int8":
        q, scale = cpu.quantize_rows_int8(w)
        held, run = q.double() * scale.double()[:, None], lambda: cpu.matvec_int8(x, q, scale)
    else:
        q4 = q4_quantize.quantize_rows_q4(w)
        held, run = q4_format.dequantize_rows_q4(q4, case.d).double(), lambda: cpu_q4.matvec_q4(x, q4, case.d)
    q8 = case.weights == "int4" and cpu_q4.int8_activations(cpu_q4._kernels())  # in the backend's context
    xs = _as_q8(x[None])[0] if q8 else x.double()

    def reference():
        terms = held * xs
        return terms.sum(1), float(terms.abs().sum(1).max()) + 1e-12

    return Prepared(run, (), reference)


def _decode_attention(case: KernelCase, numba: bool) -> Prepared:
    from engine.kernels import cpu

    heads, kv, hd, length = case.n, case.kv_heads, case.d, case.length
    g = torch.Generator().manual_seed(length + heads)
    slots = length + 9  # positions past `length` hold other data and must not be read
    q = torch.randn(heads, hd, generator=g)
    k = (torch.randn(kv, slots, hd, generator=g) * 3).half()
    v = torch.randn(kv, slots, hd, generator=g).half()
    k[:, length:] = 1000.0
    scale = hd ** -0.5
    if case.weights == "fp32":
        k, v = k.float(), v.float()
    elif case.weights == "fp32-strided":  # torch's path: a cache the kernel cannot read in place
        k, v = k.float().transpose(0, 1).contiguous().transpose(0, 1), v.float()

    def reference():
        qd = q.double().reshape(kv, heads // kv, hd)
        p = torch.softmax(qd @ k[:, :length].double().transpose(1, 2) * scale, -1)
        vd = v[:, :length].double()
        return (p @ vd).reshape(heads, hd), float((p @ vd.abs()).max()) + 1e-12

    return Prepared(lambda: cpu.decode_attention(q, k, v, length, scale), (), reference)


def _as_q8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [T, d] as the int8-activation kernels compute with it, written here independently: llama.cpp's
    Q8_0 blocks (32 values for the 4-bit kernels, 128 for int8 rows; fp32 scale max|x| / 127,
    values rint(x / scale)), dequantized in fp64."""
    t, d = x.shape
    width = -(-d // block) * block
    xp = torch.zeros(t, width, dtype=torch.float32)
    xp[:, :d] = x
    blocks = xp.reshape(t, -1, block)
    s = blocks.abs().amax(dim=2, keepdim=True) / torch.tensor(127.0)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * s.double()).reshape(t, -1)[:, :d]


def _matmul_q4(case: KernelCase, numba: bool) -> Prepared:
    """Many tokens times a Q4_0 matrix with int8 activations, in one of the CPU's 4-bit layouts:
    plain rows (`cpu_q4.matmul_q4`), tiles of 8 blocks (`q4_tiles`), 8 rows interleaved (`cpu_q4x8`)."""
    from engine.kernels import cpu_q4, cpu_q4x8, q4_format, q4_quantize, q4_tiles

    n, cols, tokens = case.n, case.d, case.length
    g = torch.Generator().manual_seed(n * 31 + cols + tokens)
    w = torch.randn(n, cols, generator=g) * torch.rand(n, 1, generator=g) * 2
    if n > 2 and cols >= 32:  # all-zero blocks (scale 0)
        w[1, :32] = 0
        w[n - 1, -min(cols, 40):] = 0
    q = q4_quantize.quantize_rows_q4(w)
    x = torch.randn(tokens, cols, generator=g) * torch.rand(tokens, 1, generator=g) * 3
    x[0, :min(cols, 32)] = 0  # a zero activation block (scale 0)
    run = {"q4_rows": lambda: cpu_q4.matmul_q4(x, q, cols),
           "q4_tiles": lambda: q4_tiles.matmul_q4_tiles(x, q, cols),
           "q4x8": (lambda p: lambda: cpu_q4x8.matmul_packed(x, p, cols))(cpu_q4x8.pack_rows(q))}[case.weights]

    def reference():
        wd = q4_format.dequantize_rows_q4(q, cols).double()
        xq = _as_q8(x)
        return xq @ wd.T, float((xq.abs() @ wd.abs().T).max()) + 1e-12

    return Prepared(run, (), reference)


def _matmul_int8(case: KernelCase, numba: bool) -> Prepared:
    """Many tokens times int8 rows with int8 activations in blocks of 128 (`cpu.matmul_int8`)."""
    from engine.kernels import cpu

    n, d, tokens = case.n, case.d, case.length
    g = torch.Generator().manual_seed(n * 7 + d + tokens)
    q, scale = cpu.quantize_rows_int8(torch.randn(n, d, generator=g))
    x = torch.randn(tokens, d, generator=g) * torch.linspace(0.1, 10.0, d)  # blocks of unequal range
    x[0, :128] = 0.0  # an all-zero block: scale 0

    def reference():
        w, xq = q.double() * scale.double()[:, None], _as_q8(x, 128)
        return xq @ w.T, float((xq.abs() @ w.abs().T).max()) + 1e-12

    return Prepared(lambda: cpu.matmul_int8(x, q, scale), (), reference)


def _decode_linear_q4_1(case: KernelCase, numba: bool) -> Prepared:
    """One token times Q4_1 blocks in the fused decode's product (`decode_layer.linear`), the
    blocks held as fused_decode hands them over (Q4_0 rows in `case.weights`' layout, offsets)."""
    import numpy as np

    from engine.kernels import cpu_q4_1, cpu_q4x8, numba_pool
    from engine.kernels import decode_layer as dl

    n, cols = case.n, case.d
    g = torch.Generator().manual_seed(n * 13 + cols)
    w = torch.randn(n, cols, generator=g) * torch.rand(n, 1, generator=g) + torch.rand(n, 1, generator=g)
    if n > 2:
        w[1, :32] = 0.5  # a constant block: d 0, the value in m alone
    raw = cpu_q4_1.quantize_blocks(w.numpy())  # ggml's blocks: fp16 d, fp16 m, 16 bytes of nibbles
    q4, offsets = cpu_q4_1.split_blocks(raw)
    x = torch.randn(cols, generator=g) * 2
    if cols > 32:
        x[:32] = 0  # a zero activation block (scale 0)
    kind = {"q4_rows": dl.M_Q4MIN, "q4_tiles": dl.M_Q4MIN_TILES, "q4x8": dl.M_Q4MIN_X8}[case.weights]
    rows = cpu_q4x8.pack_rows(torch.from_numpy(q4)).numpy() if case.weights == "q4x8" else q4
    xs = x.numpy().copy()

    def reference():
        nb = cols // 32
        blocks = raw.reshape(n, nb, 20)
        d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        nib = torch.from_numpy(blocks[:, :, 4:].astype(np.int64))
        q = torch.cat([nib & 15, nib >> 4], dim=2).double()  # low nibbles weights 0..15, high 16..31
        first = (d[:, :, None] * (q - 8)).reshape(n, cols) * _as_q8(x[None])[0]  # d (q - 8) x~
        second = (m + 8 * d) * x.double().reshape(nb, 32).sum(1)  # (m + 8d) * the block sum
        terms = torch.cat([first, second], dim=1)
        return terms.sum(1), float(terms.abs().sum(1).max()) + 1e-12

    def run():
        threads = numba_pool.use_threads(numba_pool.module())  # the pool set up as fused_decode does
        return torch.from_numpy(dl.linear(kind, rows, offsets.reshape(-1), xs, threads))

    return Prepared(run, (), reference)


_OPS = {"matvec": _matvec, "decode_attention": _decode_attention, "matmul_q4": _matmul_q4,
        "matmul_int8": _matmul_int8, "decode_linear_q4_1": _decode_linear_q4_1}


def _cpu(case: KernelCase, layer: Layer) -> Prepared:
    if case.op in _OPS:
        return _OPS[case.op](case, True)
    from engine.kernels import cpu, cpu_q4, q4_rows

    active = torch.nonzero(layer.selected).squeeze(1)
    if case.weights == "int4":
        rows = q4_rows.Q4FfnRows.from_dense(layer.gate, layer.up, layer.down_t)
        return Prepared(lambda: cpu_q4.sparse_ffn(layer.x, rows, active, case.activation, layer.act_threshold),
                        rows.dequantized())
    rows = cpu.CpuFfnRows.from_dense(layer.gate, layer.up, layer.down_t, quant=case.weights)
    return Prepared(lambda: cpu.sparse_ffn(layer.x, rows, active, case.activation, layer.act_threshold),
                    rows.dequantized())


def _cpu_predicted(case: KernelCase, layer: Layer) -> Prepared:
    """The decode path: rows selected inside the kernel from the predictor's logits, the rows
    a subset of the layer (row_ids, here every other neuron's logit slot), as the cold tier calls it."""
    from engine.kernels import cpu, cpu_q4, q4_rows

    row_ids = torch.arange(case.n) * 2
    logits = torch.full((2 * case.n,), layer.threshold - 1.0)
    logits[row_ids] = layer.logits
    if case.weights == "int4":
        rows, kernels = q4_rows.Q4FfnRows.from_dense(layer.gate, layer.up, layer.down_t), cpu_q4
    else:
        rows, kernels = cpu.CpuFfnRows.from_dense(layer.gate, layer.up, layer.down_t, quant=case.weights), cpu
    return Prepared(lambda: kernels.sparse_ffn_predicted(layer.x, rows, logits, layer.threshold, case.activation,
                                                         layer.act_threshold, row_ids=row_ids),
                    rows.dequantized())


def _triton_device() -> torch.device:
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false")
    return torch.device("cpu" if interpret else "cuda")


def _triton(case: KernelCase, layer: Layer) -> Prepared:
    dev = _triton_device()
    if case.op == "matvec":  # Q4_0 rows (the hot tier's 4-bit matrices)
        from engine.kernels import q4_format, q4_quantize
        from engine.kernels.triton_q4 import matvec_q4_triton

        g = torch.Generator().manual_seed(case.n + case.d)
        q = q4_quantize.quantize_rows_q4(torch.randn(case.n, case.d, generator=g))
        x = torch.randn(case.d, generator=g)
        wd = q4_format.dequantize_rows_q4(q, case.d).double()
        qd, xd = q.to(dev), x.to(dev)
        return Prepared(lambda: matvec_q4_triton(xd, qd, case.d), (),
                        lambda: (wd @ x.double(), float((wd.abs() @ x.double().abs()).max()) + 1e-12))
    x, logits = layer.x.to(dev), layer.logits.to(dev)
    if case.weights == "int4":
        from engine.kernels import q4_format, q4_quantize
        from engine.kernels.triton_q4 import sparse_ffn_q4_triton

        q = [None if w is None else q4_quantize.quantize_rows_q4(w) for w in (layer.gate, layer.up, layer.down_t)]
        rows = tuple(None if w is None else q4_format.dequantize_rows_q4(w, case.d) for w in q)
        qd = [None if w is None else w.to(dev) for w in q]
        return Prepared(lambda: sparse_ffn_q4_triton(x, *qd, case.d, logits, layer.threshold, case.activation,
                                                     layer.act_threshold), rows)
    from engine.kernels.triton_ffn import sparse_ffn_triton

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case.weights]
    held = tuple(None if w is None else w.to(dtype) for w in (layer.gate, layer.up, layer.down_t))
    on_dev = [None if w is None else w.to(dev) for w in held]
    return Prepared(lambda: sparse_ffn_triton(x, *on_dev, logits, layer.threshold, case.activation,
                                              layer.act_threshold), held)


def _numba_available() -> bool:
    from engine.kernels import cpu

    return cpu.available()


def _int8_activations_available() -> bool:
    from engine.kernels import cpu_q4, numba_pool

    return _numba_available() and cpu_q4.int8_activations(numba_pool.kernels())


@contextmanager
def fp32_activations():
    """The numba kernels with the activation kept in fp32 (the 4-bit rows' int8-activation
    path, llama.cpp's Q4_0 x Q8_0 scheme, has its own backend and bound)."""
    from engine.kernels import cpu_q4

    saved, cpu_q4.USE_INT8_ACTIVATIONS = cpu_q4.USE_INT8_ACTIVATIONS, False
    try:
        yield
    finally:
        cpu_q4.USE_INT8_ACTIVATIONS = saved


@contextmanager
def dense_kernels_for_every_size():
    """The numba backend: fp32 activations (above), and the dense products (matvec, combine) on
    numba for the table's small shapes too (cpu's size cut-over hands small ones to torch)."""
    from engine.kernels import cpu

    saved, cpu._DENSE_MIN_ELEMENTS = cpu._DENSE_MIN_ELEMENTS, 0
    try:
        with fp32_activations():
            yield
    finally:
        cpu._DENSE_MIN_ELEMENTS = saved


def _triton_available() -> bool:
    try:
        from engine.kernels.triton_ffn import available
    except ImportError:
        return False
    return available()


@dataclass(frozen=True)
class Backend:
    name: str
    weights: tuple[str, ...]
    available: Callable[[], bool]
    prepare: Callable[[KernelCase, Layer], Prepared]
    context: Callable = contextmanager(lambda: (yield))
    ops: dict | None = None  # op -> the weight formats it runs (None: every case of the op); None: sparse_ffn only
    # A bound of its own, for a backend that rounds its input: x in 8-bit blocks of 32 with a
    # scale each (1/254 of a block's largest value) moves the sums by a few parts in a thousand.
    tol: float | None = None

    def bound(self, case: KernelCase) -> float:
        # a case whose reference rounds the input as the backend does (matmul_q4) keeps its own bound
        return self.tol if self.tol is not None and case.op == "sparse_ffn" else case.tol

    def supports(self, case: KernelCase) -> bool:
        if case.op == "sparse_ffn":
            return case.weights in self.weights
        ops = self.ops or {}
        return case.op in ops and (ops[case.op] is None or case.weights in ops[case.op])


BACKENDS = {
    "numba": Backend("numba", ("fp32", "int8", "int4"), _numba_available, _cpu, dense_kernels_for_every_size,
                     ops={"matvec": None, "decode_attention": None}),
    "numba-int8act": Backend("numba-int8act", ("int4",), _int8_activations_available, _cpu, tol=1e-2,
                             ops={"matmul_q4": None, "matmul_int8": None, "matvec": ("int4",),
                                  "decode_linear_q4_1": None}),
    "numba-predicted": Backend("numba-predicted", ("fp32", "int8"), _numba_available, _cpu_predicted),
    "numba-int8act-predicted": Backend("numba-int8act-predicted", ("int4",), _int8_activations_available,
                                       _cpu_predicted, tol=1e-2),
    "torch": Backend("torch", ("fp32", "int8", "int4"), lambda: True, _cpu, numba_disabled,
                     ops={"matvec": None, "decode_attention": None}),
    # The Triton interpreter on CPU tensors (TRITON_INTERPRET=1), or CUDA when there is a GPU.
    "triton": Backend("triton", ("fp32", "fp16", "bf16", "int4"), _triton_available, _triton,
                      ops={"matvec": ("int4",)}),
}


def check(case: KernelCase, backend: Backend, seed: int = 0) -> float:
    """Run one case on one backend; its error (see the module docstring)."""
    layer = build_layer(case, seed) if case.op == "sparse_ffn" else None
    with backend.context():
        prepared = backend.prepare(case, layer)
        y = prepared.run()
    ref, scale = reference_of(case, layer, prepared)
    assert y.dtype == torch.float32 and tuple(y.shape) == tuple(ref.shape)
    return relative_error(y, ref, scale)


def reference_of(case: KernelCase, layer: Layer | None, prepared: Prepared) -> tuple[torch.Tensor, float]:
    """The fp64 result of a prepared case and its error scale."""
    if prepared.reference is not None:
        return prepared.reference()
    return _reference(layer.x, *prepared.rows, layer.selected, case.activation, layer.act_threshold)
