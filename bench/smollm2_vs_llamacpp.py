"""The real SmolLM2-135M-Instruct Q4_1 GGUF: Thermocline against llama.cpp on the same file, in one run.

llama.cpp (llama-cpp-python, the `bench` extra) runs the GGUF as it is (Q4_1 blocks, the
Q8_0 embeddings as the tied head). Ours imports it (`models import`) and runs it dense with
each CPU weight format: int4 and int8 keep the Q4_1 blocks (engine.kernels.quantized
.Q4MinMatrix), fp32 the decoded values. Each side runs in its own process with the same
threads; figures as bench.vs_llamacpp's (decode tok/s, time to first token of a short
prompt, a long prefill, load), ratios ours over llama.cpp's (> 1: ours is faster).
`--smoke`: two decoded tokens and short prompts, llama.cpp skipped where not installed
(tests/test_bench_smoke.py). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import emit, llama_cpp_missing
from bench.vs_llamacpp import Shape, _best, machine, worker_env

VOCAB = 49152


def worker(args) -> dict:
    from bench import vs_llamacpp

    vs_llamacpp.SHORT, vs_llamacpp.LONG = args.short, args.long  # the prompts' lengths
    shape = Shape(576, 1536, 9, VOCAB)
    if args.worker == "llama":
        return vs_llamacpp.worker_llama(args.path, shape, args.threads, args.decode_tokens, args.seed)
    mode, _, weights = args.worker.partition(":")
    return vs_llamacpp.worker_ours(args.path, shape, mode, weights or None, args.threads, args.decode_tokens,
                                   args.seed)


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.smollm2_vs_llamacpp", *args], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent.parent, env=worker_env())
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--long", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the sides this many times; keep the best")
    parser.add_argument("--ours", default="dense:int4,dense:int8,dense:fp32",
                        help="our engine's modes, mode:cpu-weights, comma-separated")
    parser.add_argument("--workdir", type=Path, help="keep the imported folder here between runs")
    parser.add_argument("--smoke", action="store_true", help="a short run that checks the benchmark works (CI)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.smoke:
        args.decode_tokens, args.short, args.long, args.ours = 2, 4, 8, "dense:int4"

    from bench.real_models import smollm2_gguf
    from engine.loading.gguf_import import import_gguf

    gguf = smollm2_gguf()
    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = Path(tmp.name)
    folder = workdir / "smollm2"
    if not (folder / "model.safetensors").is_file():
        import_gguf(gguf, folder)
    llama_skipped = llama_cpp_missing()
    common = ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens), "--seed", str(args.seed),
              "--short", str(args.short), "--long", str(args.long)]
    info = machine()
    names = [n for n in args.ours.split(",") if n]
    llama, ours = None, {}
    for r in range(args.rounds):
        sides = ([] if llama_skipped else ["llama"]) + names
        for name in (sides if r % 2 == 0 else sides[::-1]):
            if name == "llama":
                llama = _best(llama, spawn(["--worker", "llama", "--path", str(gguf), *common]))
            else:
                ours[name] = _best(ours.get(name), spawn(["--worker", name, "--path", str(folder), *common]))
    info["loadavg_after"] = os.getloadavg()
    if tmp is not None:
        tmp.cleanup()

    def rounded(d: dict) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}

    result = {"model": gguf.name, "threads": args.threads, "rounds": args.rounds, "machine": info,
              "prompts": [args.short, args.long], "decode_tokens": args.decode_tokens,
              "llama_cpp_q4_1": rounded(llama) if llama else None, "llama_cpp_skipped": llama_skipped,
              "ours": {k: rounded(v) for k, v in ours.items()}}
    if llama:  # > 1: ours is faster (times inverted)
        result["ratios_vs_llama_cpp"] = {
            k: {"decode": round(v["decode_tok_s"] / llama["decode_tok_s"], 3),
                "ttft": round(llama["ttft_s"] / v["ttft_s"], 3),
                "prefill": round(llama["prefill_s"] / v["prefill_s"], 3),
                "load": round(llama["load_s"] / v["load_s"], 3)} for k, v in ours.items()}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
