"""One answer asked of an engine: the conversation, the sampling, the context policy (typed, in
place of a dict of options). Torch-free, so the window builds it on its own thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.context_policy import POLICIES


@dataclass(frozen=True)
class ChatRequest:
    """What the window's chat (ChatPage, ChatSession) hands the engine client for one answer."""
    messages: list[dict]
    sampling: dict = field(default_factory=dict)  # SamplingParams' fields that are set (None: the default)
    context_policy: str = "truncate"              # engine.runtime.context_policy.POLICIES
    conversation_id: int | None = None            # the conversation whose earlier trim `fit` reuses
    continue_text: str | None = None              # Continue: the answer so far, which the prompt ends with

    def __post_init__(self):
        if self.context_policy not in POLICIES:
            raise ValueError(f"context_policy must be one of {', '.join(POLICIES)}, not {self.context_policy!r}")

    @property
    def max_new_tokens(self) -> int | None:
        return self.sampling.get("max_new_tokens")

    def sampling_params(self):
        """engine.runtime.sampling.SamplingParams of these values (imported here: torch)."""
        from engine.runtime.sampling import SamplingParams

        return SamplingParams(**self.sampling)
