"""`/metrics` in Prometheus' text format, through prometheus_client (what llama-server and vLLM
expose): requests by route and status, prompt and generated tokens, the queue, time to first
token, decode speed and the whole request's time.

Each server has its own registry (the window may start and stop one many times in a process;
the tests run several at once), so the figures are that server's since it started.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "thermocline"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class ServerMetrics:
    """The counters one server keeps; `observe` is called once per finished generation."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens read (cached ones included)",
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(f"{PREFIX}_generations", "Generations finished, by finish reason", ["reason"],
                                registry=r)
        self.queue = Gauge(f"{PREFIX}_queue_depth", "Requests waiting or running on the engine", registry=r)
        self.queue.set_function(queue_depth)
        if running is not None:
            self.running = Gauge(f"{PREFIX}_running_requests", "Requests decoding now", registry=r)
            self.running.set_function(running)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token (queue included)",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.decode_speed = Histogram(f"{PREFIX}_decode_tokens_per_second", "Decode speed of each generation",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds", "Arrival to last token",
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)

    def request(self, path: str, status: int) -> None:
        route = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        self.requests.labels(route=route, status=str(status or "closed")).inc()

    def observe(self, stats: dict, first_token_s: float, total_s: float) -> None:
        """One generation's figures (`stats`: engine.GenerationStats.to_dict()); the times from
        the request's arrival to its first token and to its last."""
        self.prompt_tokens.inc(int(stats.get("prompt_tokens", 0)))
        self.generation_tokens.inc(int(stats.get("new_tokens", 0)))
        self.finished.labels(reason=str(stats.get("finish_reason", "unknown"))).inc()
        self.ttft.observe(first_token_s)
        if stats.get("decode_tok_s"):
            self.decode_speed.observe(float(stats["decode_tok_s"]))
        self.latency.observe(total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
