"""The sparse FFN kernel case table (llama.cpp test-backend-ops style): one list of cases, one
synthetic layer builder, one fp64 reference and one error measure for every backend present.

`tests/test_kernel_cases.py` checks every case on every backend; `python -m bench.kernel_cases
--json` times the same table (median ms per case and backend, next to the dense torch FFN over
the same rows measured in the same run).

A case names an activation, gated or not, the weight format (fp32, int8 and int4 rows on the
CPU; fp16, bf16, fp32 and int4 rows for Triton), sizes, the fraction of neurons selected and
an error bound. The reference is `_reference` below: the FFN in fp64 over the rows the backend
really holds (dequantized), written out from docs/ARCHITECTURE.md independently of the
engine. The error is max |y - ref| over the output, divided by max over outputs of
sum_i |act_i| * |down_t[i]| (the size of what was summed, so a bound holds at any scale).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
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
    weights: str      # fp32 | int8 | int4 | fp16 | bf16
    n: int            # neurons
    d: int            # model dimension
    fraction: float   # share of neurons the predictor selects
    tol: float        # error bound (see the module docstring)

    @property
    def id(self) -> str:
        return (f"{self.activation}-{'gated' if self.gated else 'ungated'}-{self.weights}-"
                f"{self.n}x{self.d}-{self.fraction:g}")


# Sizes: dims that are and are not multiples of the kernels' blocks (32 for Q4_0, 256 for the
# numba dot, Triton's tiles), small enough for the Triton interpreter.
_SIZES = [(64, 256), (200, 96), (130, 100)]
_FRACTIONS = [0.05, 0.35, 1.0]
CASES = [
    KernelCase(act, gated, weights, *_SIZES[i % 3], _FRACTIONS[i % 3], 1e-4)
    for i, (act, gated, weights) in enumerate(product(("relu", "fatrelu", "drelu", "relu2"), (True, False),
                                                      ("fp32", "int8", "int4", "fp16", "bf16")))
    if gated or act != "drelu"  # dReLU is a gated activation
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
    act_threshold = FAT_THRESHOLD if case.activation == "fatrelu" else 0.0
    return Layer(x, gate, up, down_t, logits >= threshold, logits, threshold, act_threshold)


def _nonlinearity(v: torch.Tensor, activation: str, threshold: float) -> torch.Tensor:
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
    run: Callable[[], torch.Tensor]  # y fp32 [d]
    rows: tuple                      # (gate, up, down_t) as the backend holds them, dequantized


def _cpu(case: KernelCase, layer: Layer) -> Prepared:
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
    # A bound of its own, for a backend that rounds its input: x in 8-bit blocks of 32 with a
    # scale each (1/254 of a block's largest value) moves the sums by a few parts in a thousand.
    tol: float | None = None

    def bound(self, case: KernelCase) -> float:
        return self.tol if self.tol is not None else case.tol

    def supports(self, case: KernelCase) -> bool:
        return case.weights in self.weights


BACKENDS = {
    "numba": Backend("numba", ("fp32", "int8", "int4"), _numba_available, _cpu, fp32_activations),
    "numba-int8act": Backend("numba-int8act", ("int4",), _int8_activations_available, _cpu, tol=1e-2),
    "numba-predicted": Backend("numba-predicted", ("fp32", "int8"), _numba_available, _cpu_predicted),
    "numba-int8act-predicted": Backend("numba-int8act-predicted", ("int4",), _int8_activations_available,
                                       _cpu_predicted, tol=1e-2),
    "torch": Backend("torch", ("fp32", "int8", "int4"), lambda: True, _cpu, numba_disabled),
    # The Triton interpreter on CPU tensors (TRITON_INTERPRET=1), or CUDA when there is a GPU.
    "triton": Backend("triton", ("fp32", "fp16", "bf16", "int4"), _triton_available, _triton),
}


def check(case: KernelCase, backend: Backend, seed: int = 0) -> float:
    """Run one case on one backend; its error (see the module docstring)."""
    layer = build_layer(case, seed)
    with backend.context():
        prepared = backend.prepare(case, layer)
        y = prepared.run()
    assert y.dtype == torch.float32 and tuple(y.shape) == (case.d,)
    ref, scale = _reference(layer.x, *prepared.rows, layer.selected, case.activation, layer.act_threshold)
    return relative_error(y, ref, scale)


# ----------------------------------------------------------------------------------- timing
def _median_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3  # the first call pays compilation and page faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: " + ", ".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = []
    for name in args.backends.split(","):
        backend = BACKENDS[name]
        if not backend.available():
            continue
        device = _triton_device() if name == "triton" else torch.device("cpu")
        for case in CASES:
            if not backend.supports(case):
                continue
            layer = build_layer(case)
            with backend.context():
                prepared = backend.prepare(case, layer)
                ms = _median_ms(prepared.run, args.repeats, device)
                err = relative_error(prepared.run(), *_reference(layer.x, *prepared.rows, layer.selected,
                                                                 case.activation, layer.act_threshold))
            # Baseline in the same run: the dense torch FFN (F.linear chain) over the same rows.
            dense_rows = [None if w is None else w.to(device, torch.float32) for w in prepared.rows]
            dense = _median_ms(lambda: _dense(layer.x.to(device), *dense_rows, case.activation), args.repeats,
                               device)
            rows.append({"case": case.id, "backend": name, "ms": ms, "dense_torch_ms": dense,
                         "ratio_vs_dense": dense / ms if ms else None, "error": err, "tol": backend.bound(case)})
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "threads": torch.get_num_threads(), "results": rows}))
    else:
        for r in rows:
            print(f"{r['backend']:7s} {r['case']:40s} {r['ms']:8.3f} ms  dense {r['dense_torch_ms']:8.3f} ms  "
                  f"err {r['error']:.1e}")
    return 0


def _dense(x, gate, up, down_t, activation):
    from engine.kernels.reference import dense_ffn

    return dense_ffn(x, gate, up, down_t, activation)


if __name__ == "__main__":
    raise SystemExit(main())
