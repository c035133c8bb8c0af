"""First start against second start: seconds from a process's start to its first answer on the
demo model, `Engine.load(..., kernels="background")` then one greedy generate, as the terminal
chat and `generate` would run it.

first start: numba's cache is an empty folder (NUMBA_CACHE_DIR, removed before each round), so
the kernels compile in the background and the answer comes from the torch paths; second start:
the cache this checkout has (a completed preparation), so the kernels load with the weights.
`--wait` adds the first start with `kernels="wait"` (the load compiles everything first:
minutes on 2 cores). Each round is a fresh process; the figures are from one run.

    python -m bench.first_start [--rounds N] [--wait]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, time
from engine import Engine, SamplingParams
from models_registry.resolve import demo_model_dir
engine = Engine.load(demo_model_dir(), mode="sparse", kernels=sys.argv[1])
loaded = time.monotonic()
result = engine.generate("It is a truth universally acknowledged", SamplingParams(max_new_tokens=16, temperature=0))
prep = engine.kernel_preparation
print(json.dumps({"load_done": loaded, "answered": time.monotonic(), "token_ids": result.token_ids,
                  "kernels_preparing": prep is not None,
                  "kernels_compiled": None if prep is None else [prep.compiled(), prep.total]}), flush=True)
os._exit(0)  # leave the background compile unfinished: the answer is what is measured
"""


def one_start(kernels: str, cache_dir: Path | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # modules from bytecode, as in an install
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        cache_dir.mkdir(parents=True)
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    else:
        env.pop("NUMBA_CACHE_DIR", None)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, kernels], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"error: the start failed:\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return {"kernels": kernels, "empty_cache": cache_dir is not None,
            "load_s": round(report["load_done"] - start, 2), "first_answer_s": round(report["answered"] - start, 2),
            "kernels_preparing_at_answer": report["kernels_preparing"], "kernels_compiled": report["kernels_compiled"],
            "token_ids": report["token_ids"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--wait", action="store_true", help="also a first start that waits for the compile")
    args = parser.parse_args(argv)
    empty = Path(tempfile.mkdtemp(prefix="thermocline-first-start-")) / "numba"
    try:
        second = [one_start("background", None)]  # also completes this checkout's preparation if it had none
        rounds = []
        for _ in range(args.rounds):
            rounds.append({"first": one_start("background", empty), "second": one_start("background", None)})
            if args.wait:
                rounds[-1]["first_wait"] = one_start("wait", empty)
    finally:
        shutil.rmtree(empty.parent, ignore_errors=True)
    best = {key: min(r[key]["first_answer_s"] for r in rounds) for key in rounds[0]}
    print(json.dumps({"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rounds": rounds, "priming": second,
                      "best_first_answer_s": best,
                      "same_tokens": all(r["first"]["token_ids"] == r["second"]["token_ids"] for r in rounds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
