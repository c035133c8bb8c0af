"""OpenAI request bodies checked into plain values, and OpenAI-style error bodies.

Known fields are type-checked (a wrong type is a 400 naming the field); fields we do not
use are ignored, as OpenAI-compatible servers do, so clients that send `user`,
`presence_penalty` or `logit_bias` still work.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_JSON_DEPTH = 64  # far more than any OpenAI body (tool schemas included) needs
MAX_INT = 2 ** 63 - 1  # every integer field fits a signed 64-bit int


class ApiError(Exception):
    """An error the client caused (or a busy server), answered as OpenAI does."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


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
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the client set (the model's defaults fill the rest)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
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


def _common(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object ({kind})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    n = _number(body, "n", 1, integer=True)
    if n not in (None, 1):
        raise bad_request("this server returns one choice per request ('n' must be 1)", "n", "invalid_value")
    for name in ("logprobs", "echo"):
        if body.get(name) not in (None, False, 0):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _bool(options or {}, "include_usage")
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
    )


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
        plain.append({"role": ROLES[role], "content": _content_text(m.get("content"), i)})
    return GenerationRequest(prompt=plain, **values)


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
