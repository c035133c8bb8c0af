"""OpenAI tools: definitions checked, calls constrained or parsed, history rendered.

- `tool_choice` "required" or a named function: the answer is constrained (a JSON schema
  through the engine's grammar library) to `{"name": ..., "arguments": {...}}` objects whose
  arguments match the function's own `parameters` schema (a list of them when parallel calls
  are allowed), and returned as OpenAI `tool_calls`, as vLLM does.
- "auto": the chat template receives the tools (templates take `tools`, as Hugging Face's do)
  and the answer is read for the tool-call format that template writes: Hermes/Qwen's
  `<tool_call>{json}</tool_call>`, Mistral's `[TOOL_CALLS][...]`, or Llama 3.1's bare
  `{"name": ..., "parameters": ...}`. A template that takes no tools cannot be asked for "auto":
  400, saying so.
- History: `role: "tool"` messages and assistant `tool_calls` go to a template that takes
  tools as they are (arguments as objects, as Hugging Face's templates expect); a template that
  takes none reads them as plain turns (the call as JSON, the result as a user turn), so
  nothing the client sent is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request, check_json_schema

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and the dots some clients send)


@dataclass
class ToolRequest:
    """What a chat request asks about tools: the definitions (OpenAI's shape) and the choice."""
    tools: list[dict]
    choice: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the named function when choice == "function"
    parallel: bool = True
    names: list[str] = field(default_factory=list)


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None when it names no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls", "invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' names a tool but 'tools' is empty", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool definitions", "tools", "invalid_type")
    if len(tools) > 128:
        raise bad_request("'tools' takes at most 128 tools", "tools", "invalid_value")
    checked, names = [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}} "
                              "(this server calls functions only)", where, "invalid_value")
        fn = tool["function"]
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise bad_request(f"'{where}.function.{str(key)[:40]}' is not a field of a function", where,
                                  "unknown_field")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_', '-' or '.'",
                              f"{where}.function.name", "invalid_value")
        if name in names:
            raise bad_request(f"'{where}': the function {name!r} is defined twice", f"{where}.function.name",
                              "invalid_value")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"'{where}.function.strict' must be true or false", f"{where}.function.strict",
                              "invalid_type")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description",
                              "invalid_type")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                              f"{where}.function.parameters", "invalid_schema")
        check_json_schema(params, f"{where}.function.parameters")
        names.append(name)
        checked.append({"type": "function", "function": {**fn, "parameters": params}})
    function = None
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    elif isinstance(choice, dict):
        picked = choice.get("function") if choice.get("type") == "function" else None
        function = picked.get("name") if isinstance(picked, dict) else None
        if not isinstance(function, str):
            raise bad_request("'tool_choice' must be none, auto, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
        if function not in names:
            raise bad_request(f"'tool_choice' names the function {function!r}, which 'tools' does not define",
                              "tool_choice", "invalid_value")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"'tool_choice' must be none, auto, required or a function, not {str(choice)[:40]!r}",
                          "tool_choice", "invalid_value")
    return ToolRequest(checked, choice, function, parallel is not False, names)


def call_schema(req: ToolRequest) -> dict:
    """The JSON schema a constrained tool call matches: one call (a named function, or no
    parallel calls) or a list of one or more."""
    def one(tool: dict) -> dict:
        fn = tool["function"]
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}

    wanted = [t for t in req.tools if req.choice != "function" or t["function"]["name"] == req.function]
    single = one(wanted[0]) if len(wanted) == 1 else {"anyOf": [one(t) for t in wanted]}
    if req.choice == "function" or not req.parallel:
        return single
    return {"type": "array", "items": single, "minItems": 1}


def _call_object(tool: dict, arguments_key: str = "arguments") -> dict:
    """The schema of one call of `tool`: its name, and arguments that match its `parameters`
    where it is strict (OpenAI's `strict`), any object where it is not."""
    fn = tool["function"]
    args = fn["parameters"] if fn.get("strict") else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, arguments_key: args},
            "required": ["name", arguments_key], "additionalProperties": False}


def strict_auto_grammar(req: ToolRequest, fmt: "CallFormat") -> str | None:
    """tool_choice "auto" with a strict function: a Lark grammar (llguidance's, with %json) that
    lets the answer be free text or calls in the template's format, and holds every call to its
    function's schema, as OpenAI's `strict` promises; at most one call without parallel calls.
    None when no function is strict (the answer is then read, not constrained)."""
    if not any(t["function"].get("strict") for t in req.tools):
        return None
    key = "parameters" if fmt is LLAMA3 else "arguments"
    calls = [_call_object(t, key) for t in req.tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt is HERMES:
        body = 'call: "<tool_call>" WS? call_json WS? "</tool_call>"\n'
        body += "calls: call\n" if not req.parallel else "calls: call (WS? call)*\n"
        schema = one
    elif fmt is MISTRAL:
        body = 'calls: "[TOOL_CALLS]" WS? call_json\n'
        schema = {"type": "array", "items": one, "minItems": 1, **({} if req.parallel else {"maxItems": 1})}
    else:  # Llama 3: one bare object
        body = "calls: call_json\n"
        schema = one
    marker = re.escape(fmt.marker or "{").replace("/", "\\/")
    return ("start: TEXT | calls\n" + body + f"call_json: %json {json.dumps(schema)}\n"
            "WS: /[ \\t\\n]+/\n"
            # free text: anything that does not start (after blanks) with the format's marker
            f"TEXT: /(.|\\n)*/ & ~/[ \\t\\n]*{marker}(.|\\n)*/\n")


def constrained_calls(text: str) -> list[dict]:
    """The tool calls of a constrained answer (`call_schema`'s JSON) in OpenAI's shape."""
    value = json.loads(text)
    return [_openai_call(c["name"], c["arguments"]) for c in (value if isinstance(value, list) else [value])]


def _openai_call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


# ------------------------------------------------------------------ the templates' own formats
@dataclass(frozen=True)
class CallFormat:
    """How a template's model writes tool calls: where they start, and how to read them."""
    name: str
    marker: str  # the text an answer with calls starts with ("" : a bare JSON object)


HERMES = CallFormat("hermes", "<tool_call>")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]")
LLAMA3 = CallFormat("llama3-json", "")


def template_format(template: str) -> CallFormat | None:
    """The tool-call format a chat template writes, from its text; None: one this server cannot read."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and "parameters" in template):
        return LLAMA3
    return None


def parse_template_calls(text: str, fmt: CallFormat, names: list[str],
                         single: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer in `fmt`; an answer whose calls do not parse, or name
    functions that were not offered, is content (what the model wrote, unaltered). `single`
    (parallel_tool_calls false): the first call alone, as OpenAI returns at most one."""
    stripped = text.strip()
    try:
        if fmt is HERMES and stripped.startswith(HERMES.marker):
            found = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", stripped, re.S)
            raw = [json.loads(f) for f in found]
            before = None
        elif fmt is MISTRAL and stripped.startswith(MISTRAL.marker):
            value = json.loads(stripped[len(MISTRAL.marker):].strip())
            raw, before = (value if isinstance(value, list) else [value]), None
        elif fmt is LLAMA3 and stripped.startswith("{"):
            raw, before = [json.loads(stripped.removeprefix("<|python_tag|>"))], None
        else:
            return text, []
    except ValueError:
        return text, []
    calls = []
    for item in raw[: 1 if single else None]:
        if not isinstance(item, dict) or item.get("name") not in names:
            return text, []
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(_openai_call(item["name"], args))
    return before, calls


def may_become_call(text: str, fmt: CallFormat) -> bool:
    """Whether a streamed answer that starts with `text` may still turn into tool calls (held back)."""
    stripped = text.lstrip()
    if fmt is LLAMA3:
        return stripped == "" or stripped.startswith("{") or "<|python_tag|>".startswith(stripped[:14])
    return fmt.marker.startswith(stripped) or stripped.startswith(fmt.marker)


# -------------------------------------------------------------------------- history
def history_message(m: dict, i: int, role: str, content: str) -> dict:
    """A message of the history, checked: an assistant's tool calls (arguments parsed to
    objects where they are JSON) and a tool result's call id kept beside role and content."""
    message = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls: only an assistant message carries a list of tool calls",
                              f"messages[{i}].tool_calls", "invalid_value")
        parsed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), str) or call.get("type", "function") != "function":
                raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                  "\"function\": {\"name\", \"arguments\"}}", f"messages[{i}].tool_calls[{j}]",
                                  "invalid_value")
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                arguments = fn.get("arguments")
            parsed.append({"id": str(call.get("id") or ""), "type": "function",
                           "function": {"name": fn["name"], "arguments": arguments}})
        message["tool_calls"] = parsed
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"messages[{i}].tool_call_id: a tool message names the call it answers",
                              f"messages[{i}].tool_call_id", "missing")
        message["tool_call_id"] = call_id
    elif m.get("tool_call_id") is not None:
        raise bad_request(f"messages[{i}].tool_call_id belongs to a tool message", f"messages[{i}].tool_call_id",
                          "invalid_value")
    return message


def for_template(messages: list[dict], tool_aware: bool) -> list[dict]:
    """The history as the template reads it: tool calls and results as they are for a template
    that takes tools; written out as plain turns (the calls as JSON, a result as a user turn)
    for one that does not, so nothing the client sent is dropped."""
    if tool_aware:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            shown = json.dumps([{"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}
                                for c in m["tool_calls"]], ensure_ascii=False)
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + shown})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Result of tool call {m['tool_call_id']}: {m['content']}"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def _as_object(arguments: Any) -> Any:
    """Arguments as the history shows them: parsed where they are JSON text (OpenAI's wire
    form, and what the window stores), as they are otherwise."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
