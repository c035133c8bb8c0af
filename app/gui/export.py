"""A conversation as a file people can keep: Markdown to read, JSON to process. Pure functions.

The JSON keeps what the database knows (roles, text, status, when, speed figures, tool calls and
their results, earlier versions of regenerated answers); the Markdown keeps what a reader needs.
"""

from __future__ import annotations

import json
import re
import time

from app.storage import COMPLETE, Conversation, Message

EXPORT_FORMAT = "thermocline.conversation/1"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def to_markdown(conv: Conversation, messages: list[Message]) -> str:
    lines = [f"# {conv.title}", ""]
    meta = [f"Exported from Thermocline on {_when(time.time())}"]
    if conv.model:
        meta.append(f"model: {conv.model}")
    lines += ["*" + " · ".join(meta) + "*", ""]
    if conv.system_prompt.strip():
        lines += ["**System prompt:**", "", *("> " + ln for ln in conv.system_prompt.splitlines()), ""]
    for m in messages:
        if m.role == "system":
            continue
        who = {"user": "You", "tool": "Tool result" + (f" ({m.tool_call_id})" if m.tool_call_id else "")}.get(
            m.role, "Assistant")
        note = "" if m.status == COMPLETE else f" ({m.status})"
        lines += [f"## {who}{note}", f"*{_when(m.created_at)}*", ""]
        if m.role == "tool":  # a tool's output is data: fenced, as it came
            lines += [*_fenced(m.content), ""]
        elif m.content.strip():
            lines += [m.content.rstrip(), ""]
        for call in m.tool_calls or []:
            fn = call.get("function") or {}
            lines += [f"**Tool call** `{fn.get('name', '?')}`" + (f" ({call['id']})" if call.get("id") else ""), "",
                      *_fenced(_pretty(fn.get("arguments", "")), "json"), ""]
    return "\n".join(lines).rstrip() + "\n"


def _pretty(arguments) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


def _fenced(text: str, lang: str = "") -> list[str]:
    """A code block that text holding backticks of its own cannot close early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + lang, *text.rstrip("\n").splitlines(), fence]


def to_json(conv: Conversation, messages: list[Message]) -> str:
    data = {
        "format": EXPORT_FORMAT,
        "title": conv.title,
        "model": conv.model,
        "system_prompt": conv.system_prompt,
        "sampling": conv.sampling,
        "created_at": conv.created_at,
        "messages": [_message(m) for m in messages],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _message(m: Message) -> dict:
    out = {"role": m.role, "content": m.content, "status": m.status, "created_at": m.created_at, "stats": m.stats}
    if m.tool_calls:  # OpenAI's shape, so the export reads back as a chat request's history
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def file_name(title: str, ext: str) -> str:
    """A safe default file name from a conversation title."""
    stem = re.sub(r"[^\w\- ]+", "", title, flags=re.UNICODE).strip().replace(" ", "-")[:60] or "conversation"
    return f"{stem}.{ext}"
