"""A conversation as a file people can keep: Markdown to read, JSON to process. Pure functions.

The JSON keeps what the database knows (roles, text, status, when, speed figures and earlier
versions of regenerated answers); the Markdown keeps what a reader needs.
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
        who = "You" if m.role == "user" else "Assistant"
        note = "" if m.status == COMPLETE else f" ({m.status})"
        lines += [f"## {who}{note}", f"*{_when(m.created_at)}*", "", m.content.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def to_json(conv: Conversation, messages: list[Message]) -> str:
    data = {
        "format": EXPORT_FORMAT,
        "title": conv.title,
        "model": conv.model,
        "system_prompt": conv.system_prompt,
        "sampling": conv.sampling,
        "created_at": conv.created_at,
        "messages": [{"role": m.role, "content": m.content, "status": m.status,
                      "created_at": m.created_at, "stats": m.stats} for m in messages],
    }
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def file_name(title: str, ext: str) -> str:
    """A safe default file name from a conversation title."""
    stem = re.sub(r"[^\w\- ]+", "", title, flags=re.UNICODE).strip().replace(" ", "-")[:60] or "conversation"
    return f"{stem}.{ext}"
