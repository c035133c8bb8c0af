"""How numbers read in the window: speeds, sizes, shares, durations. Pure functions."""

from __future__ import annotations

from engine.units import format_rate

GIB = 1024**3


def gib(n: float | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    if n < 1024**3 / 10 and n > 0:
        return f"{n / 1024**2:.0f} MiB"
    return f"{n / GIB:.1f} GiB"


def size(n: float | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def rate(tok_s: float | None) -> str:
    if tok_s is None:
        return "—"
    return f"{tok_s:.1f} tok/s" if tok_s < 100 else f"{tok_s:.0f} tok/s"


def words_rate(words_s: float) -> str:
    """Words a second in two figures, never an exponent (`0.9`, `12`, `27,000`)."""
    return format_rate(words_s)


def seconds(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 90:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def count(n: int, word: str) -> str:
    """`1 token`, `2 tokens`, `1,024 tokens`."""
    n = int(n)
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def oldest_forgotten(n: int, one: str = "is forgotten", many: str = "are forgotten") -> str:
    """`the oldest message is forgotten`, `the oldest 3 messages are forgotten`."""
    n = int(n)
    return f"the oldest message {one}" if n == 1 else f"the oldest {n:,} messages {many}"


MODE_WORDS = {"dense": "every neuron computed", "sparse": "sparse", "hybrid": "sparse (hybrid)",
              "oracle": "exact neurons (checking)"}


def mode_words(mode: str | None) -> str:
    return MODE_WORDS.get(str(mode or ""), f"{mode} mode")


def gpu_note(note: str | None) -> str:
    """Why no GPU is usable, in words (the probe's text, from NVML, stays in a tooltip)."""
    text = (note or "").lower()
    if not text:
        return ""
    if "nvml" in text or "driver" in text or "library" in text:
        return "no NVIDIA driver is installed"
    if "cuda" in text and ("build" in text or "torch" in text):
        return "this build runs on the CPU only"
    return note or ""


def percent(f: float | None) -> str:
    return "—" if f is None else f"{f * 100:.0f}%"


def device_name(device: str | None) -> str:
    if not device:
        return "—"
    if device.startswith("cuda"):
        return f"GPU ({device})"
    return "CPU only" if device == "cpu" else device


def message_stats(stats: dict | None) -> str:
    """The one-line summary kept under an answer."""
    if not stats:
        return ""
    parts = []
    new = stats.get("new_tokens")
    if new is not None:
        parts.append(count(new, "token"))
    if stats.get("decode_tok_s") and (new or 0) > 1:
        parts.append(rate(stats["decode_tok_s"]))
    if stats.get("prefill_tok_s"):
        parts.append(f"prompt read at {rate(stats['prefill_tok_s'])}")
    if stats.get("ttft_s") is not None and new:
        parts.append(f"first word after {seconds(stats['ttft_s'])}")
    if stats.get("ffn_active_fraction") and stats.get("mode") not in ("dense", None):
        parts.append(f"{percent(stats['ffn_active_fraction'])} of neurons used")
    on_gpu = str(stats.get("device") or stats.get("mem_device") or "").startswith("cuda")
    if stats.get("hot_hit_fraction") is not None and stats.get("mode") not in ("dense", None) and on_gpu:
        parts.append(f"GPU served {percent(stats['hot_hit_fraction'])} of active neurons")
    if stats.get("mode"):
        parts.append(mode_words(stats["mode"]))
    return " · ".join(parts)


def model_label(spec: str | None) -> str:
    """A model as people read it: a catalogue id as is, a folder by its name."""
    if not spec:
        return "—"
    text = str(spec).rstrip("/\\")
    if "/" in text and (text.startswith(("/", "~", ".")) or "\\" in text or ":" in text[:3]):
        return text.replace("\\", "/").rsplit("/", 1)[-1]
    return text


def verdict_kind(verdict: str) -> str:
    """The colour class of a fit verdict's chip (the model cards and the Hub search rows)."""
    v = verdict.lower()
    if v.startswith("does not") or "not fit" in v:
        return "bad"
    if v == "fits":
        return "good"
    if v.startswith("fits") or v.startswith("runs from disk"):  # runs, at a cost the card states
        return "ok"
    return "muted"
