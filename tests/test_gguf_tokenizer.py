"""A GGUF's byte-level BPE vocabulary splits text the way its `tokenizer.ggml.pre` names.

Reference: the patterns llama.cpp runs for each name (src/llama-vocab.cpp, its rewrites without
`(?i:...)`), applied in turn with Python's `regex` module as llama.cpp's unicode_regex_split
does (each pattern cuts the pieces the previous ones left, gaps kept as pieces)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import regex

from engine.loading.gguf_reader import GgufModel
from engine.loading.gguf_tokenizer import tokenizer_json

_CASES = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP = {
    "gpt-2": [GPT2],
    "smollm": [r"\p{N}", GPT2],
    "llama-bpe": [_CASES + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_CASES + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "tekken": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
               r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gpt-4o": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CASES + r"?|[^\r\n\p{L}\p{N}]?"
               r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CASES + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
}
TEXTS = ["Hello world! 12345 apples HTTPServer camelCase", "I'M here, you'RE there; it's 2026.\n\n  def f(x):\n\treturn x**2",
         "Café déjà vu... (ça va?) #tag $100 <b>", "  multiple   spaces\r\nand\n\n\nlines  "]


def _split(text: str, patterns: list[str]) -> list[str]:
    pieces = [text]
    for pattern in patterns:
        cut = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                if match.start() > at:
                    cut.append(piece[at:match.start()])
                if match.end() > match.start():
                    cut.append(match.group())
                at = match.end()
            if at < len(piece):
                cut.append(piece[at:])
        pieces = cut
    return pieces


def _byte_chars() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes (the byte-level vocabulary's alphabet)
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _vocabulary(pre: str | None) -> GgufModel:
    tokens = list(_byte_chars().values())
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []}
    if pre is not None:
        fields["tokenizer.ggml.pre"] = pre
    return GgufModel(path=Path("vocab.gguf"), powerinfer=False, arch="llama", fields=fields, tensors={})


def _pieces(pre: str | None, text: str) -> list[str]:
    import json

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json(_vocabulary(pre))))
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP))
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_the_named_splitter_cuts_text_as_llama_cpp_does(pre, text):
    chars = _byte_chars()
    expected = ["".join(chars[b] for b in piece.encode()) for piece in _split(text, LLAMA_CPP[pre])]
    assert _pieces(pre, text) == expected


def test_qwen2_and_llama3_differ_from_gpt2_where_their_patterns_do():
    text = "It's 12345 (ok)"
    assert _pieces("gpt-2", text) != _pieces("qwen2", text) != _pieces("llama-bpe", text)
    assert "1" in _pieces("qwen2", text) and "123" in _pieces("llama-bpe", text) and "Ġ12345" in _pieces("gpt-2", text)


def test_a_file_without_the_field_takes_llama_cpps_default_splitter():
    assert _pieces(None, TEXTS[0]) == _pieces("default", TEXTS[0])


def test_an_unknown_splitter_keeps_gpt2s_split_and_says_so(caplog):
    caplog.set_level(logging.WARNING)
    assert _pieces("made-up-bpe", TEXTS[1]) == _pieces("gpt-2", TEXTS[1])
    assert "'made-up-bpe' pre-tokenizer, which Thermocline does not know" in caplog.text
