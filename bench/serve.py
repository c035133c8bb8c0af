"""The OpenAI server against the engine it drives: throughput, time to first token, overhead.

The embedded demo model, greedy, so a request does the same work on both paths. For one
client, each request runs twice back to back: through `Engine.stream` directly and streamed
over HTTP from the server (by default `thermocline serve` in its own process on 127.0.0.1, as
a client meets it; raw SSE read with httpx);
the overhead is the median over those pairs of (server time / direct time - 1), goal <= 5%.
Then N concurrent streams (1, 4, 8 by default): requests per second, the aggregate generated
tokens per second, and each stream's latency and TTFT p50/p99 as the clients see it; the
server decodes concurrent streams together (continuous batching), and `aggregate_vs_one` is
each level's tokens per second over one stream's (goals: 8 streams >= 2x on the demo, >= 3x
on a 7B-shaped model: `--shape 7B`). The last line is one JSON object.

`--shape 7B` builds (once, in `--workdir`) and serves bench.beyond_ram's model: bench.vs_llamacpp's
7B layer shapes (d 4096, 11008 neurons, 32 heads, 32k vocabulary, 2 layers) with exact
predictors, whose neurons fire at power-law rates of mean 10% (bench.sparse_decode.power_law:
p_i ~ 1/rank, as real ReLU models' hot and cold neurons; ActivationStats saved beside them).
bench.vs_llamacpp's own weights fire every neuron at the same 10%: the union of 8 sequences'
predicted sets is then 1 - 0.9^8 = 57% of the neurons, where a power law's hot neurons are
shared (`union_of_8_expected` reports the figure for the model served). `--shape smoke`: the
same, tiny (the test suite's check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

from bench import emit

MODEL_ID = "demo"  # the served model's id (main sets it from --model)
PROMPTS = [f"Story {i}: once upon a time the {w}" for i, w in enumerate(
    "cat dog bird fish fox owl bee ant cow pig hen elk yak emu bat rat".split())]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def direct_request(engine, prompt: str, max_tokens: int) -> tuple[float, float]:
    from engine import SamplingParams

    start = time.perf_counter()
    first = None
    for event in engine.stream(prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0)):
        if first is None and event.text:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


def served_request(http, url: str, prompt: str, max_tokens: int, tokens: list | None = None) -> tuple[float, float]:
    """(TTFT, whole time) of one streamed request; `tokens` receives its completion tokens."""
    import json

    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    with http.stream("POST", url + "/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
            if tokens is not None and line.startswith("data: {") and '"usage": {' in line:
                tokens.append(json.loads(line[6:])["usage"]["completion_tokens"])
            if line == "data: [DONE]":
                break
    end = time.perf_counter()
    return (first or end) - start, end - start


class ServeProcess:
    """`thermocline serve` in a child process on a free port; its request log is drained."""

    def __init__(self, mode: str, queue: int, model: str = "demo"):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model", model, "--mode", mode,
                                      "--port", "0", "--queue", str(queue)], stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        if " at http" not in line:
            self.proc.kill()
            raise SystemExit(f"serve did not start: {line}")
        self.url = line.split(" at ")[1].split()[0]
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def build_model(shape: str, workdir: Path | None) -> tuple[Path, float]:
    """bench.beyond_ram's power-law model of `shape` (built once in workdir), and the expected
    share of a layer's neurons that 8 independent tokens' active sets cover together."""
    import tempfile

    import numpy as np

    from bench.beyond_ram import build
    from bench.sparse_decode import power_law
    from bench.vs_llamacpp import SHAPES

    dims, layers, rank, active, seed = SHAPES[shape], 2, (64 if shape == "7B" else 8), 0.10, 0
    root = (workdir or Path(tempfile.gettempdir()) / f"thermocline-serve-{shape}") / "model"
    files = build(root, dims, layers, rank, active, seed, gguf=False)
    rng = np.random.default_rng(seed)  # build's own draw of the rates
    probs = [power_law(dims.n_ff, active, rng) for _ in range(layers)]
    union = float(np.mean([1 - np.mean((1 - p) ** 8) for p in probs]))
    return files["hf"], round(union, 4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mode", default="dense", choices=("dense", "sparse", "hybrid"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating direct/server rounds at one client (0: the concurrency levels alone)")
    parser.add_argument("--clients", default="1,4,8", help="concurrent stream counts")
    parser.add_argument("--model", default="demo", help="the model served (default: the embedded demo)")
    parser.add_argument("--shape", choices=("7B", "smoke"),
                        help="build and serve a power-law sparse model of these shapes (instead of --model)")
    parser.add_argument("--workdir", type=Path, help="where --shape keeps its model between runs")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--server", default="process", choices=("process", "thread"),
                        help="process: `thermocline serve` in its own process, as clients meet it (default); "
                             "thread: in this process, sharing its interpreter with the clients")
    args = parser.parse_args(argv)

    import httpx

    from app.server.runner import ServerThread
    from engine import Engine
    from models_registry.resolve import resolve_model

    global MODEL_ID
    union = None
    if args.shape is not None:
        built, union = build_model(args.shape, args.workdir)
        args.model = str(built)
    folder = resolve_model(args.model)
    MODEL_ID = args.model  # the id `thermocline serve` gives it: what --model said
    # The direct path's engine, loaded as `thermocline serve` loads it (none when nothing runs direct).
    direct = args.rounds > 0 or args.server == "thread"
    engine = Engine.load(folder, mode=args.mode, cpu_weights="int8") if direct else None
    if args.server == "thread":
        engine.eos_ids = set()  # every answer is max_tokens long (the same engine serves both paths)
        server = ServerThread(lambda: engine, lambda: MODEL_ID, port=0, max_waiting=max(64, args.requests)).start()
    else:  # greedy answers end at the same EOS on both paths, so each pair does equal work
        server = ServeProcess(args.mode, max(64, args.requests), args.model)
    http = httpx.Client(timeout=600)
    try:
        if args.rounds:
            direct_request(engine, PROMPTS[0], 4)  # warm-up both paths
        served_request(http, server.url, PROMPTS[0], 4)
        # Pairs close in time see the same machine load: the same request direct, then served
        # (the order flips every pair), and the overhead is the median of the pairs' ratios.
        ratios, direct_s, served_s, direct_ttft, served_ttft = [], [], [], [], []
        for r in range(args.rounds):
            for i, p in enumerate(PROMPTS[:8]):
                if (r + i) % 2:
                    s = served_request(http, server.url, p, args.max_tokens)
                    d = direct_request(engine, p, args.max_tokens)
                else:
                    d = direct_request(engine, p, args.max_tokens)
                    s = served_request(http, server.url, p, args.max_tokens)
                ratios.append(s[1] / d[1] - 1)
                direct_s.append(d[1])
                served_s.append(s[1])
                direct_ttft.append(d[0])
                served_ttft.append(s[0])

        levels = []
        for n in [int(c) for c in args.clients.split(",") if c.strip()]:
            results: list[tuple[float, float]] = []
            tokens: list[int] = []
            lock = threading.Lock()
            todo = list(range(args.requests))

            def client() -> None:
                with httpx.Client(timeout=600) as own:
                    while True:
                        with lock:
                            if not todo:
                                return
                            i = todo.pop()
                        r = served_request(own, server.url, PROMPTS[i % len(PROMPTS)], args.max_tokens, tokens)
                        with lock:
                            results.append(r)

            threads = [threading.Thread(target=client) for _ in range(n)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            ttfts = [r[0] for r in results]
            levels.append({"clients": n, "requests": len(results), "requests_per_s": round(len(results) / wall, 2),
                           "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
                           "latency_p50_s": round(percentile([r[1] for r in results], 50), 4),
                           "latency_p99_s": round(percentile([r[1] for r in results], 99), 4),
                           "tokens": sum(tokens), "aggregate_tok_s": round(sum(tokens) / wall, 2)})
        one = next((lv["aggregate_tok_s"] for lv in levels if lv["clients"] == 1), None)
        for lv in levels:
            lv["aggregate_vs_one"] = round(lv["aggregate_tok_s"] / one, 3) if one else None
    finally:
        http.close()
        server.stop()

    result = {
        "model": MODEL_ID, "mode": args.mode, "server": args.server, "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        **({"direct_request_s": round(statistics.median(direct_s), 4),
            "served_request_s": round(statistics.median(served_s), 4),
            "direct_ttft_p50_s": round(percentile(direct_ttft, 50), 4),
            "served_ttft_p50_s": round(percentile(served_ttft, 50), 4),
            "overhead_one_client": round(statistics.median(ratios), 4),
            "overhead_p25_p75": [round(percentile(ratios, 25), 4), round(percentile(ratios, 75), 4)]}
           if ratios else {}),  # --rounds 0: the concurrency levels alone
        "pairs": len(ratios),
        "overhead_goal": 0.05,
        "concurrency": levels,
        "aggregate_goal_8_streams": 2.0 if args.model == "demo" else 3.0,
        "shape": args.shape, "union_of_8_expected": union,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
