"""A model that runs elsewhere: any OpenAI-compatible server, used like a local engine.

`RemoteEngine` has the surface the CLI, the server and the window use (`stream`,
`generate`, `last_stats`, `ctx`, `mode`, `memory`, `reset`), so `remote/NAME` chats,
generates and regenerates like a local model. Tokens arrive as Server-Sent Events; TTFT
and tok/s are measured here, on our side of the network. Every failure becomes a
`RemoteError` that says what happened and what to do; when the stream breaks after some
text, `RemoteInterrupted` carries the partial answer.

No tensors here; the API key is only ever sent in the Authorization header.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

from engine.runtime.engine import GenerationResult, GenerationStats, TokenEvent
from engine.runtime.context_policy import Fitted
from engine.errors import RemoteError, RemoteInterrupted, UserError
from engine.runtime.sampling import SamplingParams

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # a long prefill on a big remote model may take minutes before the first token

__all__ = ["RemoteEngine", "RemoteError", "RemoteInterrupted"]
EXTENSIONS = ("top_k", "min_p", "repetition_penalty")  # sampling fields beyond OpenAI's own


class RemoteEngine:
    remote = True
    mode = "remote"
    sparse = None
    generation_defaults: dict = {}

    def __init__(self, remote, api_key: str | None, ctx: int | None = None, timeout: float = READ_TIMEOUT_S):
        import httpx

        self.remote, self.spec = True, remote.id
        self.entry = remote
        self.url = remote.url.rstrip("/")
        self.model_id = remote.model
        self.model_dir = Path(remote.id)  # what the CLI prints as the model's name
        self.ctx = ctx or 0
        self._key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
        self.last_stats = GenerationStats(mode=self.mode, device="remote")
        self.last_text, self.last_token_ids = "", []
        self._lock = threading.RLock()  # re-entered by the one retry without extensions
        self._plain = False  # True once the server refused our sampling extensions

    def __repr__(self) -> str:  # never the key
        return f"RemoteEngine({self.spec} at {self.url})"

    # ------------------------------------------------------------------ loading
    @classmethod
    def connect(cls, remote, api_key: str | None, ctx: int | None = None) -> "RemoteEngine":
        """Ask the server of a registry entry (`models_registry.remotes.get_remote`) which models
        it has (fails fast); the caller looked the entry and its key up."""
        engine = cls(remote, api_key, ctx)
        engine._check_model()
        return engine

    def _check_model(self) -> None:
        response = self._request("GET", "/models")
        try:
            data = response.json().get("data") or []
            ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ValueError, AttributeError, KeyError, TypeError):
            raise RemoteError(f"{self.spec}: {self.url}/models did not answer like an OpenAI API server; "
                              "check the URL (it usually ends in /v1)") from None
        if self.model_id is None:
            if not ids:
                raise RemoteError(f"{self.spec}: the server at {self.url} lists no models; "
                                  "load one there, or name it with --model")
            self.model_id = ids[0]
        elif ids and self.model_id not in ids:
            raise RemoteError(f"{self.spec}: the server has no model {self.model_id!r} (it has "
                              f"{', '.join(ids[:5])}); fix it with `thermocline models add-remote "
                              f"{self.entry.name} --url {self.url} --model ID`")
        card = next((m for m in data if isinstance(m, dict) and m.get("id") == self.model_id), {})
        max_len = card.get("max_model_len")  # vLLM says how long its context is
        if not self.ctx and isinstance(max_len, int) and max_len > 0:
            self.ctx = max_len
        self.ctx = self.ctx or 2048

    # ------------------------------------------------------------------ HTTP
    def _what_to_do(self, status: int, detail: str) -> str:
        name = self.spec
        if status in (401, 403):
            env = self.entry.api_key_env
            where = (f"${env}" + (" is not set" if not self._key else " holds a key the server refused")) if env \
                else "no key is configured (add one with --api-key-env VAR or the OS keyring)"
            return f"{name}: the server refused the API key ({status}: {detail}); {where}"
        if status == 404:
            return (f"{name}: the server has no model {self.model_id!r} or no such endpoint (404: {detail}); "
                    f"check the URL {self.url} and the model id")
        if status == 429:
            return f"{name}: the server is busy (429: {detail}); try again in a moment"
        if status >= 500:
            return f"{name}: the server failed ({status}: {detail}); check its log, then try again"
        return f"{name}: the server rejected the request ({status}: {detail})"

    @staticmethod
    def _detail(body: bytes) -> str:
        try:
            err = json.loads(body).get("error")
            message = err.get("message") if isinstance(err, dict) else err
            if message:
                return str(message)[:300]
        except (ValueError, AttributeError):
            pass
        text = body.decode("utf-8", "replace").strip()
        return text[:300] or "no details"

    def _unreachable(self, exc: Exception) -> RemoteError:
        return RemoteError(f"{self.spec}: cannot reach {self.url} ({exc.__class__.__name__}: {exc}); "
                           "is the server running, and is the URL right?")

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        try:
            response = self._http.request(method, self.url + path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 400:
            raise RemoteError(self._what_to_do(response.status_code, self._detail(response.content)))
        return response

    # --------------------------------------------------------------- generation
    def _body(self, prompt, params: SamplingParams) -> tuple[str, dict]:
        body: dict = {"model": self.model_id, "stream": True, "stream_options": {"include_usage": True},
                      # vLLM refuses max_tokens beyond its context (max_model_len) with a 400; it
                      # shortens one that only overruns with the prompt, as the answer then ends there
                      "max_tokens": min(params.max_new_tokens, self.ctx) if self.ctx else params.max_new_tokens,
                      "temperature": params.temperature,
                      "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)[:4]
        if params.presence_penalty:  # OpenAI's own fields, with OpenAI's definitions
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        if params.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
        if params.grammar is not None:  # the remote server constrains the answer itself
            if params.grammar.kind != "json_schema":
                raise UserError("a remote model takes a JSON schema as its answer's constraint, not a grammar")
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": json.loads(params.grammar.source)}}
        # Extensions that vLLM, llama.cpp and Thermocline accept; sent only when they change anything,
        # and no more once a server has refused them (OpenAI's own API rejects unknown fields).
        if self._plain:
            pass
        elif params.top_k:
            body["top_k"] = params.top_k
        if params.min_p and not self._plain:
            body["min_p"] = params.min_p
        if params.repetition_penalty != 1.0 and not self._plain:
            body["repetition_penalty"] = params.repetition_penalty
        if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], dict)):
            body["prompt"] = prompt
            return "/completions", body
        body["messages"] = [{"role": m["role"], "content": m["content"]} for m in prompt]
        return "/chat/completions", body

    def reset(self) -> None:
        """Nothing is cached here; the server keeps (or not) its own prefix cache."""

    def fit(self, messages: list[dict], policy: str = "truncate", max_new_tokens: int | None = None,
            previous_drop: int = 0) -> Fitted:
        """`Engine.fit` for a remote model: its tokenizer and context are on its server, which
        counts (and refuses or trims) the conversation; every message is sent, uncounted."""
        return Fitted(list(messages), None, 0, True)

    def stream(self, prompt, params: SamplingParams | None = None,
               cancel: threading.Event | None = None) -> Iterator[TokenEvent]:
        import httpx

        params = params or SamplingParams()
        params.validate()
        if not prompt:
            raise UserError("the prompt is empty")
        path, body = self._body(prompt, params)
        stats = GenerationStats(mode=self.mode, device="remote", finish_reason="length")
        self.last_stats, self.last_text, self.last_token_ids = stats, "", []
        text: list[str] = []
        start = time.perf_counter()
        first = None
        finish = None
        chunks = 0
        with self._lock:
            try:
                with self._http.stream("POST", self.url + path, json=body) as response:
                    if response.status_code == 400 and not self._plain and set(body) & set(EXTENSIONS):
                        detail = self._detail(response.read())
                        if any(name in detail for name in EXTENSIONS):
                            self._plain = True  # ask again with OpenAI's own fields only
                            response.close()
                            yield from self.stream(prompt, params, cancel)
                            return
                    if response.status_code >= 400:
                        raise RemoteError(self._what_to_do(response.status_code, self._detail(response.read())))
                    done = False
                    for data in _sse_data(response.iter_lines()):
                        if data == "[DONE]":
                            done = True
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            raise RemoteInterrupted(f"{self.spec}: the server sent a broken event ({data[:80]!r})",
                                                    "".join(text)) from None
                        if isinstance(chunk, dict) and chunk.get("error"):
                            raise RemoteInterrupted(f"{self.spec}: the server stopped with an error: "
                                                    f"{self._detail(data.encode())}", "".join(text))
                        usage = chunk.get("usage") if isinstance(chunk, dict) else None
                        if isinstance(usage, dict):
                            stats.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            stats.new_tokens = int(usage.get("completion_tokens") or 0)
                        for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
                            piece = _choice_text(choice)
                            if choice.get("finish_reason"):
                                finish = choice["finish_reason"]
                            if piece:
                                now = time.perf_counter()
                                if first is None:
                                    first = now
                                    stats.ttft_s = now - start
                                chunks += 1
                                text.append(piece)
                                yield TokenEvent(piece, -1, chunks - 1)
                        if cancel is not None and cancel.is_set():
                            stats.finish_reason = "cancelled"
                            return  # leaving the block closes the connection; the server stops too
                    if not done and finish is None:
                        raise RemoteInterrupted(f"{self.spec}: the connection closed before the answer ended; "
                                                "the partial answer is kept", "".join(text))
                    stats.finish_reason = {"length": "length"}.get(finish, "stop")
            except httpx.TransportError as exc:
                if first is None and not text:
                    raise self._unreachable(exc) from None
                stats.finish_reason = "interrupted"
                raise RemoteInterrupted(f"{self.spec}: the connection broke midway ({exc.__class__.__name__}); "
                                        "the partial answer is kept", "".join(text)) from None
            except RemoteInterrupted:
                stats.finish_reason = "interrupted"
                raise
            finally:
                end = time.perf_counter()
                stats.new_tokens = stats.new_tokens or chunks
                if first is not None and end > first and stats.new_tokens > 1:
                    stats.decode_tok_s = (stats.new_tokens - 1) / (end - first)
                if self.last_stats is stats:  # not when a retry took over
                    self.last_text = "".join(text)

    def generate(self, prompt, params: SamplingParams | None = None,
                 cancel: threading.Event | None = None) -> GenerationResult:
        text = "".join(e.text for e in self.stream(prompt, params, cancel))
        return GenerationResult(text, [], self.last_stats)

    # -------------------------------------------------------------- inspection
    def memory(self) -> dict:
        return {"vram_bytes": 0, "ram_bytes": 0, "device": "remote"}

    def close(self) -> None:
        self._http.close()


def _choice_text(choice: dict) -> str:
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data:` payloads of a Server-Sent Events stream (multi-line data joined)."""
    buffer: list[str] = []
    for line in lines:
        if not line:
            if buffer:
                yield "\n".join(buffer)
                buffer = []
            continue
        if line.startswith(":"):
            continue  # a comment (keep-alive)
        field, _, value = line.partition(":")
        if field == "data":
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\n".join(buffer)
