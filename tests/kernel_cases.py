"""The kernel case table (llama.cpp test-backend-ops style): one list of cases with an op axis,
one fp64 reference per op, one error measure, for every backend present.

`tests/test_kernel_cases.py` checks every case on every backend; `python -m bench.kernel_cases
--json` times the same table (median ms per case and backend; a sparse FFN case next to the
dense torch FFN over the same rows, measured in the same run).

Ops:
- `sparse_ffn`: an activation, gated or not, the weight format (fp32, int8 and int4 rows on the
  CPU; fp16, bf16, fp32 and int4 rows for Triton), sizes, the fraction of neurons selected (0:
  none; 1: every row, Triton with no predictor), the ids sorted int64 or (`route`
  "unsorted-int32") in any order. The reference is `ffn_reference` below: the FFN in fp64
  over the rows the backend really holds (dequantized), written out from docs/ARCHITECTURE.md
  independently of the engine. Where a backend hands out the activations too, they are checked.
- `sparse_ffn_predicted`: the same, the rows selected inside the kernel from the predictor's
  logits (`route` "logits": these rows' logits; "row-ids": the layer's logits, these rows a
  subset addressed by row ids, as the cold and hot tiers call it).
- `sparse_ffn_batch`: `length` tokens over one (union) selection of rows.
- `sparse_ffn_tokens`: `length` tokens (a prefill), each over the rows its own logits select
  (fraction 1: no predictor), by `route` "union" (one pass over the union of the tokens' rows)
  or "per_token" (the decode kernel per token); token 0 selects nothing.
- `matvec`: x times every row of a matrix in a row format (fp32, int8 with a scale a row, Q4_0 on
  the CPU and in Triton), and `combine` (a weighted sum of rows).
- `matmul_q4`: many tokens times a Q4_0 matrix with int8 activations (llama.cpp's Q4_0 x Q8_0),
  in each 4-bit layout (plain rows, tiles, 8 rows interleaved); the reference rounds x to Q8_0
  blocks as written out here, so only the fp32 sums' rounding remains. `route` "matvec": each
  token's row equals the one-token kernel's bit for bit (bound 0).
- `matmul_int8`: many tokens times int8 rows with int8 activations in blocks of 128.
- `decode_linear_q4_1`: one token times ggml's Q4_1 blocks (weight = d q + m) as the fused decode
  reads them (`engine.kernels.decode_layer.linear`: the Q4_0 rows of d and q with int8
  activations, plus the block offsets m + 8d times the fp32 input's block sums), in each 4-bit
  layout; the reference rounds x to Q8_0 blocks for the first part only.
- `decode_attention`: one query token against the first `length` slots of a KV cache (fp16 or
  fp32, contiguous or strided), grouped query heads.
- `down_proj`: Triton's down projection alone (80% of the activations 0, `length` row splits,
  0: from the machine), which must also give the same bits on a second run (fixed-order sum).
- `predictor`: fc2 @ relu(fc1 @ x) (`length` the rank).
- `moe_ffn`: a mixture's FFN for one token (`decode_layer.moe_ffn`, the fused MoE decode's):
  the router's top-k (`length`) of `kv_heads` experts, softmax or sigmoid weights, each chosen
  expert's ReGLU or dReLU rows in a CPU format with some experts split (a third of their
  neurons as fp32 hot rows), with per-expert predictors (`fraction` < 1) or without; the
  reference routes, selects and sums in fp64 over the rows as held; a second run gives the same bits.
Backends include Triton under each launch configuration the tests exercise (small tiles packed
and masked, tiny tiles: the loops' bookkeeping), besides its defaults.

The error is max |y - ref| over the output, divided by the largest sum of the magnitudes of
what was summed for one output (sum_i |act_i| * |down_t[i]|; sum_j |w_ij x_j|; sum_p p_p |v_p|;
for an activation, the activation of the terms' magnitudes), so a bound holds at any scale.
Why not llama.cpp's nmse (sum (y - ref)^2 / sum ref^2): it averages over the output, so one
wrong element among thousands (a dropped neuron's share, one bad tile) hides in it, and it has
no scale where the reference is 0 (no neuron selected, a token that selects nothing); fp32
summation's error is bounded by gamma_n * sum |terms| (Higham 3.1), which is what this divides by.
Rows whose reference is another kernel run (same rows, same order) have bound 0: bit for bit.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
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
    length: int = 0    # decode_attention: positions read; batch, tokens, matmul: tokens; down_proj: splits; predictor: rank
    route: str = ""    # how the op is called (see the module docstring); "" its plain call

    @property
    def id(self) -> str:
        route = f"-{self.route}" if self.route else ""
        if self.op == "matvec":
            return f"matvec-{self.weights}-{self.n}x{self.d}"
        if self.op == "decode_linear_q4_1":
            return f"decode-q4_1-{self.weights}-{self.n}x{self.d}"
        if self.op in ("matmul_q4", "matmul_int8"):
            return f"matmul-{self.weights}-{self.n}x{self.d}-t{self.length}{route}"
        if self.op == "decode_attention":
            return f"attention-{self.weights}-{self.n}q{self.kv_heads}kv{self.d}-len{self.length}"
        if self.op == "down_proj":
            return f"down-{self.weights}-{self.n}x{self.d}-splits{self.length or 'auto'}"
        if self.op == "predictor":
            return f"predictor-{self.weights}-{self.d}r{self.length}n{self.n}"
        if self.op == "moe_ffn":
            return f"moe-{self.activation}-{self.weights}-{self.kv_heads}x{self.n}x{self.d}-k{self.length}-{self.fraction:g}"
        op = {"sparse_ffn": "", "sparse_ffn_predicted": "predicted-", "sparse_ffn_batch": f"batch{self.length}-",
              "sparse_ffn_tokens": f"tokens{self.length}-"}[self.op]
        return (f"{op}{self.activation}-{'gated' if self.gated else 'ungated'}-{self.weights}-"
                f"{self.n}x{self.d}-{self.fraction:g}{route}")


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
    # no neuron selected, and ids in any order as int32
    KernelCase(act, True, weights, n, d, fraction, 1e-4, route=route)
    for act, weights, (n, d), fraction, route in (
        ("relu", "fp32", (200, 96), 0.0, ""), ("fatrelu", "int8", (130, 100), 0.0, ""),
        ("drelu", "int4", (64, 256), 0.0, ""), ("relu", "fp32", (300, 200), 0.2, "unsorted-int32"),
        ("fatrelu", "int8", (130, 100), 0.5, "unsorted-int32"), ("relu2", "int4", (33, 32), 0.5, "unsorted-int32"))
] + [
    # the rows selected inside the kernel from the predictor's logits
    KernelCase(act, act != "relu2", weights, *_SIZES[i % 3], (0.3, 1.0, 0.0, 0.05)[i % 4], 1e-4,
               op="sparse_ffn_predicted", route=route)
    for i, (act, weights, route) in enumerate(product(("relu", "fatrelu", "drelu", "relu2"),
                                                      ("fp32", "int8", "int4", "fp16", "bf16"), ("logits", "row-ids")))
] + [
    # a few tokens over one (union) selection
    KernelCase(act, gated, weights, *_SIZES[(i // 3) % 3], (1.0, 0.3, 0.0)[(i + i // 3) % 3], 1e-4,
               op="sparse_ffn_batch", length=tokens)
    for i, ((act, gated), weights, tokens) in enumerate(product(
        (("relu", True), ("drelu", True), ("fatrelu", True), ("relu2", False)), ("fp32", "int8"), (1, 3, 8)))
] + [
    # a prefill: each token over its own predicted rows
    KernelCase(act, gated, weights, n, d, (0.2, 1.0)[i % 2], 1e-4, op="sparse_ffn_tokens", length=tokens,
               route=route)
    for i, ((act, gated), weights, route) in enumerate(product(
        [(a, g) for a in ("relu", "fatrelu", "drelu", "relu2") for g in (True, False) if g or a != "drelu"],
        ("fp32", "int8"), ("union", "per_token")))
    # one token; d not a multiple of 128 (fp32 activations); int8 x int8 over 128-blocks, T below and past 16
    for n, d, tokens in [((64, 256, 1), (300, 200, 5), (130, 384, 9), (200, 512, 33))[i % 4]]
] + [
    # a decode step's dense products: x times rows of fp32, int8 or Q4_0 (one row, rows of any
    # length: fp32 and int8 rows longer than cpu_numba.SHORT_ROW_COLS go four at a time), and
    # `combine` (sum_i a_i w_i)
    KernelCase("", False, weights, n, d, 1.0, 1e-5, op="matvec") for weights, shapes in (
        ("int8", ((1, 8), (300, 1000), (2500, 257), (45, 2700))),
        ("int4", ((1, 32), (7, 96), (1000, 256), (301, 1000), (4099, 64), (65, 96), (200, 130))),
        ("fp32", ((1, 1), (7, 33), (300, 256), (2048, 130), (37, 2600))),
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
    # many tokens times Q4_0 rows: each token's row as the one-token kernel computes it, bit for bit
    KernelCase("", False, "q4_rows", n, cols, 1.0, 0.0, op="matmul_q4", length=tokens, route="matvec")
    for n, cols, tokens in ((1, 32, 1), (7, 96, 3), (301, 1000, 17), (1030, 256, 40))
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
] + [
    # Triton's down projection alone, over row splits (0: as many as the machine asks for)
    KernelCase("", False, "fp16", 200, 130, 0.2, 2e-5, op="down_proj", length=splits) for splits in (1, 2, 3, 0, 100)
] + [
    # the predictor, fc2 @ relu(fc1 @ x)
    KernelCase("", False, weights, n, d, 1.0, 2e-5, op="predictor", length=rank)
    for (d, rank, n), weights in product(((64, 16, 128), (130, 48, 200)), ("fp16", "bf16"))
] + [
    # a mixture's FFN (n neurons an expert, d, kv_heads experts, top-`length`); fraction 0.5: predictors
    KernelCase(act, True, weights, n, d, fraction, 1e-5, op="moe_ffn", kv_heads=experts, length=k)
    for weights in ("fp32", "int8", "int4")
    for act, n, d, experts, k, fraction in (("relu", 64, 256, 8, 2, 1.0), ("drelu", 48, 96, 4, 2, 0.5),
                                            ("relu", 100, 130, 6, 3, 1.0), ("drelu", 96, 256, 8, 4, 0.5))
]


FFN_OPS = ("sparse_ffn", "sparse_ffn_predicted", "sparse_ffn_batch", "sparse_ffn_tokens")


@dataclass
class Layer:
    x: torch.Tensor             # fp32 [d] ([T, d] for the many-token ops)
    gate: torch.Tensor | None   # fp32 [n, d]
    up: torch.Tensor
    down_t: torch.Tensor
    selected: torch.Tensor      # bool [n] ([T, n] for sparse_ffn_tokens): the neurons the predictor picked
    logits: torch.Tensor        # fp32 [n] ([T, n]); selected == logits >= threshold
    threshold: float
    act_threshold: float


def build_layer(case: KernelCase, seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    scale = case.d ** -0.5  # unit-variance pre-activations, so FATReLU's threshold bites
    gate = torch.randn(case.n, case.d, generator=g) * scale if case.gated else None
    up = torch.randn(case.n, case.d, generator=g) * scale
    down_t = torch.randn(case.n, case.d, generator=g)
    many = case.op in ("sparse_ffn_batch", "sparse_ffn_tokens")
    x = torch.randn(*((case.length,) if many else ()), case.d, generator=g)
    per_token = case.op == "sparse_ffn_tokens"
    logits = torch.randn(*((case.length,) if per_token else ()), case.n, generator=g)
    if case.fraction >= 1:
        threshold = float("-inf")
    elif case.fraction <= 0:
        threshold = float("inf")
    else:
        threshold = torch.quantile(logits.flatten(), 1 - case.fraction).item()
    if per_token and case.fraction < 1:
        logits[0] = threshold - 1.0  # a token that selects nothing
    act_threshold = FAT_THRESHOLD if case.activation in ("fatrelu", "silu") else 0.0  # silu: CATS's threshold
    return Layer(x, gate, up, down_t, logits >= threshold, logits, threshold, act_threshold)


def layer_of(case: KernelCase, seed: int = 0) -> Layer | None:
    """The random FFN layer of a case of the FFN ops (None for the other ops, which draw their own)."""
    return build_layer(case, seed) if case.op in FFN_OPS else None


def _nonlinearity(v: torch.Tensor, activation: str, threshold: float) -> torch.Tensor:
    if activation == "silu":  # x * sigmoid(x); CATS: |value| below the threshold becomes 0
        s = v * torch.sigmoid(v)
        return torch.where(s.abs() < threshold, torch.zeros_like(s), s) if threshold > 0 else s
    if activation == "fatrelu":
        return torch.where(v >= threshold, v, torch.zeros_like(v))
    r = v.clamp_min(0.0)
    return r * r if activation == "relu2" else r


@dataclass
class Reference:
    """An op's fp64 result and its error scale; for the FFN ops also the activations (of every
    neuron, 0 where not selected) and theirs."""
    y: torch.Tensor
    scale: float
    acts: torch.Tensor | None = None
    acts_scale: float = 0.0


def ffn_reference(x, gate, up, down_t, selected, activation, act_threshold) -> Reference:
    """The FFN in fp64 over the selected neurons (x [d] or [T, d]; selected bool [n] or [T, n],
    None: all). The activations' scale is the activation of the terms' magnitudes (|x| . |w|)."""
    x64 = x.double()
    u = F.linear(x64, up.double())
    mag_u = F.linear(x64.abs(), up.double().abs())
    if gate is None:
        a = _nonlinearity(u, activation, act_threshold)
        mag = mag_u * mag_u if activation == "relu2" else mag_u
    else:
        u = torch.relu(u) if activation == "drelu" else u
        a = _nonlinearity(F.linear(x64, gate.double()), activation, act_threshold) * u
        mag_g = F.linear(x64.abs(), gate.double().abs())
        mag = (mag_g * mag_g if activation == "relu2" else mag_g) * mag_u
    if selected is not None:
        a = torch.where(selected.cpu(), a, torch.zeros_like(a))
    down = down_t.double()
    return Reference(a @ down, float((a.abs() @ down.abs()).max()) + 1e-12 if a.numel() else 1.0, a,
                     float(mag.max()) + 1e-12 if mag.numel() else 1.0)


def relative_error(y: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    if not ref.numel():
        return 0.0
    err = float((y.detach().cpu().double() - ref).abs().max()) / scale
    return err if err == err else float("inf")  # NaN: a value the kernel never wrote, or read from nowhere


# --------------------------------------------------------------------------------- backends
@contextmanager
def patched(module, name: str, value):
    """module.name set to value for the block (a backend's or a route's switch)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextmanager
def numba_disabled():
    """The CPU kernels' torch fallback (what runs without numba or with THERMOCLINE_NO_NUMBA=1)."""
    from engine.kernels import numba_pool

    with patched(numba_pool, "_numba", False):
        yield


@dataclass
class Prepared:
    run: Callable[[], torch.Tensor]  # y fp32
    rows: tuple                      # FFN ops: (gate, up, down_t) as the backend holds them, dequantized
    reference: Callable[[], tuple[torch.Tensor, float]] | None = None  # other ops: (y fp64, the error scale)
    acts: torch.Tensor | None = None     # FFN ops: the activations the kernel handed out (filled by run)
    acts_of: torch.Tensor | None = None  # the neurons `acts` holds, in order; None: every neuron
    x_ref: torch.Tensor | None = None    # the input as the kernel computes with it (rounded), if not layer.x
    repeat: bool = False                 # a fixed-order sum: a second run must give the same bits


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
    xs = as_q8(x[None])[0] if q8 else x.double()

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


def as_q8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
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
        xq = as_q8(x)
        scale = float((xq.abs() @ wd.abs().T).max()) + 1e-12
        if case.route == "matvec":  # the one-token kernel, token by token: the same bits
            return torch.stack([cpu_q4.matvec_q4(x[t], q, cols) for t in range(tokens)]).double(), scale
        return xq @ wd.T, scale

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
        w, xq = q.double() * scale.double()[:, None], as_q8(x, 128)
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
        first = (d[:, :, None] * (q - 8)).reshape(n, cols) * as_q8(x[None])[0]  # d (q - 8) x~
        second = (m + 8 * d) * x.double().reshape(nb, 32).sum(1)  # (m + 8d) * the block sum
        terms = torch.cat([first, second], dim=1)
        return terms.sum(1), float(terms.abs().sum(1).max()) + 1e-12

    def run():
        threads = numba_pool.use_threads(numba_pool.module())  # the pool set up as fused_decode does
        return torch.from_numpy(dl.linear(kind, rows, offsets.reshape(-1), xs, threads))

    return Prepared(run, (), reference)


def _moe_ffn(case: KernelCase, numba: bool) -> Prepared:
    """A mixture's FFN for one token through the fused decode's kernel (`decode_layer.moe_ffn`),
    its tiers built by the engine's own classes: odd experts split, every third neuron hot (fp32)."""
    import numpy as np

    from engine.hotcold.moe_tiers import ColdExperts, HotExperts, TieredMoe, split_expert
    from engine.kernels import numba_pool
    from engine.model.moe import ExpertPredictors
    from engine.runtime import fused_decode

    experts, n, d, k = case.kv_heads, case.n, case.d, case.length
    softmax, predicted = case.activation == "drelu", case.fraction < 1  # Mixtral's softmax; SmallThinker's sigmoid
    g = torch.Generator().manual_seed(experts * 100 + n + d)
    gate, up = (torch.randn(experts, n, d, generator=g) * d ** -0.5 for _ in range(2))
    down_t = torch.randn(experts, n, d, generator=g)
    router = torch.randn(experts, d, generator=g) * d ** -0.5 * 3
    route_x, hm = torch.randn(d, generator=g), torch.randn(d, generator=g)
    rank = 16
    fc1 = [torch.randn(rank, d, generator=g) * d ** -0.5 for _ in range(experts)]
    fc2 = [torch.randn(n, rank, generator=g) * rank ** -0.5 for _ in range(experts)]
    hot, cold = HotExperts(torch.device("cpu"), torch.float32), ColdExperts(case.weights)
    for e in range(experts):
        split_expert(e, np.arange(0, n, 3) if e % 2 else np.empty(0, dtype=np.int64), gate[e], up[e], down_t[e],
                     hot, cold)

    class _Runtime:  # what TieredMoe reads of its runtime here: the mode
        mode, scoring_mode = "sparse", None

    ffn = TieredMoe(0, experts, n, hot, cold, _Runtime(), case.activation,
                    ExpertPredictors(fc1, fc2) if predicted else None)
    dl = fused_decode.module()
    args, out = fused_decode.moe_ffn_args(dl, ffn, router, k, softmax)

    def run():
        with numba_pool.lock:
            y = dl.moe_ffn(route_x.numpy(), hm.numpy(), numba_pool.use_threads(numba_pool.module()), *args,
                           out.chosen, out.weights, out.stats)
        return torch.from_numpy(y)

    def reference():
        logits = router.double() @ route_x.double()
        top, chosen = torch.topk(logits, k)
        w = torch.softmax(top, 0) if softmax else torch.sigmoid(top) / torch.sigmoid(top).sum()
        q8 = case.weights == "int4"  # the 4-bit rows' kernel rounds its input to Q8_0 blocks
        y = torch.zeros(d, dtype=torch.float64)
        scale = torch.zeros(d, dtype=torch.float64)
        for e, we in zip(chosen.tolist(), w.tolist()):
            for tier, on_hot in ((cold, False), (hot, True)):
                if e not in tier:
                    continue
                ids = tier.neuron_ids[e]
                g_, u_, dn = (t.double() for t in (hot.cpu_rows[e] if on_hot else cold.rows[e]).dequantized())
                xs = hm.double() if on_hot or not q8 else as_q8(hm[None])[0]
                u = F.linear(xs, u_)
                if case.activation == "drelu":
                    u = torch.relu(u)
                a = torch.relu(F.linear(xs, g_)) * u
                if predicted:
                    sel = (fc2[e].double() @ torch.relu(fc1[e].double() @ hm.double()))[ids] >= 0.0
                    a = torch.where(sel, a, torch.zeros_like(a))
                y += we * (a @ dn)
                scale += we * (a.abs() @ dn.abs())
        assert out.chosen.tolist() == chosen.tolist()  # the same experts, best first
        return y, float(scale.max()) + 1e-12

    return Prepared(run, (), reference, repeat=True)


_OPS = {"matvec": _matvec, "decode_attention": _decode_attention, "matmul_q4": _matmul_q4,
        "matmul_int8": _matmul_int8, "decode_linear_q4_1": _decode_linear_q4_1, "moe_ffn": _moe_ffn}


def _cpu(case: KernelCase, layer: Layer) -> Prepared:
    if case.op in _OPS:
        return _OPS[case.op](case, True)
    return _CPU_FFN[case.op](case, layer)


def _cpu_rows(case: KernelCase, layer: Layer):
    """(the layer's rows in the case's CPU format, the kernel module that computes them)."""
    from engine.kernels import cpu, cpu_q4, q4_rows

    if case.weights == "int4":
        return q4_rows.Q4FfnRows.from_dense(layer.gate, layer.up, layer.down_t), cpu_q4
    return cpu.CpuFfnRows.from_dense(layer.gate, layer.up, layer.down_t, quant=case.weights), cpu


def _x_as_computed(case: KernelCase, layer: Layer) -> torch.Tensor | None:
    """x rounded to Q8_0 blocks of 32 where 4-bit rows take int8 activations (the gate and up
    products, llama.cpp's Q4_0 x Q8_0; the down rows are summed in fp32); None: x as it is."""
    from engine.kernels import cpu_q4

    q8 = case.weights == "int4" and cpu_q4.int8_activations(cpu_q4._kernels())  # in the backend's context
    return as_q8(layer.x[None])[0] if q8 else None


def _cpu_sparse(case: KernelCase, layer: Layer) -> Prepared:
    """`sparse_ffn` over the selected ids (sorted int64, or in any order as int32)."""
    rows, kernels = _cpu_rows(case, layer)
    active = torch.nonzero(layer.selected).squeeze(1)
    if case.route == "unsorted-int32":
        active = active[torch.randperm(active.numel(), generator=torch.Generator().manual_seed(1))].to(torch.int32)
    acts = torch.full((active.numel(),), float("nan"))
    return Prepared(lambda: kernels.sparse_ffn(layer.x, rows, active, case.activation, layer.act_threshold,
                                               out_acts=acts),
                    rows.dequantized(), acts=acts, acts_of=active.long(), x_ref=_x_as_computed(case, layer))


def _layer_logits(case: KernelCase, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(a layer's logits over 3n neurons, row ids [n] into them in no order): row j's logit is
    the case's logits[j], the other neurons' logits are anything."""
    g = torch.Generator().manual_seed(case.n)
    logits = torch.randn(3 * case.n, generator=g)
    row_ids = torch.randperm(3 * case.n, generator=g)[:case.n]
    logits[row_ids] = layer.logits
    return logits, row_ids


def _cpu_predicted(case: KernelCase, layer: Layer) -> Prepared:
    """The decode path: rows selected inside the kernel from the predictor's logits (these rows'
    own, or the layer's through row ids, as the cold tier calls it)."""
    rows, kernels = _cpu_rows(case, layer)
    acts = torch.full((case.n,), float("nan"))
    logits, row_ids = _layer_logits(case, layer) if case.route == "row-ids" else (layer.logits, None)
    return Prepared(lambda: kernels.sparse_ffn_predicted(layer.x, rows, logits, layer.threshold, case.activation,
                                                         layer.act_threshold, out_acts=acts, row_ids=row_ids),
                    rows.dequantized(), acts=acts, x_ref=_x_as_computed(case, layer))


def _cpu_batch(case: KernelCase, layer: Layer) -> Prepared:
    """`sparse_ffn_batch`: every token over the same rows (all of them at fraction 1)."""
    from engine.kernels import cpu

    rows, _ = _cpu_rows(case, layer)
    active = None if case.fraction >= 1 else torch.nonzero(layer.selected).squeeze(1)
    acts = torch.full((case.length, case.n if active is None else active.numel()), float("nan"))
    return Prepared(lambda: cpu.sparse_ffn_batch(layer.x, rows, active, case.activation, layer.act_threshold,
                                                 out_acts=acts),
                    rows.dequantized(), acts=acts, acts_of=active)


def _cpu_tokens(case: KernelCase, layer: Layer) -> Prepared:
    """`sparse_ffn_tokens` by the case's route (the dispatch's cost of a union row set to 0 or
    to infinity); int8 rows on an AVX2 host over one pass quantize the tokens in blocks of 128,
    and the reference rounds them the same way."""
    from engine.kernels import cpu

    rows, _ = _cpu_rows(case, layer)
    pred = None if case.fraction >= 1 else layer.logits
    cost = 0.0 if case.route == "union" else 1e9

    def route():
        return patched(cpu, "_UNION_ROW_COST", cost)

    with route():
        per_token = cpu.decode_each_token(case.length, case.n, pred, layer.threshold)
    assert per_token == (case.length <= cpu._TOKENS_AS_DECODE or (case.route == "per_token" and pred is not None))
    q8 = case.weights == "int8" and not per_token and cpu.int8_activations_available(case.d)

    def run():
        with route():
            return cpu.sparse_ffn_tokens(layer.x, rows, pred, layer.threshold, case.activation, layer.act_threshold)

    return Prepared(run, rows.dequantized(), x_ref=as_q8(layer.x, 128) if q8 else None)


_CPU_FFN = {"sparse_ffn": _cpu_sparse, "sparse_ffn_predicted": _cpu_predicted, "sparse_ffn_batch": _cpu_batch,
            "sparse_ffn_tokens": _cpu_tokens}


def _triton_device() -> torch.device:
    interpret = os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false")
    return torch.device("cpu" if interpret else "cuda")


# Launch configurations the Triton backends run besides the defaults: small blocks, so the
# table's shapes still span several chunks, tiles, d tiles and splits with ragged tails, packed
# and masked; and tiny tiles, many to a chunk, with narrow d tiles (the loops' bookkeeping).
TRITON_LAUNCH = {
    "small-packed": dict(act_chunk_n=32, act_tile_n=16, act_block_d=64, down_chunk_n=32, down_tile_n=16,
                         down_block_d=64, down_splits=None),
    "small-masked": dict(act_chunk_n=32, act_tile_n=16, act_block_d=64, down_chunk_n=32, down_tile_n=16,
                         down_block_d=64, down_splits=None, packed=False),
    "tiny": dict(act_chunk_n=16, act_tile_n=2, act_block_d=32, down_chunk_n=16, down_tile_n=4, down_block_d=32),
}


def _triton_config(launch: str | None, **fields):
    from engine.kernels.triton_ffn import LaunchConfig

    return LaunchConfig(**{**TRITON_LAUNCH.get(launch, {}), **fields}) if launch or fields else None


def _triton(case: KernelCase, layer: Layer | None, launch: str | None = None) -> Prepared:
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
    if case.op == "down_proj":
        return _down_proj(case, dev, launch)
    if case.op == "predictor":
        return _predictor(case, dev, launch)
    # the predictor's logits select the rows (every row without them, at fraction 1), these
    # rows' own or the layer's through row ids
    x = layer.x.to(dev)
    logits, row_ids = _layer_logits(case, layer) if case.route == "row-ids" else (layer.logits, None)
    logits = None if case.fraction >= 1 and row_ids is None else logits.to(dev)
    row_ids = None if row_ids is None else row_ids.to(dev)
    # sparse_ffn_*_triton is these two launches; the activations between them are checked too
    acts = torch.full((case.n,), float("nan"), device=dev)
    if case.weights == "int4":
        from engine.kernels import q4_format, q4_quantize
        from engine.kernels.triton_q4 import q4_activations_triton, q4_down_triton

        q = [None if w is None else q4_quantize.quantize_rows_q4(w) for w in (layer.gate, layer.up, layer.down_t)]
        rows = tuple(None if w is None else q4_format.dequantize_rows_q4(w, case.d) for w in q)
        gate, up, down = [None if w is None else w.to(dev) for w in q]

        def run():
            acts.copy_(q4_activations_triton(x, gate, up, case.d, logits, layer.threshold, case.activation,
                                             layer.act_threshold, row_ids))
            return q4_down_triton(acts, down, case.d)

        return Prepared(run, rows, acts=acts)
    from engine.kernels.triton_ffn import down_proj_triton, ffn_activations_triton

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case.weights]
    held = tuple(None if w is None else w.to(dtype) for w in (layer.gate, layer.up, layer.down_t))
    gate, up, down = [None if w is None else w.to(dev) for w in held]
    config = _triton_config(launch)

    def run():
        acts.copy_(ffn_activations_triton(x, gate, up, logits, layer.threshold, case.activation, layer.act_threshold,
                                          row_ids, config=config))
        return down_proj_triton(acts, down, config=config)

    return Prepared(run, held, acts=acts)


def _down_proj(case: KernelCase, dev: torch.device, launch: str | None) -> Prepared:
    """Triton's down projection alone: 80% of the activations 0 (their rows never read)."""
    from engine.kernels.triton_ffn import down_proj_triton

    g = torch.Generator().manual_seed(case.length)
    down_t = torch.randn(case.n, case.d, generator=g).half()
    act = torch.randn(case.n, generator=g)
    act[torch.rand(case.n, generator=g) >= case.fraction] = 0.0
    config = _triton_config(launch, down_splits=case.length or None)
    act_d, down_d = act.to(dev), down_t.to(dev)
    terms = act.double()[:, None] * down_t.double()
    return Prepared(lambda: down_proj_triton(act_d, down_d, config=config), (),
                    lambda: (terms.sum(0), float(terms.abs().sum(0).max()) + 1e-12), repeat=True)


def _predictor(case: KernelCase, dev: torch.device, launch: str | None, baseline: bool = False) -> Prepared:
    """fc2 @ relu(fc1 @ x) in the case's dtype: Triton's kernel, or (baseline) torch's, whose
    hidden layer is rounded to the dtype. The scale: the same over the terms' magnitudes."""
    from engine.kernels.triton_ffn import predictor_torch, predictor_triton

    d, rank, n = case.d, case.length, case.n
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.weights]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(d, generator=g).to(dtype)
    fc1 = (torch.randn(rank, d, generator=g) / d ** 0.5).to(dtype)
    fc2 = (torch.randn(n, rank, generator=g) / rank ** 0.5).to(dtype)
    xd, fc1d, fc2d = x.to(dev), fc1.to(dev), fc2.to(dev)
    config = _triton_config(launch)
    run = (lambda: predictor_torch(xd, fc1d, fc2d)) if baseline else lambda: predictor_triton(xd, fc1d, fc2d,
                                                                                            config=config)

    def reference():
        h = torch.relu(fc1.double() @ x.double())
        mag = fc2.double().abs() @ (fc1.double().abs() @ x.double().abs())
        return fc2.double() @ h, float(mag.max()) + 1e-12

    return Prepared(run, (), reference)


def _torch(case: KernelCase, layer: Layer | None) -> Prepared:
    if case.op == "predictor":  # the cuBLAS baseline of the hot tier's predictor
        return _predictor(case, _triton_device(), None, baseline=True)
    return _cpu(case, layer)


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

    with patched(cpu_q4, "USE_INT8_ACTIVATIONS", False):
        yield


@contextmanager
def dense_kernels_for_every_size():
    """The numba backend: fp32 activations (above), and the dense products (matvec, combine) on
    numba for the table's small shapes too (cpu's size cut-over hands small ones to torch)."""
    from engine.kernels import cpu

    with patched(cpu, "_DENSE_MIN_ELEMENTS", 0), fp32_activations():
        yield


def _fused_available() -> bool:
    from engine.runtime import fused_decode

    return _int8_activations_available() and fused_decode.module() is not None


def _triton_available() -> bool:
    try:
        from engine.kernels.triton_ffn import available
    except ImportError:
        return False
    return available()


@dataclass(frozen=True)
class Backend:
    name: str
    weights: tuple[str, ...]  # the FFN ops' weight formats it runs
    available: Callable[[], bool]
    prepare: Callable[[KernelCase, Layer | None], Prepared]
    context: Callable = contextmanager(lambda: (yield))
    ops: dict | None = None  # other ops -> the weight formats it runs them in (None: every case of the op)
    ffn_ops: tuple[str, ...] = ("sparse_ffn",)
    routes: dict | None = None  # op -> the routes it runs (absent: every route)
    # Bounds of its own, by op (torch's predictor rounds its hidden layer to the weights' dtype).
    # A backend that rounds its input (x in Q8_0 blocks) is checked against a reference that
    # rounds it the same way (`Prepared.x_ref`), under the op's bound.
    tols: dict | None = None
    only: Callable[[KernelCase], bool] | None = None  # of the cases it could run, the ones it does

    def bound(self, case: KernelCase) -> float:
        # a case whose reference rounds the input as the backend does (matmul_q4) keeps its own bound
        return (self.tols or {}).get(case.op, case.tol)

    def supports(self, case: KernelCase) -> bool:
        if self.only is not None and not self.only(case):
            return False
        if case.route and case.op in (self.routes or {}) and case.route not in self.routes[case.op]:
            return False
        if case.op in FFN_OPS:
            return case.op in self.ffn_ops and case.weights in self.weights
        ops = self.ops or {}
        return case.op in ops and (ops[case.op] is None or case.weights in ops[case.op])


_CPU_FFN_OPS = tuple(_CPU_FFN)
BACKENDS = {
    "numba": Backend("numba", ("fp32", "int8", "int4"), _numba_available, _cpu, dense_kernels_for_every_size,
                     ops={"matvec": None, "decode_attention": None}, ffn_ops=_CPU_FFN_OPS),
    # the fused decode's kernels (AVX2: their int8 x 4-bit products), with int8 activations for 4-bit rows
    "numba-fused": Backend("numba-fused", (), _fused_available, _cpu, ops={"moe_ffn": None}),
    "numba-int8act": Backend("numba-int8act", ("int4",), _int8_activations_available, _cpu,
                             ops={"matmul_q4": None, "matmul_int8": None, "matvec": ("int4",),
                                  "decode_linear_q4_1": None},
                             ffn_ops=("sparse_ffn", "sparse_ffn_predicted")),
    # without numba one torch path serves both of sparse_ffn_tokens' routes
    "torch": Backend("torch", ("fp32", "int8", "int4"), lambda: True, _torch, numba_disabled,
                     ops={"matvec": None, "decode_attention": None, "predictor": None}, ffn_ops=_CPU_FFN_OPS,
                     routes={"sparse_ffn_tokens": ("union",)}, tols={"predictor": 2e-2}),
    # The Triton interpreter on CPU tensors (TRITON_INTERPRET=1), or CUDA when there is a GPU;
    # its default launch configuration, then the others the tests exercise.
    # (its sparse_ffn rows select by these rows' logits already: the predicted op adds the row ids)
    "triton": Backend("triton", ("fp32", "fp16", "bf16", "int4"), _triton_available, _triton,
                      ops={"matvec": ("int4",)}, ffn_ops=("sparse_ffn", "sparse_ffn_predicted"),
                      routes={"sparse_ffn_predicted": ("row-ids",)}),
    "triton-small-packed": Backend("triton-small-packed", ("fp16",), _triton_available,
                                   partial(_triton, launch="small-packed"),
                                   ops={"down_proj": None, "predictor": None}),
    "triton-small-masked": Backend("triton-small-masked", ("bf16",), _triton_available,
                                   partial(_triton, launch="small-masked"), ops={"down_proj": None}),
    "triton-tiny": Backend("triton-tiny", ("fp16",), _triton_available, partial(_triton, launch="tiny"),
                           ops={"down_proj": None},
                           only=lambda c: c.op == "down_proj" and not c.length or c.activation in ("drelu", "relu2")),
}


def check(case: KernelCase, backend: Backend, seed: int = 0) -> float:
    """Run one case on one backend; its error (see the module docstring)."""
    layer = layer_of(case, seed)
    with backend.context():
        prepared = backend.prepare(case, layer)
        y = prepared.run()
        again = prepared.run() if prepared.repeat else None
    ref, scale = reference_of(case, layer, prepared)
    assert y.dtype == torch.float32 and tuple(y.shape) == tuple(ref.shape)
    if again is not None and not torch.equal(y, again):
        return float("inf")  # not a fixed-order sum
    err = relative_error(y, ref, scale)
    if prepared.acts is not None:
        full = _ffn_reference_of(case, layer, prepared)
        want = full.acts if prepared.acts_of is None else full.acts[..., prepared.acts_of]
        err = max(err, relative_error(prepared.acts, want, full.acts_scale))
    return err


def _ffn_reference_of(case: KernelCase, layer: Layer, prepared: Prepared) -> Reference:
    x = prepared.x_ref if prepared.x_ref is not None else layer.x
    return ffn_reference(x, *prepared.rows, layer.selected, case.activation, layer.act_threshold)


def reference_of(case: KernelCase, layer: Layer | None, prepared: Prepared) -> tuple[torch.Tensor, float]:
    """The fp64 result of a prepared case and its error scale."""
    if prepared.reference is not None:
        return prepared.reference()
    ref = _ffn_reference_of(case, layer, prepared)
    return ref.y, ref.scale
