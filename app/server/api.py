"""The OpenAI-compatible HTTP API on Starlette: models, chat and text completions, health.

Every answer that is not a success is an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`), including malformed JSON, unknown
routes and bugs: nothing a client sends brings the server down. With an API key set, every
request must carry `Authorization: Bearer KEY`; the key is never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .gate import GateFull, GenerationGate, Job
from .guard import RequestGuard
from .metrics import ServerMetrics
from .protocol import ApiError, GenerationRequest, bad_request, parse_chat, parse_completion, parse_json_body

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"; only the log sees it
FINISH_REASONS = {"stop": "stop", "length": "length", "context_full": "length", "cancelled": "stop"}
# Our figures, added to each response next to OpenAI's `usage`.
FIGURES = ("ttft_s", "prefill_tok_s", "decode_tok_s", "ffn_active_fraction", "hot_hit_fraction", "mode",
           "cached_tokens", "device")


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class ServerState:
    """What the routes share: the engine (through a getter: the window swaps models), the gate."""

    def __init__(self, get_engine: Callable[[], Any], get_model_id: Callable[[], str | None], *,
                 api_key: str | None = None, max_waiting: int = 8, max_batch: int = 8,
                 on_request: Callable[[str], None] | None = None):
        self.get_engine, self.get_model_id = get_engine, get_model_id
        self.api_key = api_key or None
        self.gate = GenerationGate(get_engine, max_waiting, max_batch)
        self.metrics = ServerMetrics(lambda: self.gate.outstanding, lambda: self.gate.running)
        self.on_request = on_request
        self.created = int(time.time())


def build_app(get_engine: Callable[[], Any], get_model_id: Callable[[], str | None], *,
              api_key: str | None = None, max_waiting: int = 8, max_batch: int = 8,
              on_request: Callable[[str], None] | None = None, host: str = "127.0.0.1",
              allowed_origins: tuple[str, ...] | list[str] = ()) -> "_Middleware":
    """The ASGI application behind its request guard (Host, Origin, content type, body size:
    guard.py). `on_request` receives one log line per call (never the key)."""
    state = ServerState(get_engine, get_model_id, api_key=api_key, max_waiting=max_waiting, max_batch=max_batch,
                        on_request=on_request)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": state.get_model_id(),
                             "loaded": state.get_engine() is not None, "queued": state.gate.outstanding})

    async def list_models(request: Request) -> Response:
        model_id = state.get_model_id()
        engine = state.get_engine()
        data = [_model_card(model_id, state.created, engine)] if model_id and engine is not None else []
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        wanted = request.path_params["model_id"]
        engine = state.get_engine()
        if wanted != state.get_model_id() or engine is None:
            raise _model_not_found(wanted, state.get_model_id())
        return JSONResponse(_model_card(wanted, state.created, engine))

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    async def chat(request: Request) -> Response:
        return await _serve(state, request, parse_chat(await _json_body(request)), "chat")

    async def completions(request: Request) -> Response:
        return await _serve(state, request, parse_completion(await _json_body(request)), "text")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]

    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, message, type=kind))

    async def gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the log line says so

    async def crash(request: Request, exc: Exception) -> Response:
        log.exception("request %s %s failed", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {exc.__class__.__name__}: {exc}", type="server_error"))

    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                       ClientDisconnect: gone, Exception: crash})
    return _Middleware(RequestGuard(app, bound_host=host, allowed_origins=allowed_origins), state)


def _model_card(model_id: str, created: int, engine) -> dict:
    # max_model_len: vLLM's field for the context length; remote clients (ours too) read it.
    return {"id": model_id, "object": "model", "created": created, "owned_by": "thermocline",
            "max_model_len": int(getattr(engine, "ctx", 0) or 0) or None}


def _model_not_found(wanted: str, served: str | None) -> ApiError:
    return ApiError(404, f"the model '{wanted}' does not exist here; this server runs '{served}'",
                    param="model", code="model_not_found", type="not_found_error")


async def _json_body(request: Request) -> Any:
    # The guard (guard.py) has checked the type and length already, and counts the body as it comes.
    return parse_json_body(await request.body())


async def _watch_disconnect(request: Request, cancel) -> None:
    """Set `cancel` when the client goes away (the body is read already: the next message is that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


def _sampling(engine, req: GenerationRequest):
    from engine import SamplingParams, UserError
    from engine.runtime.constraints import GrammarSpec

    values = {**getattr(engine, "generation_defaults", {}), **req.sampling_values()}
    vocab = getattr(getattr(engine, "config", None), "vocab_size", None)
    outside = [t for t in values.get("logit_bias") or {} if vocab is not None and t >= vocab]
    if outside:
        raise bad_request(f"'logit_bias' names token {outside[0]}, outside the model's vocabulary of {vocab}",
                          "logit_bias", "invalid_value")
    # No max_tokens on a chat: answer until the model stops or the context is full.
    max_new = req.max_tokens if req.max_tokens is not None else int(getattr(engine, "ctx", 2048))
    params = SamplingParams(max_new_tokens=max_new, seed=req.seed, stop=list(req.stop), **values)
    try:
        params.validate()
    except UserError as exc:
        raise bad_request(str(exc)) from None
    if req.response_schema is not None:
        params.grammar = _grammar(engine, GrammarSpec.json_schema(req.response_schema), "response_format")
    return params


def _prepare(engine, req: GenerationRequest, kind: str):
    """The sampling parameters (a grammar compiled where the request asks for one) and the tool plan."""
    params = _sampling(engine, req)
    return params, (_tool_plan(engine, req, params) if kind == "chat" else None)


def _grammar(engine, spec, field: str):
    """`spec`, once the engine's grammar library has compiled it; a 400 naming `field` if not."""
    from engine.errors import UserError

    try:
        engine.check_grammar(spec)
    except UserError as exc:
        raise bad_request(f"'{field}': {exc}", field, "invalid_schema") from None
    return spec


@dataclass
class ToolPlan:
    """How one chat request's answer becomes tool calls: "constrained" (tool_choice required or a
    named function: the answer is call_schema's JSON) or "auto" (read for the template's format)."""
    mode: str
    names: list[str]
    template_tools: list[dict] | None  # what the chat template receives (None: it takes no tools)
    fmt: Any = None  # tools.CallFormat, for "auto"
    single: bool = False  # parallel_tool_calls false: at most one call


def _tool_plan(engine, req: GenerationRequest, params) -> ToolPlan | None:
    from engine.runtime.constraints import GrammarSpec

    from .tools import call_schema, for_template, strict_auto_grammar, template_format

    tokenizer = getattr(engine, "tokenizer", None)
    aware = bool(getattr(tokenizer, "takes_tools", False))
    req.prompt = for_template(req.prompt, aware)
    tr = req.tools
    if tr is None or tr.choice == "none":
        return None
    shown = tr.tools if aware else None
    if tr.choice == "auto":
        where = getattr(tokenizer, "template_name", "the model's chat template")
        if not aware:
            raise bad_request(f"tool_choice 'auto' needs a chat template that takes tools, and {where} takes none: "
                              "send tool_choice 'required' or name a function (the answer is then constrained "
                              "to a call)", "tool_choice", "unsupported")
        fmt = template_format(tokenizer.template_source)
        if fmt is None:
            raise bad_request(f"tool_choice 'auto': {where} takes tools but writes calls in a format this server "
                              "does not read (it reads <tool_call>, [TOOL_CALLS] and Llama 3's JSON); send "
                              "tool_choice 'required' or name a function", "tool_choice", "unsupported")
        grammar = strict_auto_grammar(tr, fmt)
        if grammar is not None:  # a strict function: its calls are held to its schema while decoding
            if req.response_schema is not None:
                raise bad_request("'response_format' and a strict tool both constrain the answer: send one",
                                  "response_format", "invalid_value")
            params.grammar = _grammar(engine, GrammarSpec.lark(grammar), "tools")
        return ToolPlan("auto", tr.names, shown, fmt, single=not tr.parallel)
    if req.response_schema is not None:
        raise bad_request("'response_format' and a required tool call both constrain the answer: send one",
                          "response_format", "invalid_value")
    params.grammar = _grammar(engine, GrammarSpec.json_schema(call_schema(tr)), "tools")
    return ToolPlan("constrained", tr.names, shown)


def _tool_calls(plan: ToolPlan | None, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer."""
    from .tools import constrained_calls, parse_template_calls

    if plan is None:
        return text, []
    if plan.mode == "constrained":
        try:
            return None, constrained_calls(text)
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: the text as it is
            return text, []
    return parse_template_calls(text, plan.fmt, plan.names, plan.single)


def _engine_error(exc: BaseException) -> ApiError:
    from engine.errors import ContextFullError, UserError

    if isinstance(exc, ContextFullError):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, UserError):
        return bad_request(str(exc))
    if isinstance(exc, RuntimeError) and str(exc) == "no model is loaded":
        return ApiError(503, "no model is loaded; load one in the window first", type="server_error")
    return ApiError(500, f"generation failed: {exc.__class__.__name__}: {exc}", type="server_error")


def _usage(stats: dict) -> dict:
    prompt, new = int(stats.get("prompt_tokens", 0)), int(stats.get("new_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def _figures(stats: dict, queue_s: float) -> dict:
    figures = {k: stats[k] for k in FIGURES if k in stats}
    figures["queue_s"] = queue_s
    return figures


async def _serve(state: ServerState, request: Request, req: GenerationRequest, kind: str) -> Response:
    engine, model_id = state.get_engine(), state.get_model_id()
    if engine is None:
        raise ApiError(503, "no model is loaded; load one in the window first", type="server_error")
    if req.model is not None and req.model != model_id:
        raise _model_not_found(req.model, model_id)
    arrived = time.perf_counter()
    # Off the event loop: a grammar (the tokenizer's view at the first constrained request, a
    # big schema's compile) takes its time there while every other request goes on.
    params, plan = await asyncio.to_thread(_prepare, engine, req, kind)
    job = Job(req.prompt, params, asyncio.get_running_loop(), tools=plan.template_tools if plan else None)
    try:
        state.gate.submit(job)
    except GateFull as exc:
        raise ApiError(429, f"{exc}; retry shortly", type="requests", code="rate_limit_exceeded") from None
    watcher = asyncio.create_task(_watch_disconnect(request, job.cancel))
    try:
        first = await job.events.get()
    except BaseException:
        job.cancel.set()
        watcher.cancel()
        raise
    if first[0] == "cancelled":  # the client hung up while it waited; nobody reads this answer
        watcher.cancel()
        return Response(status_code=CLIENT_CLOSED)
    if first[0] == "error":
        watcher.cancel()
        raise _engine_error(first[1])
    queue_s = time.perf_counter() - arrived
    reply = _Reply(kind, model_id, request.scope, plan)
    if req.stream:
        watcher.cancel()  # from here the streaming response notices the disconnect itself
        def done(stats: dict) -> None:
            state.metrics.observe(stats, queue_s, time.perf_counter() - arrived)

        return StreamingResponse(_sse(job, first, reply, req, queue_s, done), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        text, event = [], first
        while event[0] == "token":
            text.append(event[1])
            event = await job.events.get()
    finally:
        job.cancel.set()  # a no-op once done; stops the engine if this request is torn down
        watcher.cancel()
    if event[0] == "error":
        raise _engine_error(event[1])
    stats = event[1]["stats"]
    reply.note(stats, stream=False)
    state.metrics.observe(stats, queue_s, time.perf_counter() - arrived)
    return JSONResponse(reply.whole("".join(text), stats, queue_s))


class _Reply:
    """Builds the chat or text completion bodies of one request, whole or as chunks."""

    def __init__(self, kind: str, model_id: str | None, scope: dict, plan: ToolPlan | None = None):
        self.kind, self.model, self.scope, self.plan = kind, model_id, scope, plan
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def note(self, stats: dict, stream: bool) -> None:
        """What the request log line says about this call."""
        self.scope.setdefault("state", {})["thermocline_log"] = (
            f"{stats.get('prompt_tokens', 0)}+{stats.get('new_tokens', 0)} tokens "
            f"{stats.get('finish_reason', '')}{' stream' if stream else ''}")

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, stats: dict, queue_s: float) -> dict:
        finish = FINISH_REASONS.get(stats.get("finish_reason"), "stop")
        if self.kind == "chat":
            body = self._head("chat.completion")
            content, calls = _tool_calls(self.plan, text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
            body["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]
        else:
            body = self._head("text_completion")
            body["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        body["usage"] = _usage(stats)
        body["thermocline"] = _figures(stats, queue_s)
        return body

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False, usage: bool = False,
              calls: list[dict] | None = None) -> dict:
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta = {} if text is None else {"content": text}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            if first:
                delta["role"] = "assistant"
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            body = self._head("text_completion")
            body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        if usage:
            body["usage"] = None
        return body


def _data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _sse(job: Job, first: tuple, reply: _Reply, req: GenerationRequest, queue_s: float,
               done: Callable[[dict], None]) -> AsyncIterator[bytes]:
    usage = req.include_usage
    try:
        if reply.kind == "chat":  # OpenAI opens a chat stream with the role
            yield _data(reply.chunk("", None, first=True, usage=usage))
        event, held = first, _Held(reply.plan)
        while event[0] == "token":
            piece = held.push(event[1])
            if piece:
                yield _data(reply.chunk(piece, None, usage=usage))
            event = await job.events.get()
        if event[0] == "error":
            yield _data(_engine_error(event[1]).body())
            return
        stats = event[1]["stats"]
        reply.note(stats, stream=True)
        done(stats)
        finish = FINISH_REASONS.get(stats.get("finish_reason"), "stop")
        content, calls = held.end()
        if content:
            yield _data(reply.chunk(content, None, usage=usage))
        if calls:
            yield _data(reply.chunk(None, None, usage=usage, calls=calls))
            finish = "tool_calls"
        yield _data(reply.chunk(None, finish, usage=usage))
        if usage:
            tail = reply.chunk(None, None)
            tail["choices"] = []
            tail["usage"] = _usage(stats)
            tail["thermocline"] = _figures(stats, queue_s)
            yield _data(tail)
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel.set()  # the client left (or the stream ended): the engine stops at its next token


class _Held:
    """A streamed answer that may be tool calls: held back while it may still become calls,
    passed on as content from the moment it cannot."""

    def __init__(self, plan: ToolPlan | None):
        self.plan, self.text, self.holding = plan, "", plan is not None

    def push(self, piece: str) -> str:
        """What to send now of the answer's next piece."""
        if not self.holding:
            return piece
        self.text += piece
        from .tools import may_become_call

        if self.plan.mode == "auto" and not may_become_call(self.text, self.plan.fmt):
            self.holding = False
            return self.text
        return ""

    def end(self) -> tuple[str | None, list[dict]]:
        """The content still held and the tool calls, once the answer is whole."""
        if not self.holding:
            return None, []
        return _tool_calls(self.plan, self.text)


class _Middleware:
    """Checks the API key, and writes one log line per call (with the status it got)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state  # `state`: the gate, the key, the engine getter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [0]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.state.api_key and not self._authorized(scope):
                exc = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key")
                await error_response(exc)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.request(scope.get("path", ""), status[0])
            self._log(scope, status[0], time.perf_counter() - start)

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.state.api_key.encode())

    def _log(self, scope, status: int, elapsed: float) -> None:
        detail = (scope.get("state") or {}).get("thermocline_log", "")
        client = scope.get("client") or ("?", 0)
        line = (f"{time.strftime('%H:%M:%S')} {client[0]} {scope.get('method')} {scope.get('path')} "
                f"{status or 'closed'} {elapsed:.2f}s {detail}").rstrip()
        log.info("%s", line)
        if self.state.on_request is not None:
            try:
                self.state.on_request(line)
            except Exception:
                log.exception("request log sink failed")
