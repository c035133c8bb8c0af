"""What the model reads of a conversation that no longer fits its context window.

Policies (the `chat.context_policy` setting):
- `truncate`: keep the system prompt and the newest messages, drop the oldest turns (what
  Ollama does; LM Studio calls it a rolling window). When it has to drop, it drops a quarter of
  the window more than needed, so the next few turns extend the same prompt and the engine
  reuses its cache instead of reading everything again each turn.
- `stop`: send everything; the engine stops when the window is full and the chat says so.

Pure Python over a token-counting function: no Qt, no tensors. `Engine.fit` applies it with the
engine's own count (`Engine.count_chat`), for the window and the terminal chat; the server's
usage counts with the same function (`Engine.chat_ids`). `RemoteEngine.fit` keeps every message
(the remote server counts and trims).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

POLICIES = ("truncate", "stop")
MIN_ANSWER_TOKENS = 16


@dataclass
class Fitted:
    messages: list[dict]     # what the model will read
    tokens: int | None       # its length in tokens (None: counted on a remote server)
    dropped: int             # oldest messages left out
    fits: bool               # the prompt leaves room for an answer


def answer_room(ctx: int, max_new_tokens: int | None) -> int:
    """Tokens kept free for the answer: the longest answer, at most a quarter of the window."""
    want = max_new_tokens or ctx // 4
    return max(min(want, ctx // 4), min(MIN_ANSWER_TOKENS, ctx // 2))


def fit_messages(messages: list[dict], count: Callable[[list[dict]], int], ctx: int,
                 max_new_tokens: int | None = None, policy: str = "truncate",
                 previous_drop: int = 0) -> Fitted:
    """The messages to send under `policy`; `previous_drop` is the last call's `dropped` for the
    same conversation (reused while it still fits, so the prompt keeps its prefix)."""
    head = [m for m in messages[:1] if m.get("role") == "system"]
    turns = messages[len(head):]
    limit = ctx - answer_room(ctx, max_new_tokens)

    def build(drop: int) -> list[dict]:
        kept = turns[drop:]
        while len(kept) > 1 and kept[0].get("role") == "assistant":
            kept = kept[1:]  # a kept history starts with the user's words
        return head + kept

    total = count(messages)
    if total <= limit or policy != "truncate" or len(turns) <= 1:
        return Fitted(messages, total, 0, total <= limit)
    if 0 < previous_drop < len(turns):
        again = build(previous_drop)
        n = count(again)
        if n <= limit:
            return Fitted(again, n, len(turns) - (len(again) - len(head)), True)
    # Fewest dropped messages that fit with slack (a count shrinks as messages drop: bisect).
    target = max(limit - ctx // 4, limit // 2)
    lo, hi = 1, len(turns) - 1  # the last message (the new prompt) always stays
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(build(mid)) <= target:
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    if best is None:  # not even with slack: keep as much as fits at all
        best = len(turns) - 1
        for drop in range(1, len(turns)):
            if count(build(drop)) <= limit:
                best = drop
                break
    kept = build(best)
    n = count(kept)
    return Fitted(kept, n, len(turns) - (len(kept) - len(head)), n <= limit)
