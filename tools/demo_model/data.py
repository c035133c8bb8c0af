"""Training documents and the token stream of the demo model.

Every paragraph of the corpus is one document, `<s> text </s>`. Runs of consecutive
paragraphs that are each one whole quoted speech are also emitted as a two-turn exchange in
the chat template's format ("User: ...\\nAssistant: ...</s>"), so that the model has seen
the turns it is prompted with in chat.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from .tokenizer import BOS, EOS


def read_paragraphs(path, max_chars: int | None = None) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if max_chars is not None:
        text = text[:max_chars]
    return [line for line in text.split("\n") if line.strip()]


def _speech(paragraph: str) -> str | None:
    """The words of a paragraph that is exactly one quotation, else None."""
    p = paragraph.strip()
    if len(p) > 2 and p[0] == '"' and p[-1] == '"' and p.count('"') == 2:
        return p[1:-1].strip()
    return None


def dialogue_pairs(paragraphs: list[str]) -> list[str]:
    out = []
    for first, second in zip(paragraphs, paragraphs[1:]):
        a, b = _speech(first), _speech(second)
        if a and b:
            out.append(f"User: {a}\nAssistant: {b}")
    return out


def encode_documents(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """One uint16 stream: <s> doc </s> <s> doc </s> ..."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    pieces = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        pieces.append(np.asarray([bos, *enc.ids, eos], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def sample_batch(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    """Random windows of seq_len + 1 tokens (inputs and shifted targets)."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
