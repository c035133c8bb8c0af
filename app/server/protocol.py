"""OpenAI request bodies checked into plain values, and OpenAI-style error bodies.

Every field a client sends is either honoured or refused with a 400 that names it: a
silently ignored field is a 200 with a wrong answer (tools that never get called, "JSON"
that is free text). Known fields are type-checked (a wrong type is a 400 naming the field);
fields that only describe the caller (`user`, `metadata`, ...) are accepted, fields whose
feature this server lacks are refused unless they ask for the default, and a field no API
defines is refused as unknown (a typo would otherwise pass for a default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, bad_request, check_json_schema
from .tools import history_message, parse_tools

__all__ = ["ApiError", "bad_request", "check_json_schema", "GenerationRequest", "parse_chat", "parse_completion",
           "parse_json_body"]

MAX_JSON_DEPTH = 64  # far more than any OpenAI body (tool schemas included) needs
MAX_INT = 2 ** 63 - 1  # every integer field fits a signed 64-bit int


@dataclass
class GenerationRequest:
    """What one chat or completion request asks of the engine."""
    prompt: str | list[dict] | list[int]  # text (completions), messages (chat) or token ids
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    # response_format json_object / json_schema: the JSON schema the answer is constrained to
    response_schema: dict | bool | None = None
    tools: Any = None  # app.server.tools.ToolRequest: the functions offered and tool_choice
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the client set (the model's defaults fill the rest)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def parse_json_body(body: bytes) -> Any:
    """A request body as JSON: NaN, Infinity and numbers beyond a float are refused, and so
    is nesting deeper than MAX_JSON_DEPTH (checked without recursion)."""
    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:40]} is too large")
        return value

    try:
        value = json.loads(body, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return value


def _depth(value: Any) -> int:
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _shown(value: Any) -> str:
    """A client's value quoted in an error message, never echoed at length."""
    text = repr(value)
    return text if len(text) <= 80 else text[:70] + "..."


def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None,
            integer: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be {kind}, not {_shown(value)}", name, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):  # the parser refuses them; a caller may not
        raise bad_request(f"'{name}' must be a finite number, not {value}", name, "invalid_value")
    if integer and (value != int(value) or abs(value) > MAX_INT):
        raise bad_request(f"'{name}' must be {kind} of at most 64 bits, not {_shown(value)}", name, "invalid_type")
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad_request(f"'{name}' must be {bounds}, got {_shown(value)}", name, "invalid_value")
    return int(value) if integer else float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, not {_shown(value)}", name, "invalid_type")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(value) > 4:
        raise bad_request("'stop' takes at most 4 strings", "stop", "invalid_value")
    return [s for s in value if s]


# The fields each endpoint reads (OpenAI's, and the sampling extensions vLLM and llama-server
# take: top_k, min_p, repetition_penalty).
_SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "stream",
                    "stream_options", "n", "logprobs", "response_format"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                  "parallel_tool_calls"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "best_of", "suffix"}
# Fields that describe the caller or ask for bookkeeping that changes no answer: accepted as
# they are (`prediction` is a latency hint: the answer is the model's either way).
CALLER_FIELDS = {"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier", "prediction"}
# Features this server does not have: accepted only when they ask for the default, refused
# with a 400 naming the field otherwise. Each value: (is the default?, what to tell the client).
_UNSUPPORTED = {
    "functions": (lambda v: v in ([],), "the deprecated 'functions' field is not supported; send 'tools'"),
    "function_call": (lambda v: v == "none", "the deprecated 'function_call' field is not supported; "
                      "send 'tool_choice'"),
    "store": (lambda v: v is False, "this server stores no completions ('store' must be false)"),
    "modalities": (lambda v: v == ["text"], "this server answers text only ('modalities' must be [\"text\"])"),
    "audio": (lambda v: False, "this server has no audio output"),
    "reasoning_effort": (lambda v: False, "the model has no reasoning effort to set"),
    "verbosity": (lambda v: False, "the model has no verbosity to set"),
    "web_search_options": (lambda v: False, "this server has no web search"),
}


def check_fields(body: dict, known: set[str]) -> None:
    """Refuse (400, naming it) each field that this endpoint would otherwise ignore."""
    for name, value in body.items():
        if value is None or name in known or name in CALLER_FIELDS:
            continue
        if name in _UNSUPPORTED:
            is_default, why = _UNSUPPORTED[name]
            if not is_default(value):
                raise bad_request(f"'{name}': {why}", name, "unsupported")
            continue
        raise bad_request(f"unknown field '{_shown(name)[1:-1]}': this server does not know what it asks for",
                          name, "unknown_field")


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object ({kind})")
    check_fields(body, CHAT_FIELDS if kind == "chat completion" else COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    n = _number(body, "n", 1, integer=True)
    if n not in (None, 1):
        raise bad_request("this server returns one choice per request ('n' must be 1)", "n", "invalid_value")
    for name in ("logprobs", "top_logprobs", "echo", "suffix"):
        if body.get(name) not in (None, False, 0, ""):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported")
    if _number(body, "best_of", 1, integer=True) not in (None, 1):
        raise bad_request("this server returns one choice per request ('best_of' must be 1)", "best_of",
                          "invalid_value")
    include_usage = _stream_options(body)
    # OpenAI's newer name for the answer's length wins over the old one.
    max_tokens = _number(body, "max_completion_tokens", 1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, integer=True)
    seed = _number(body, "seed", integer=True)
    return dict(
        model=model, max_tokens=max_tokens, seed=seed, stop=_stop(body), stream=_bool(body, "stream"),
        include_usage=include_usage, temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1), top_k=_number(body, "top_k", 0, integer=True),
        min_p=_number(body, "min_p", 0, 1), repetition_penalty=_number(body, "repetition_penalty", 0.01, 10),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2), logit_bias=_logit_bias(body),
        response_schema=_response_format(body),
    )


def _stream_options(body: dict) -> bool:
    """Whether a streamed answer ends with a usage chunk (`stream_options.include_usage`, as
    OpenAI's: only when asked). OpenAI takes `stream_options` only with `stream: true`; each of
    its keys is honoured or refused by name (`include_obfuscation`: this server pads no chunks,
    so only false, the answer it gives, is taken)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    if not _bool(body, "stream"):
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options",
                          "invalid_value")
    for key, value in options.items():
        if key == "include_usage" or value is None:
            continue
        if key == "include_obfuscation":
            if _bool(options, key):
                raise bad_request("'stream_options.include_obfuscation': this server pads no chunks; send false",
                                  "stream_options.include_obfuscation", "unsupported")
            continue
        raise bad_request(f"'stream_options.{_shown(key)[1:-1]}' is not an option this server knows "
                          "(it takes include_usage)", f"stream_options.{key}", "unknown_field")
    return _bool(options, "include_usage")


ANY_OBJECT = {"type": "object"}  # JSON mode: an object, as OpenAI's json_object promises


def _response_format(body: dict) -> dict | bool | None:
    """The schema response_format asks the answer to match (None: free text)."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema, not {_shown(kind)}",
                          "response_format.type", "invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with a 'schema'",
                          "response_format.json_schema", "invalid_type")
    for key in spec:
        if key not in ("name", "schema", "strict", "description"):
            raise bad_request(f"'response_format.json_schema.{_shown(key)[1:-1]}' is not a field of a JSON schema "
                              "format", "response_format.json_schema", "unknown_field")
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, (dict, bool)):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema (an object)",
                          "response_format.json_schema.schema", "invalid_type")
    check_json_schema(schema, "response_format.json_schema.schema")
    return schema


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's map of token ids (JSON keys: strings of digits) to a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    if len(value) > 1024:
        raise bad_request("'logit_bias' takes at most 1024 tokens", "logit_bias", "invalid_value")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            raise bad_request(f"'logit_bias' keys must be token ids, not {_shown(key)}", "logit_bias", "invalid_value")
        bias[int(key)] = _number({"logit_bias": number}, "logit_bias", -100, 100)
    return bias


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# What a message may carry; `refusal` is an assistant's earlier refusal text (`_refusal`).
MESSAGE_FIELDS = {"role", "content", "name", "refusal", "tool_calls", "tool_call_id"}


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are understood
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  f"messages[{i}].content", "unsupported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content", "invalid_type")


def _refusal(m: dict, i: int, content: str) -> str:
    """An assistant turn's content as the model reads it: OpenAI sends an earlier refusal in
    `refusal` with no content; that text is what the assistant said, so the template gets it
    (after the content, when both are sent)."""
    refusal = m.get("refusal")
    if refusal is None:
        return content
    if not isinstance(refusal, str):
        raise bad_request(f"messages[{i}].refusal must be a string", f"messages[{i}].refusal", "invalid_type")
    if m.get("role") != "assistant":
        raise bad_request(f"messages[{i}].refusal belongs to an assistant message", f"messages[{i}].refusal",
                          "invalid_value")
    return f"{content}\n{refusal}" if content and refusal else content or refusal


def parse_chat(body: Any) -> GenerationRequest:
    values = _common(body, "chat completion")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages",
                          "invalid_type" if messages is not None else "missing")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {_shown(role)}",
                              f"messages[{i}].role", "invalid_value")
        for key, value in m.items():
            if key not in MESSAGE_FIELDS and value is not None:
                raise bad_request(f"messages[{i}].{_shown(key)[1:-1]}: this server does not take that field "
                                  "in a message", f"messages[{i}].{key}", "unsupported")
        message = history_message(m, i, ROLES[role], _refusal(m, i, _content_text(m.get("content"), i)))
        name = m.get("name")
        if name is not None:  # the template may show who spoke; most ignore it
            if not isinstance(name, str):
                raise bad_request(f"messages[{i}].name must be a string", f"messages[{i}].name", "invalid_type")
            message["name"] = name
        plain.append(message)
    return GenerationRequest(prompt=plain, tools=parse_tools(body), **values)


def parse_completion(body: Any) -> GenerationRequest:
    values = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass  # token ids
    elif not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or a list of token ids); batches are not supported",
                          "prompt", "invalid_type" if prompt is not None else "missing")
    if isinstance(prompt, str) and not prompt:
        raise bad_request("'prompt' is empty", "prompt", "invalid_value")
    if values["max_tokens"] is None:
        values["max_tokens"] = 16  # OpenAI's default for completions
    return GenerationRequest(prompt=prompt, **values)
