"""Sparse FFN kernels against the dense FFN, next to the machine's memory bandwidth.

    python -m bench.ffn [--json] [--device cpu|cuda] [--repeats 9] [--shapes 7B,13B]
                        [--fractions 0.05,0.1,0.2,0.3,0.5] [--threads 2]

One gated relu FFN layer per shape (7B: d 4096 x n_ff 11008, 13B: 5120 x 13824), random
weights. For each active fraction, every repeat draws a new active set from a power law
(neuron i fires with probability proportional to 1 / rank(i)^alpha, ranks a fixed random
permutation, probabilities capped at 1 and scaled to the target fraction), so hot neurons
recur across repeats as in decoding. The gate rows are sign-flipped so that every drawn
neuron really fires for the benchmark input: the predicted set is the firing set.

- dense: torch `F.linear` chain over all rows (gate, up, act, down), fp32 on the CPU,
  fp16 (cuBLAS) on CUDA: the baseline;
- sparse: `engine.kernels.cpu.sparse_ffn` over int8 rows (the engine's default) and fp32
  rows on the CPU; `engine.kernels.triton_ffn.sparse_ffn_triton` over fp16 rows on CUDA.

Calls are interleaved (the order rotates each repeat) and the caches are flushed before
each timed call (a 64 MiB read on the CPU, 512 MiB write on CUDA, larger than L3/L2);
figures are medians. `touched_gbps` counts the bytes a call must read: the rows (and row
scales) of the active set it reads (gate rows of all active neurons, up and down rows of
those that fired) plus the index, activation, x and y vectors. `machine_gbps` is measured in
the same run: a 1 GiB tensor `copy_`, counting read + write bytes (2 GiB per copy), before
the first shape and after each; a shape's `bw_fraction` is against the higher of the two
samples around it.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch  # after bench/__init__ set OMP_WAIT_POLICY
import torch.nn.functional as F

SHAPES = {"7B": (4096, 11008), "13B": (5120, 13824), "tiny": (256, 1024)}  # tiny: smoke tests
FRACTIONS = (0.05, 0.10, 0.20, 0.30, 0.50)
POWER_LAW_ALPHA = 1.0
TARGET = {"active": 0.10, "speedup": 5.0, "bw_fraction": 0.60}
GIB = 1 << 30


# ---- active sets ---------------------------------------------------------------------------

def power_law_probs(n: int, fraction: float, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Per-neuron firing probability [n] float64: c / rank^alpha capped at 1, with c such
    that the expected active count is fraction * n. Ranks are a random permutation."""
    w = torch.empty(n, dtype=torch.float64)
    w[torch.randperm(n, generator=gen)] = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** alpha
    target = fraction * n
    lo, hi = 0.0, 1.0 / float(w.min())  # c = hi makes every probability 1
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if float(torch.clamp(mid * w, max=1.0).sum()) < target:
            lo = mid
        else:
            hi = mid
    return torch.clamp(hi * w, max=1.0)


def draw_active(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sorted int64 ids of the neurons that fire in one draw."""
    fire = torch.rand(probs.shape[0], generator=gen, dtype=torch.float64) < probs
    return torch.nonzero(fire).squeeze(1)


# ---- measurement helpers -------------------------------------------------------------------

def _median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def machine_bandwidth(device: str, nbytes: int = GIB) -> dict:
    """Copy a 1 GiB tensor (read + write bytes counted) and sum it (read bytes): median GB/s."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s, read_s = [], []
    for r in range(6):
        t = _timed(lambda: dst.copy_(src), device)
        s = _timed(lambda: src.sum(), device)
        if r:  # the first round pays page faults / allocation
            copy_s.append(t)
            read_s.append(s)
    return {"copy_gbps": 2 * nbytes / statistics.median(copy_s) / 1e9,
            "read_gbps": nbytes / statistics.median(read_s) / 1e9}


def _timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call; on CUDA with events around it (includes launch overhead)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class CacheFlusher:
    """Evicts the weights from the last-level cache between timed calls."""

    def __init__(self, device: str):
        self.device = device
        size = (512 << 20) if device == "cuda" else (64 << 20)
        self.buf = torch.ones(size // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        if self.device == "cuda":
            self.buf.fill_(1.0)
            torch.cuda.synchronize()
        else:
            self.buf.numpy().sum()  # single-threaded: leaves no torch thread pool spinning


# ---- one layer -----------------------------------------------------------------------------

def make_layer(d: int, n: int, gen: torch.Generator, device: str, dtype: torch.dtype):
    """Gate/up/down_t [n, d] and x [d]; every neuron's gate pre-activation is positive for x."""
    gate = torch.randn(n, d, generator=gen) * d ** -0.5
    up = torch.randn(n, d, generator=gen) * d ** -0.5
    down_t = torch.randn(n, d, generator=gen) * n ** -0.5
    x = torch.randn(d, generator=gen)
    gate.mul_(torch.where(gate @ x < 0, -1.0, 1.0)[:, None])
    return tuple(t.to(device=device, dtype=dtype) for t in (gate, up, down_t, x))


def dense_ffn_fn(x, gate, up, down_w) -> Callable[[], torch.Tensor]:
    return lambda: F.linear(torch.relu(F.linear(x, gate)) * F.linear(x, up), down_w)


def _rel_err(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    err = (y.float() - y_ref.float()).abs().max()
    return float(err / y_ref.float().abs().max().clamp_min(1e-30))


# ---- CPU -----------------------------------------------------------------------------------

def bench_cpu_shape(label, d, n, args, gen, flush) -> list[dict]:
    from engine.kernels import cpu, reference

    gate, up, down_t, x = make_layer(d, n, gen, "cpu", torch.float32)
    down_w = down_t.t().contiguous()  # down_proj.weight [d, n]: the dense layout
    rows = {"int8": cpu.CpuFfnRows.from_dense(gate, up, down_t, quant="int8"),
            "fp32": cpu.CpuFfnRows(gate, up, down_t, quant="fp32")}  # shares the dense rows
    dense = dense_ffn_fn(x, gate, up, down_w)
    dense_bytes = 3 * n * d * 4
    out = []
    for fraction in args.fractions:
        probs = power_law_probs(n, fraction, args.alpha, gen)
        times = {"dense": [], "int8": [], "fp32": []}
        rows_read = {q: [] for q in rows}
        ks, select_s, errs = [], [], {q: 0.0 for q in rows}
        for r in range(args.repeats):
            active = draw_active(probs, gen)
            k = active.numel()
            ks.append(k)
            acts = {q: torch.empty(k) for q in rows}
            calls = {"dense": dense}
            for q, rw in rows.items():
                calls[q] = (lambda rw=rw, a=acts[q]:
                            cpu.sparse_ffn(x, rw, active, "relu", out_acts=a))
            names = list(calls)
            names = names[r % len(names):] + names[:r % len(names)]
            results = {}
            for name in names:
                flush()
                t0 = time.perf_counter()
                results[name] = calls[name]()
                times[name].append(time.perf_counter() - t0)
            logits = torch.full((n,), -1.0)
            logits[active] = 1.0
            t0 = time.perf_counter()
            torch.nonzero(logits >= 0.0).squeeze(1)
            select_s.append(time.perf_counter() - t0)
            for q in rows:
                fired = int((acts[q] != 0).sum())
                rows_read[q].append(k + 2 * fired)  # gate of all; up and down of those fired
            if r == 0:  # correctness of what is timed, against the torch reference
                for q, rw in rows.items():
                    g, u, dt = rw.dequantized()
                    y_ref = reference.sparse_ffn(x, g, u, dt, active, "relu")
                    errs[q] = _rel_err(results[q], y_ref)
        dense_ms = _median_ms(times["dense"])
        for q, rw in rows.items():
            row_bytes = d * rw.up.element_size() + (4 if q == "int8" else 0)
            k_med = statistics.median(ks)
            touched = statistics.median(rows_read[q]) * row_bytes + k_med * (8 + 4) + 2 * d * 4
            sparse_ms = _median_ms(times[q])
            gbps = touched / (sparse_ms / 1e3) / 1e9
            out.append({
                "shape": f"{d}x{n}", "model": label, "d": d, "n": n, "quant": q, "active": fraction,
                "active_measured": round(statistics.mean(ks) / n, 4),
                "fired": round((statistics.mean(rows_read[q]) - statistics.mean(ks)) / (2 * n), 4),
                "dense_ms": round(dense_ms, 3), "sparse_ms": round(sparse_ms, 3),
                "dense_ms_min": round(min(times["dense"]) * 1e3, 3),
                "sparse_ms_min": round(min(times[q]) * 1e3, 3),
                "speedup": round(dense_ms / sparse_ms, 2),
                "speedup_of_mins": round(min(times["dense"]) / min(times[q]), 2),
                "touched_mb": round(touched / 1e6, 2), "touched_gbps": round(gbps, 2),
                "touched_gbps_of_min": round(touched / min(times[q]) / 1e9, 2),
                "dense_gbps": round(dense_bytes / (dense_ms / 1e3) / 1e9, 2),
                "select_ms": round(_median_ms(select_s), 4), "max_rel_err": float(f"{errs[q]:.2e}"),
            })
    return out


def bench_cpu(args) -> dict:
    from engine.kernels import cpu

    torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads)
    jit = cpu.warmup()  # first-call JIT (or disk-cache load), kept out of the timings
    layer = None
    if cpu.available():
        import numba
        layer = numba.threading_layer()
    flush = CacheFlusher("cpu")
    gen = torch.Generator().manual_seed(args.seed)
    results, bw = _shapes_between_bandwidth_samples(
        "cpu", args, lambda label, d, n: bench_cpu_shape(label, d, n, args, gen, flush))
    return {"device": "cpu", "cpu": _cpu_name(), **bw,
            "threads": {"torch": torch.get_num_threads(), "numba": cpu.num_threads(),
                        "numba_layer": layer},
            "numba": cpu.available(), "jit_first_call_s": round(jit["seconds"], 3),
            "jit_cache_hits": jit["cache_hits"], "jit_compiled": jit["compiled"],
            "results": results}


# ---- CUDA ----------------------------------------------------------------------------------

def bench_cuda_shape(label, d, n, args, gen, flush, sparse_fn) -> list[dict]:
    gate, up, down_t, x = make_layer(d, n, gen, "cuda", torch.float16)
    down_w = down_t.t().contiguous()
    dense = dense_ffn_fn(x, gate, up, down_w)
    dense_bytes = 3 * n * d * 2
    out = []
    for fraction in args.fractions:
        probs = power_law_probs(n, fraction, args.alpha, gen)
        times = {"dense": [], "sparse": []}
        ks, errs = [], 0.0
        for r in range(args.repeats):
            active = draw_active(probs, gen)
            ks.append(active.numel())
            logits = torch.full((n,), -1.0)
            logits[active] = 1.0
            logits = logits.to("cuda")
            calls = {"dense": dense,
                     "sparse": lambda lg=logits: sparse_fn(x, gate, up, down_t, lg, 0.0, "relu")}
            names = list(calls) if r % 2 == 0 else list(calls)[::-1]
            res = {}
            for name in names:
                flush()
                t = _timed(lambda name=name: res.__setitem__(name, calls[name]()), "cuda")
                times[name].append(t)
            if r == 0:
                from engine.kernels import reference
                y_ref = reference.sparse_ffn(x.float(), gate.float(), up.float(), down_t.float(),
                                             active.to("cuda"), "relu")
                errs = _rel_err(res["sparse"], y_ref)
        dense_ms, sparse_ms = _median_ms(times["dense"]), _median_ms(times["sparse"])
        k_med = statistics.median(ks)
        touched = 3 * k_med * d * 2 + n * 4 + 2 * d * 4  # all fire; logits [n] read once
        gbps = touched / (sparse_ms / 1e3) / 1e9
        out.append({
            "shape": f"{d}x{n}", "model": label, "d": d, "n": n, "quant": "fp16", "active": fraction,
            "active_measured": round(statistics.mean(ks) / n, 4),
            "dense_ms": round(dense_ms, 4), "sparse_ms": round(sparse_ms, 4),
            "dense_ms_min": round(min(times["dense"]) * 1e3, 4),
            "sparse_ms_min": round(min(times["sparse"]) * 1e3, 4),
            "speedup": round(dense_ms / sparse_ms, 2),
            "speedup_of_mins": round(min(times["dense"]) / min(times["sparse"]), 2),
            "touched_mb": round(touched / 1e6, 2), "touched_gbps": round(gbps, 1),
            "touched_gbps_of_min": round(touched / min(times["sparse"]) / 1e9, 1),
            "dense_gbps": round(dense_bytes / (dense_ms / 1e3) / 1e9, 1),
            "max_rel_err": float(f"{errs:.2e}"),
        })
    return out


def bench_cuda(args) -> dict:
    from engine.kernels.triton_ffn import sparse_ffn_triton  # lazily: needs triton and a GPU

    gen = torch.Generator().manual_seed(args.seed)
    # first call compiles the Triton kernels: timed apart, not part of the results
    g, u, dt, x = make_layer(256, 512, gen, "cuda", torch.float16)
    t0 = time.perf_counter()
    sparse_ffn_triton(x, g, u, dt, torch.zeros(512, device="cuda"), 0.0, "relu")
    torch.cuda.synchronize()
    jit_s = time.perf_counter() - t0
    flush = CacheFlusher("cuda")
    results, bw = _shapes_between_bandwidth_samples(
        "cuda", args, lambda label, d, n: bench_cuda_shape(label, d, n, args, gen, flush, sparse_ffn_triton))
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(), **bw,
            "jit_first_call_s": round(jit_s, 3), "results": results}


def _shapes_between_bandwidth_samples(device: str, args, run_shape) -> tuple[list[dict], dict]:
    """Runs every shape, measuring the machine's bandwidth before the first and after each.
    A shared machine's bandwidth drifts over a run (24-48 GB/s here within an hour), so
    each shape's rows are set against the higher of the samples around it: the stricter
    figure. Returns (rows, report fields)."""
    samples = [machine_bandwidth(device, args.bandwidth_mib << 20)]
    results = []
    for label in args.shapes:
        d, n = SHAPES[label]
        rows = run_shape(label, d, n)
        samples.append(machine_bandwidth(device, args.bandwidth_mib << 20))
        machine = max(samples[-2]["copy_gbps"], samples[-1]["copy_gbps"])
        for r in rows:
            r["machine_gbps"] = round(machine, 2)
            r["bw_fraction"] = round(r["touched_gbps"] / machine, 3)
        results += rows
    copies = [b["copy_gbps"] for b in samples]
    return results, {
        "machine_gbps": round(max(copies), 2),
        "machine_gbps_counts": f"read+write bytes of a {args.bandwidth_mib} MiB {device} copy_, median of 5; "
                               "the highest of the samples taken before the first shape and after each",
        "machine_gbps_samples": [round(c, 2) for c in copies],
        "machine_read_gbps": round(max(b["read_gbps"] for b in samples), 2),
    }


# ---- report --------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on Windows
        return None


def targets(results: list[dict], quant: str) -> dict:
    """The issue's CPU targets at 10% active, checked on the given row storage."""
    rows = [r for r in results if r["quant"] == quant and math.isclose(r["active"], TARGET["active"])]
    if not rows:
        return {}
    speed = min(r["speedup"] for r in rows)
    bw = min(r["bw_fraction"] for r in rows)
    return {"quant": quant, "active": TARGET["active"], "min_speedup": speed,
            "min_bw_fraction": bw,
            "min_speedup_of_mins": min(r["speedup_of_mins"] for r in rows),
            "min_bw_fraction_of_mins": round(min(r["touched_gbps_of_min"] / r["machine_gbps"]
                                                 for r in rows), 3),
            "speedup_target": TARGET["speedup"],
            "bw_fraction_target": TARGET["bw_fraction"],
            "met": speed >= TARGET["speedup"] and bw >= TARGET["bw_fraction"]}


def table(report: dict) -> str:
    lines = [f"{report['device']}: machine {report['machine_gbps']} GB/s (copy, read+write)"]
    lines.append(f"{'model':>5} {'quant':>5} {'active':>6} {'dense ms':>9} {'sparse ms':>9} "
                 f"{'speedup':>7} {'touched GB/s':>12} {'of machine':>10}")
    for r in report["results"]:
        lines.append(f"{r['model']:>5} {r['quant']:>5} {r['active']:>6.2f} {r['dense_ms']:>9.3f} "
                     f"{r['sparse_ms']:>9.3f} {r['speedup']:>7.2f} {r['touched_gbps']:>12.2f} "
                     f"{r['bw_fraction']:>10.2f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ffn", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="table to stderr, JSON object on stdout")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shapes", default="7B,13B", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (CPU)")
    p.add_argument("--alpha", type=float, default=POWER_LAW_ALPHA, help="power-law exponent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the copy measuring "
                   "the machine's bandwidth (well above the last-level cache)")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    args.fractions = [float(f) for f in args.fractions.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    load_before = _loadavg()
    with torch.inference_mode():
        report = bench_cuda(args) if args.device == "cuda" else bench_cpu(args)
    report = {"bench": "ffn", **report, "power_law_alpha": args.alpha, "repeats": args.repeats,
              "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    if args.device == "cpu":
        report["targets"] = targets(report["results"], "int8")
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    # other processes on a shared machine inflate medians: say how busy it was
    report["loadavg_1min"] = {"before": load_before, "after": _loadavg()}
    print(table(report), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
