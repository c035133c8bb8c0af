"""The chat header's context readout: how much of the model's window the open conversation
uses (a count and a bar), and the banners that say what happens as it fills.

The counts come from the worker (a count of the whole conversation when it opens or
changes) and from the answer in progress (its prompt plus the tokens written so far).
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtWidgets import QLabel, QProgressBar, QWidget

from app.settings import Settings

from . import formatting as fmt
from .worker import EngineClient

CONTEXT_WARN = 0.85
BAR_MIN_PAGE_WIDTH = 520  # narrower, the bar goes and the count stays (the title stays readable)


class ContextReadout:
    """The count and the bar (`label`, `bar`, placed by the page), and what they stand for:
    tokens `used` of `total`, with the `dropped` oldest messages no longer read."""

    def __init__(self, header: QWidget, page: QWidget, settings: Settings, client: EngineClient, banner,
                 new_chat: Callable[[], None]):
        self.page, self.settings, self.client, self.banner, self.new_chat = page, settings, client, banner, new_chat
        self.label = QLabel(header)
        self.label.setObjectName("contextLabel")
        self.label.setToolTip("Tokens this conversation uses of the model's context window")
        self.bar = QProgressBar(header)
        self.bar.setObjectName("contextBar")
        self.bar.setTextVisible(False)
        self.bar.setFixedWidth(110)
        self.bar.setRange(0, 1000)
        self.used: int | None = None
        self.total: int | None = None
        self.dropped = 0

    def fit_width(self) -> None:
        self.bar.setVisible(self.page.width() >= BAR_MIN_PAGE_WIDTH and bool(self.total))

    def opened(self, empty: bool) -> None:
        """Another conversation is shown: nothing of the last one's count applies."""
        self.used = 0 if empty else None
        self.dropped = 0
        self.refresh()

    def counted(self, report: dict) -> None:
        self.used, self.total = report["tokens"], report["ctx"]
        self.dropped = int(report.get("dropped") or 0)
        self.refresh()

    def live(self, used: int, dropped: int) -> None:
        """An answer in progress: its prompt and what it has written so far."""
        self.used, self.dropped = used, dropped
        self.refresh()

    def model_loaded(self, info: dict) -> None:
        self.total = info.get("ctx")
        if self.banner.isVisible() and self.banner.property("kind") in ("error", "warn"):
            self.banner.hide()  # said of the previous model; counted again
        self.refresh()

    def refresh(self) -> None:
        total = self.total or (self.client.model_info or {}).get("ctx")
        if not total:
            self.label.setText("")
            self.bar.hide()
            return
        self.total = total
        used = self.used
        self.bar.setVisible(self.page.width() >= BAR_MIN_PAGE_WIDTH)
        if used is None:
            self.label.setText(f"… / {total:,} tokens")
            self.bar.setValue(0)
            return
        shown = min(used, total)  # the model never reads more than its window
        frac = shown / total
        self.label.setText(f"{shown:,} / {total:,} tokens" + (" · oldest not read" if self.dropped else ""))
        tip = "Tokens (word pieces) the model reads of this conversation, of the most it can read at once."
        if self.dropped:
            words = fmt.oldest_forgotten(self.dropped, "no longer fits and is left out",
                                         "no longer fit and are left out")
            tip += f" {words[0].upper()}{words[1:]} (Preferences → Chat)."
        if self.label.toolTip() != tip:
            self.label.setToolTip(tip)
        self.bar.setValue(int(frac * 1000))
        truncating = self.settings["chat.context_policy"] == "truncate"
        level = "full" if frac >= 0.98 and not truncating else ("warn" if frac >= CONTEXT_WARN else "")
        if self.bar.property("level") != level:  # a re-polish costs a style pass: only on change
            self.bar.setProperty("level", level)
            self.bar.style().unpolish(self.bar)
            self.bar.style().polish(self.bar)
        if self.dropped and truncating:
            if not self.banner.isVisible() or self.banner.property("kind") == "error":
                self.banner.show_message(
                    f"This conversation is longer than the model can read ({total:,} tokens), so it now "
                    f"reads only the latest messages: {fmt.oldest_forgotten(self.dropped)}. "
                    "Start a new chat for a new topic.", "info", "New chat", self.new_chat)
        elif level == "full":
            self.show_full()
        elif level == "warn" and not self.banner.isVisible():
            what = ("the oldest messages will be forgotten soon" if truncating
                    else "answers will be cut short soon")
            self.banner.show_message(
                f"This conversation uses {frac:.0%} of what the model can read; {what}. "
                "Start a new chat for a new topic.", "warn", "New chat", self.new_chat)

    def show_full(self) -> None:
        """The conversation filled the window: say what can be done."""
        info = self.client.model_info or {}
        total = self.total or info.get("ctx") or 0
        trained = info.get("max_positions")
        can_raise = not trained or total < trained
        more = (" or raise the context length in the panel (this reloads the model; the conversation "
                "is kept)" if can_raise else ", or choose a model that reads more on the Models page")
        policy = (" Or let the model forget the oldest messages: Preferences → Chat."
                  if self.settings["chat.context_policy"] == "stop" else "")
        self.banner.show_message(
            f"The conversation has filled what the model can read ({total:,} tokens), so it cannot go "
            f"on. Start a new chat{more}.{policy}", "error", "New chat", self.new_chat)

    def too_long(self, tokens: int, ctx: int, models_page: Callable[[], None]) -> None:
        """One message longer than the model reads, its answer included: it is not sent."""
        self.banner.show_message(
            f"This message is {tokens:,} tokens long, but the model reads at most {ctx:,} tokens at once, "
            "its answer included. Shorten it (or send it in parts), or choose a model with a longer "
            "context on the Models page.", "error", "Models", models_page)
