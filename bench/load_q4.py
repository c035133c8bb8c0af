"""Loading and decoding with 4-bit CPU rows and the prepared layout, on random weights of
7B layer shapes (the checkpoint of `bench.sparse_decode`, fp16).

Each load runs in its own process, so its peak resident set is its own:
- `unprepared`: the layout rebuilt from the checkpoint (THERMOCLINE_NO_PREPARED=1);
- `first`: the same, writing the prepared rows into the sidecar;
- `second`: the prepared rows memory-mapped.
For each: seconds from Engine.load to a loaded engine, peak RSS, the placed RAM bytes
(the placement's figure) and peak RSS / placed. Then decode tok/s in sparse mode at the
target active fraction (sets drawn from a power law, as bench.sparse_decode) for int4 and
int8 CPU rows, and dense fp32. llama.cpp's load and Q4_0 decode of such weights are
bench.vs_llamacpp's.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import emit, peak_rss


def _child(model: str, fmt: str, mode: str, active: float, tokens: int, decode: bool) -> dict:
    import numpy as np
    import torch

    from engine import Engine, SamplingParams
    from engine.hotcold.activation_stats import ActivationStats

    t0 = time.perf_counter()
    engine = Engine.load(model, mode=mode, cpu_weights=fmt, ctx=64, ram_budget=None)
    load_s = time.perf_counter() - t0
    out = {"load_s": load_s, "peak_rss": peak_rss(),
           "placed_ram": engine.memory()["ram_bytes"] if engine.sparse else None,
           "prepared": str(engine.sparse.prepared_path) if engine.sparse and engine.sparse.prepared_rows else None}
    if decode:
        engine.eos_ids = set()
        if engine.sparse is not None:
            probs = [f.numpy() / 1e6 for f in ActivationStats.load(Path(model)).frequencies()]
            rng = np.random.default_rng(1)
            masks = [torch.from_numpy(rng.random((256, len(p))) < p) for p in probs]
            step = [0] * len(probs)

            def drawn(layer):
                step[layer] += 1
                return masks[layer][step[layer] % 256]

            engine.sparse.override_masks = drawn
        prompt = [0] + list(range(100, 115))
        rates = []
        for _ in range(3):
            engine.reset()
            engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0))
            rates.append(engine.last_stats.decode_tok_s)
        out["decode_tok_s"] = max(rates)
    return out


def _run(model: Path, fmt: str, mode: str, args, *, prepared: bool, decode: bool = False) -> dict:
    env = dict(os.environ)
    if not prepared:
        env["THERMOCLINE_NO_PREPARED"] = "1"
    cmd = [sys.executable, "-m", "bench.load_q4", "--child", str(model), "--fmt", fmt, "--mode", mode,
           "--active", str(args.active), "--tokens", str(args.tokens)] + (["--decode"] if decode else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    if result.get("placed_ram"):
        result["rss_over_placed"] = result["peak_rss"] / result["placed_ram"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--active", type=float, default=0.10)
    parser.add_argument("--rank", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fmt", default="int4", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sparse", help=argparse.SUPPRESS)
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the benchmark runs (CI)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.fmt, args.mode, args.active, args.tokens, args.decode)))
        return 0
    from bench.sparse_decode import SHAPES, build_checkpoint

    if args.smoke:
        args.rank, args.tokens = 16, 3
    d, n_ff, heads, vocab = SHAPES["smoke" if args.smoke else "7B"]
    with tempfile.TemporaryDirectory() as tmp:
        root, _ = build_checkpoint(Path(tmp), args.layers, d, n_ff, heads, vocab, args.rank, args.active, 0)
        result = {"layers": args.layers, "active": args.active,
                  "checkpoint_bytes": (root / "model.safetensors").stat().st_size}
        formats = ("int4",) if args.smoke else ("int4", "int8")  # smoke: fewer processes
        for fmt in formats:
            result[f"{fmt}_unprepared"] = _run(root, fmt, "sparse", args, prepared=False)
            result[f"{fmt}_first"] = _run(root, fmt, "sparse", args, prepared=True)
            result[f"{fmt}_second"] = _run(root, fmt, "sparse", args, prepared=True, decode=True)
            result[f"{fmt}_second_over_unprepared_load"] = (result[f"{fmt}_second"]["load_s"]
                                                            / result[f"{fmt}_unprepared"]["load_s"])
        result["dense_fp32"] = _run(root, "fp32", "dense", args, prepared=False, decode=True)
        if "int8_second" in result:
            result["int4_over_int8_decode"] = (result["int4_second"]["decode_tok_s"]
                                               / result["int8_second"]["decode_tok_s"])
        result["int4_sparse_over_dense_fp32_decode"] = (result["int4_second"]["decode_tok_s"]
                                                        / result["dense_fp32"]["decode_tok_s"])
        result["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
