"""The line under the chat: the answer's figures in words (speed, wait, neurons used, memory,
device) while it streams and after, or what is ready when nothing is being written.

It says the figures of the answer on screen: the last one, and after paging a regenerated
answer (‹ 1/2 ›) the version shown, never an earlier answer's.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QWidget

from . import formatting as fmt
from .chat_session import AnswerStats

READOUT_TIP = ("<b>speed</b>: tokens (word pieces) written per second<br>"
               "<b>reading</b>: how fast the prompt was read<br>"
               "<b>first word after</b>: the wait before the answer began<br>"
               "<b>neurons used</b>: share of the model's feed-forward neurons that fired; the rest were "
               "skipped, which is where the speed comes from<br>"
               "<b>GPU served</b>: share of the fired neurons that were already in GPU memory<br>"
               "<b>RAM / VRAM</b>: memory the model uses now, of its budget")


def live_text(stats: AnswerStats | dict, final: bool = False) -> str:
    """The readout under the chat, in words: speed, wait, neurons used, memory, device."""
    s = stats if isinstance(stats, AnswerStats) else AnswerStats.from_dict(stats)
    parts = []
    new = s.new_tokens
    if new:
        parts.append(fmt.count(new, "token"))
    if s.decode_tok_s and new > 1:
        parts.append(f"{fmt.rate(s.decode_tok_s)}")
    if s.prefill_tok_s:
        parts.append(f"read the prompt at {fmt.rate(s.prefill_tok_s)}")
    if s.ttft_s is not None and new:
        parts.append(f"first word after {fmt.seconds(s.ttft_s)}")
    dense = s.mode == "dense"
    on_gpu = s.on_gpu  # with no GPU there is no GPU share to show
    hit = None if dense or not on_gpu else s.hot_hit_fraction
    if dense:
        parts.append("all neurons computed")
    elif s.ffn_active_fraction:
        parts.append(f"{fmt.percent(s.ffn_active_fraction)} of neurons used")
    if hit is not None:
        parts.append(f"GPU served {fmt.percent(hit)}")
    elif on_gpu and s.expected_hot_hit_fraction is not None:
        parts.append(f"GPU share ≈{fmt.percent(s.expected_hot_hit_fraction)} (expected)")
    disk_read, cache_hit = s.disk_read_bytes_per_token, s.cache_hit_fraction
    if disk_read is not None and cache_hit is not None and not dense and (disk_read > 0 or cache_hit < 1):
        parts.append(f"cache served {fmt.percent(cache_hit)} · {fmt.size(disk_read)} a token from disk")
    for name, used, budget in (("VRAM", s.vram_bytes, s.vram_budget), ("RAM", s.ram_bytes, s.ram_budget)):
        if used is None or (name == "VRAM" and not used and not on_gpu):
            continue
        # "of" a budget only where the budget is a real limit, not the amount in use.
        of = f" of {fmt.gib(budget)}" if budget and fmt.gib(budget) != fmt.gib(used) else ""
        parts.append(f"{name} {fmt.gib(used)}{of}")
    if s.device:
        parts.append(fmt.device_name(s.device))
    if s.dropped_messages:
        parts.append(fmt.oldest_forgotten(s.dropped_messages, "not read", "not read"))
    if final and s.finish_reason == "cancelled":
        parts.insert(0, "stopped")
    return " · ".join(parts) if parts else "…"


class LiveReadout(QLabel):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("liveReadout")
        self.setWordWrap(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setToolTip(READOUT_TIP)

    def idle(self, info: dict | None) -> None:
        """Nothing is being written: the model that is ready, in words (empty with none)."""
        if info:
            self.setText(f"Ready · {fmt.model_label(info.get('model'))} · {fmt.mode_words(info.get('mode'))} · "
                         f"{fmt.device_name((info.get('memory') or {}).get('device'))}")
        else:
            self.setText("")

    def streaming(self, stats: AnswerStats) -> None:
        self.setText("● " + live_text(stats))

    def answered(self, stats: AnswerStats | dict | None, info: dict | None = None) -> None:
        """The figures of a finished answer (the one shown), or the idle line when it has none."""
        if stats and (stats.get("new_tokens") if isinstance(stats, dict) else stats.new_tokens):
            self.setText(live_text(stats, final=True))
        else:
            self.idle(info)
