"""Measure the Triton sparse FFN launch configurations on a GPU and print JSON.

    python -m bench.triton_tune [--fraction 0.1] [--json]
    TRITON_INTERPRET=1 python -m bench.triton_tune --smoke   (CPU, tiny shapes:
                                                                      checks the script only)

For 7B-class layer shapes at the given active fraction it times dense cuBLAS (the
`F.linear` chain in fp16) and several `LaunchConfig`s of `sparse_ffn_triton`, with L2
flushed between runs (triton.testing.do_bench): the active rows of one layer fit in the
L2 of recent GPUs, and a warm L2 would overstate the bandwidth. The predictor is an oracle
(logits = gate . x) so the predicted neurons are the firing ones and the bytes counted are
exactly the rows a perfect predictor needs. Bandwidth is reported against a measured
device-to-device copy, and the best configuration is named so the defaults can be set
from measurements rather than guesses. Also times predictor_triton against predictor_torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from engine.kernels.triton_ffn import LaunchConfig, available, ffn_activations_triton, predictor_torch, \
    predictor_triton, sparse_ffn_triton, with_overrides

# (name, d, n, activation, gated): LLaMA-2-7B / ReluLLaMA, Mistral-7B / TurboSparse.
LAYERS = [("llama7b", 4096, 11008, "relu", True), ("mistral7b", 4096, 14336, "drelu", True)]
SMOKE_LAYERS = [("smoke", 96, 200, "relu", True)]

CANDIDATES = {
    "default": {},
    "masked": {"packed": False, "act_tile_n": 16, "act_block_d": 256, "act_warps": 4,
               "down_tile_n": 32, "down_block_d": 128},
    "act_tile16_d512": {"act_tile_n": 16, "act_block_d": 512},
    "act_tile4_d2048": {"act_chunk_n": 32, "act_tile_n": 4, "act_block_d": 2048},
    "act_chunk128": {"act_chunk_n": 128, "act_tile_n": 16, "act_block_d": 512},
    "act_warps4": {"act_warps": 4, "act_block_d": 512},
    "down_tile32_d128": {"down_tile_n": 32, "down_block_d": 128},
    "down_d512_w8": {"down_block_d": 512, "down_warps": 8},
    "programs_per_sm8": {"programs_per_sm": 8},
}


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100) * 1e-3  # ms -> s

    def cpu_time(fn, reps=3):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    return cpu_time


def copy_bandwidth(device: str, timer) -> float:
    """Achievable bandwidth (bytes/s): read + write of a buffer much larger than L2."""
    n = (1 << 30) if device == "cuda" else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timer(lambda: dst.copy_(src))


def make_layer(d, n, gated, dtype, device, fraction, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rows():
        return (torch.randn(n, d, generator=g) / d**0.5).to(dtype).to(device)

    gate = rows() if gated else None
    up, down_t = rows(), rows()
    x = torch.randn(d, generator=g).to(dtype).to(device)
    pre = F.linear(x.float(), (gate if gated else up).float())
    # Oracle predictor: the top `fraction` pre-activations, all of which fire (> 0).
    thr = max(torch.quantile(pre.cpu(), 1.0 - fraction).item(), 1e-6)
    return x, gate, up, down_t, pre.contiguous(), thr


def bench_layer(name, d, n, activation, gated, args, timer, peak_bw, device) -> dict:
    dtype = torch.float16
    x, gate, up, down_t, logits, thr = make_layer(d, n, gated, dtype, device, args.fraction)
    k = int((logits >= thr).sum())
    act = ffn_activations_triton(x, gate, up, logits, thr, activation)
    fired = int((act != 0).sum())  # drelu: some predicted neurons have up . x <= 0
    elem = torch.finfo(dtype).bits // 8
    # Rows a call must read: gate and up rows of the predicted neurons (all of whose gates
    # fire), down rows of those whose activation is non-zero.
    rows_read = k * (2 if gated else 1) + fired
    bytes_sparse = rows_read * d * elem + n * 4 + d * elem + d * 4
    bytes_dense = (3 if gated else 2) * n * d * elem

    def dense():
        h = F.linear(x, up)
        if gated:
            h = torch.relu(F.linear(x, gate)) * h
        else:
            h = torch.relu(h)
        return h @ down_t

    t_dense = timer(dense)
    out = {"layer": name, "d": d, "n": n, "activation": activation, "active": k,
           "active_fraction": k / n, "fired": fired, "dense_s": t_dense,
           "dense_bandwidth_fraction": bytes_dense / t_dense / peak_bw, "configs": {}}
    ref = None
    for cname, fields in CANDIDATES.items():
        if args.smoke and cname not in ("default", "masked"):
            continue
        cfg = with_overrides(LaunchConfig(), **fields)

        def run(cfg=cfg):
            return sparse_ffn_triton(x, gate, up, down_t, logits, thr, activation, config=cfg)

        y = run()
        ref = y if ref is None else ref
        err = (y - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        t = timer(run)
        out["configs"][cname] = {"seconds": t, "speedup_vs_dense": t_dense / t,
                                 "bandwidth_fraction": bytes_sparse / t / peak_bw,
                                 "rel_diff_vs_default": err}
    best = min(out["configs"], key=lambda c: out["configs"][c]["seconds"])
    out["best"] = best
    if device == "cuda":
        out["default_cuda_graph"] = _graph_time(x, gate, up, down_t, logits, thr, activation,
                                                timer, bytes_sparse, peak_bw, t_dense)
    return out


def _graph_time(x, gate, up, down_t, logits, thr, activation, timer, nbytes, peak_bw,
                t_dense) -> dict:
    """The default config replayed from a CUDA graph (how a decode loop would run it)."""
    sparse_ffn_triton(x, gate, up, down_t, logits, thr, activation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_ffn_triton(x, gate, up, down_t, logits, thr, activation)
    t = timer(graph.replay)
    return {"seconds": t, "speedup_vs_dense": t_dense / t,
            "bandwidth_fraction": nbytes / t / peak_bw}


def bench_predictor(d, rank, n, timer, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(d, generator=g).half().to(device)
    fc1 = (torch.randn(rank, d, generator=g) / d**0.5).half().to(device)
    fc2 = (torch.randn(n, rank, generator=g) / rank**0.5).half().to(device)
    t_tr = timer(lambda: predictor_triton(x, fc1, fc2))
    t_th = timer(lambda: predictor_torch(x, fc1, fc2))
    return {"d": d, "rank": rank, "n": n, "triton_s": t_tr, "torch_s": t_th,
            "triton_pays": t_tr < t_th}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.1, help="active fraction (0.1)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if not available():
        print("error: needs CUDA (or TRITON_INTERPRET=1 with --smoke)", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    timer = _timer(device)
    peak_bw = copy_bandwidth(device, timer)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "copy_bandwidth_GBps": peak_bw / 1e9, "fraction": args.fraction,
              "layers": [bench_layer(*layer, args, timer, peak_bw, device)
                         for layer in (SMOKE_LAYERS if args.smoke else LAYERS)]}
    result["predictor"] = bench_predictor(*((96, 16, 200) if args.smoke else
                                            (4096, 1024, 11008)), timer, device)
    # The table goes to stderr with --json, so stdout is one JSON object.
    table = sys.stderr if args.json else sys.stdout
    print(f"{result['device']}: copy {result['copy_bandwidth_GBps']:.0f} GB/s", file=table)
    for lay in result["layers"]:
        print(f"{lay['layer']} ({lay['active']} active of {lay['n']}): dense "
              f"{lay['dense_s'] * 1e6:.1f} us, best {lay['best']}", file=table)
        rows = dict(lay["configs"])
        if "default_cuda_graph" in lay:
            rows["default (CUDA graph)"] = lay["default_cuda_graph"]
        for c, r in rows.items():
            print(f"  {c:22s} {r['seconds'] * 1e6:8.1f} us  x{r['speedup_vs_dense']:.2f}"
                  f"  {100 * r['bandwidth_fraction']:.0f}% of copy bandwidth", file=table)
    p = result["predictor"]
    print(f"predictor: triton {p['triton_s'] * 1e6:.1f} us, torch {p['torch_s'] * 1e6:.1f} us",
          file=table)
    if args.json:
        print(json.dumps(result))  # one line: the benchmarks' last-line contract
    return 0


if __name__ == "__main__":
    sys.exit(main())
