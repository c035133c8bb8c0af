"""The OpenAI server against the engine it drives: throughput, time to first token, overhead.

The embedded demo model (EOS disabled, so every answer is exactly --max-tokens long). For one
client, rounds alternate between calling `Engine.stream` directly and the same requests
streamed over HTTP from `thermocline serve` (uvicorn on 127.0.0.1, raw SSE read with httpx);
the overhead is the median over rounds of (server time / direct time - 1), goal <= 5%.
Then N concurrent clients: requests per second and TTFT p50/p99 as the clients see it (with
N > 1 that includes the wait for the engine: one generation runs at a time).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from bench import emit

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


def served_request(http, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with http.stream("POST", url + "/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
            if line == "data: [DONE]":
                break
    end = time.perf_counter()
    return (first or end) - start, end - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mode", default="dense", choices=("dense", "sparse", "hybrid"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="alternating direct/server rounds at one client")
    parser.add_argument("--clients", default="1,4,16", help="concurrent client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    args = parser.parse_args(argv)

    import httpx

    from app.server.runner import ServerThread
    from engine import Engine

    engine = Engine.load("demo", mode=args.mode)
    engine.eos_ids = set()  # every answer is max_tokens long: equal work on both paths
    server = ServerThread(lambda: engine, lambda: "demo", port=0, max_waiting=max(64, args.requests)).start()
    http = httpx.Client(timeout=600)
    try:
        direct_request(engine, PROMPTS[0], 4)  # warm-up both paths
        served_request(http, server.url, PROMPTS[0], 4)
        ratios, direct_s, served_s, direct_ttft, served_ttft = [], [], [], [], []
        for _ in range(args.rounds):
            d = [direct_request(engine, p, args.max_tokens) for p in PROMPTS[:8]]
            s = [served_request(http, server.url, p, args.max_tokens) for p in PROMPTS[:8]]
            d_total, s_total = sum(x[1] for x in d), sum(x[1] for x in s)
            ratios.append(s_total / d_total - 1)
            direct_s.append(d_total / len(d))
            served_s.append(s_total / len(s))
            direct_ttft += [x[0] for x in d]
            served_ttft += [x[0] for x in s]

        levels = []
        for n in [int(c) for c in args.clients.split(",") if c.strip()]:
            results: list[tuple[float, float]] = []
            lock = threading.Lock()
            todo = list(range(args.requests))

            def client() -> None:
                with httpx.Client(timeout=600) as own:
                    while True:
                        with lock:
                            if not todo:
                                return
                            i = todo.pop()
                        r = served_request(own, server.url, PROMPTS[i % len(PROMPTS)], args.max_tokens)
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
                           "tokens_per_s": round(len(results) * args.max_tokens / wall, 1),
                           "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
                           "latency_p50_s": round(percentile([r[1] for r in results], 50), 4)})
    finally:
        http.close()
        server.stop()

    result = {
        "model": "demo", "mode": args.mode, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "direct_request_s": round(statistics.median(direct_s), 4),
        "served_request_s": round(statistics.median(served_s), 4),
        "direct_ttft_p50_s": round(percentile(direct_ttft, 50), 4),
        "served_ttft_p50_s": round(percentile(served_ttft, 50), 4),
        "overhead_one_client": round(statistics.median(ratios), 4),
        "overhead_per_round": [round(r, 4) for r in ratios],
        "overhead_goal": 0.05,
        "concurrency": levels,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
