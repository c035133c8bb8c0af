"""Times the kernel case table (tests/kernel_cases.py: every op's cases, one fp64 reference and one
error measure, which tests/test_kernel_cases.py checks on every backend present): the median ms
per case and backend, a sparse FFN case (one token, a few, a prefill) next to the dense torch
FFN over the same rows and tokens measured in the same run.

    python -m bench.kernel_cases --json [--backends numba,torch,triton] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# The table lives with the tests (the suite checks it; this times it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_cases import BACKENDS, CASES, _triton_device, layer_of, reference_of, relative_error


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
        device = _triton_device() if name.startswith("triton") else torch.device("cpu")
        for case in CASES:
            if not backend.supports(case):
                continue
            layer = layer_of(case)
            with backend.context():
                prepared = backend.prepare(case, layer)
                ms = _median_ms(prepared.run, args.repeats, device)
                err = relative_error(prepared.run(), *reference_of(case, layer, prepared))
            if layer is None:  # the products, attention, the predictor: the kernel's own time and error
                rows.append({"case": case.id, "op": case.op, "backend": name, "ms": ms, "dense_torch_ms": None,
                             "ratio_vs_dense": None, "error": err, "tol": backend.bound(case)})
                continue
            # Baseline in the same run: the dense torch FFN (F.linear chain) over the same rows.
            dense_rows = [None if w is None else w.to(device, torch.float32) for w in prepared.rows]
            dense = _median_ms(lambda: _dense(layer.x.to(device), *dense_rows, case.activation), args.repeats,
                               device)
            rows.append({"case": case.id, "op": case.op, "backend": name, "ms": ms, "dense_torch_ms": dense,
                         "ratio_vs_dense": dense / ms if ms else None, "error": err, "tol": backend.bound(case)})
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "threads": torch.get_num_threads(), "results": rows}))
    else:
        for r in rows:
            dense = f"dense {r['dense_torch_ms']:8.3f} ms" if r["dense_torch_ms"] is not None else " " * 17
            print(f"{r['backend']:7s} {r['case']:40s} {r['ms']:8.3f} ms  {dense}  err {r['error']:.1e}")
    return 0


def _dense(x, gate, up, down_t, activation):
    from engine.kernels.reference import dense_ffn

    return dense_ffn(x, gate, up, down_t, activation)


if __name__ == "__main__":
    raise SystemExit(main())
