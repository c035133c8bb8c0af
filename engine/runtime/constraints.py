"""Constrained decoding: a grammar (a JSON schema, or a Lark grammar) turned into a mask of the
tokens allowed next, which the sampler applies before it chooses, in every mode, greedy included.

The grammar library is llguidance (Microsoft's; llama.cpp and vLLM use it): it compiles a JSON
schema in about a millisecond (outlines-core took 88 ms for the same schema; bench/grammar.py),
takes the whole of JSON Schema and Lark grammars, and computes a mask in 0.1 ms on the demo's
vocabulary, far below a decode step. A grammar it cannot compile is a `GrammarError` (a
UserError: the server answers it with a 400 that names the problem).

The end of the answer: the mask allows the model's end-of-turn tokens once the grammar accepts
what was written, and nothing else once the grammar admits no more text, so a constrained
answer ends where its JSON ends.

The end of the budget: a model may write a JSON string that never ends (the demo writes
prose). Once the answer's remaining room (max_tokens, the context) falls to CLOSE_LOOKAHEAD
tokens, the first time the JSON written so far can be closed (`json_closing`: close the
string, give a pending key the value 0, close the containers) in a way the grammar accepts,
it is closed, so JSON mode parses even when it runs out of room. Until it can be (a schema's
required field still missing, say), the answer takes a token made only of '"', '}' and ']'
wherever the grammar allows one, which heads for the end; an answer may still reach the length
limit, like any answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import UserError


class GrammarError(UserError):
    """A schema or grammar that the grammar library refuses; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must match: `kind` "json_schema" (source: the schema as JSON text) or "lark"."""
    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def lark(cls, grammar: str) -> "GrammarSpec":
        return cls("lark", grammar)


def _library():
    try:
        import llguidance
    except ImportError as exc:  # a dependency (pyproject.toml); a broken install says so
        raise UserError(f"structured output needs the llguidance package ({exc}); "
                        "reinstall thermocline") from None
    return llguidance


def _sentencepiece_tokens(tokenizer) -> list[bytes]:
    """Each id's bytes under a sentencepiece model: '▁' is a space, <0xNN> pieces are bytes."""
    sp = tokenizer._sp
    out = []
    for i in range(tokenizer.vocab_size):
        piece = sp.IdToPiece(i) if i < sp.GetPieceSize() else ""
        if sp.IsByte(i) if i < sp.GetPieceSize() else False:
            out.append(bytes([int(piece[3:5], 16)]))
        elif i < sp.GetPieceSize() and (sp.IsControl(i) or sp.IsUnknown(i)):
            out.append(b"")
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    for text, i in tokenizer._added.items():
        if i < len(out):
            out[i] = text.encode("utf-8")
    return out


class _SentencePieceVocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer with no tokenizer.json."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_id
        self.tokens = _sentencepiece_tokens(tokenizer)
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str) -> list[int]:
        # sentencepiece puts a space (its dummy prefix) before the text; the library must see the
        # text's own tokens, so it is encoded after a newline and the newline's tokens cut off.
        encode = self.tokenizer.encode
        ids, lead = encode("\n" + text, add_special_tokens=False), encode("\n", add_special_tokens=False)
        if ids[: len(lead)] == lead:
            return ids[len(lead):]
        return encode(text, add_special_tokens=False)


class TokenGrammar:
    """The grammar library's view of one model's tokenizer, built once per engine (about a
    second on a 150k vocabulary), and the compiler of specs into matchers."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        lib = _library()
        self.eos_ids = sorted(eos_ids)
        eos = tokenizer.eos_id if tokenizer.eos_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        if tokenizer._hf is not None:
            self.tokenizer = lib.LLTokenizer(tokenizer._hf.to_str(), eos_token=eos)
        else:
            self.tokenizer = lib.LLTokenizer(lib.TokenizerWrapper(_SentencePieceVocab(tokenizer, eos)))
        self.vocab = self.tokenizer.vocab_size
        self._eos = torch.tensor([i for i in self.eos_ids if i < self.vocab], dtype=torch.long)
        self._closers: torch.Tensor | None = None

    def grammar_text(self, spec: GrammarSpec) -> str:
        lib = _library()
        if spec.kind == "json_schema":
            try:
                # Compact JSON (no free whitespace): a model cannot pad an answer with blanks forever.
                return lib.LLMatcher.grammar_from_json_schema(spec.source, defaults={"whitespace_flexible": False})
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid: {exc}") from None
        if spec.kind == "lark":
            return lib.LLMatcher.grammar_from_lark(spec.source)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def check(self, spec: GrammarSpec) -> None:
        """Raise GrammarError naming the problem when the library cannot compile `spec`."""
        lib = _library()
        error = lib.LLMatcher.validate_grammar(self.grammar_text(spec), self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"the grammar library cannot use this schema: {error.strip()[:500]}")

    def closers(self) -> torch.Tensor:
        """The tokens made of nothing but '"', '}' and ']': what ends strings and containers
        without opening anything (built at the first answer that runs short of room)."""
        if self._closers is None:
            decode = self.tokenizer.decode_bytes
            self._closers = torch.tensor([bool(b) and not b.strip(b'"}]') for b in
                                          (decode([i]) for i in range(self.vocab))], dtype=torch.bool)
        return self._closers

    def start(self, spec: GrammarSpec) -> "Constraint":
        lib = _library()
        matcher = lib.LLMatcher(self.tokenizer, self.grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar library cannot use this schema: {matcher.get_error().strip()[:500]}")
        # JSON is closed in time when the room runs out; a Lark grammar (free text or a tool call)
        # has no such closing: prose would be pushed into '"', '}' and ']'.
        return Constraint(self, matcher, closable=spec.kind == "json_schema")


CLOSE_LOOKAHEAD = 64  # the room below which the closing is worked out at every token (a call: ~30)


class Constraint:
    """One answer's position in its grammar: the mask of what may come next, and each token taken.
    `room`: the tokens the answer may still take (set by the engine before each step; None: no limit)."""

    def __init__(self, grammar: TokenGrammar, matcher, closable: bool = True):
        self.grammar, self.matcher = grammar, matcher
        self._bits = np.zeros((grammar.vocab + 31) // 32, dtype=np.int32)
        self.closable = closable
        self.room: int | None = None
        self.tokens: list[int] = []

    def _only(self, ids) -> torch.Tensor:
        allowed = torch.zeros(self.grammar.vocab, dtype=torch.bool)
        allowed[ids] = True
        return allowed

    def closing_tokens(self) -> list[int] | None:
        """The tokens that close the JSON written so far, if the grammar accepts them as an end."""
        text = self.grammar.tokenizer.decode_str(self.tokens)
        closing = json_closing(text)
        if closing is None:
            return None
        ids = self.grammar.tokenizer.tokenize_str(closing) if closing else []
        trial = self.matcher.deep_copy()
        if (ids and not trial.consume_tokens(ids)) or not trial.is_accepting():
            return None
        return ids

    def allowed(self) -> torch.Tensor:
        """A bool mask over the tokenizer's vocabulary of the tokens allowed next."""
        if self.matcher.is_stopped() or self.matcher.is_error():  # nothing more may be written: end it
            return self._only(self.grammar._eos)
        if self.closable and self.room is not None and self.room <= CLOSE_LOOKAHEAD:
            closing = self.closing_tokens()
            if closing is not None:  # the last chance may not come again (inside a call, say): close now
                return self._only(closing[:1] or self.grammar._eos)
            allowed = self._mask()
            closers = allowed & self.grammar.closers()
            return closers if closers.any() else allowed  # no closing yet: head for one
        return self._mask()

    def _mask(self) -> torch.Tensor:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.grammar.vocab]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        accepting = self.matcher.is_accepting()
        allowed[self.grammar._eos] = accepting  # any end-of-turn token ends an accepted answer
        return allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (1-D float, our own copy) with every token not allowed at -inf."""
        allowed = self.allowed()
        n = min(logits.shape[-1], allowed.shape[-1])
        logits[..., n:] = float("-inf")
        logits[..., :n].masked_fill_(~allowed[:n], float("-inf"))
        return logits

    def accept(self, token: int) -> None:
        if token in self.grammar.eos_ids or self.matcher.is_stopped():
            return
        self.tokens.append(token)
        self.matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


_LITERALS = ("true", "false", "null")


def json_closing(text: str) -> str | None:
    """The shortest text that makes `text`, a prefix of one JSON value, complete (a pending key
    gets the value 0); None when `text` is not such a prefix."""
    stack: list[str] = []  # "{" / "["
    state = "value"  # value, value_or_close, key, key_or_close, colon, after, string, number, literal
    key = escape = False
    unicode_left = 0
    literal = ""
    for ch in text:
        if state == "string":
            if unicode_left:
                unicode_left -= 1
            elif escape:
                escape = False
                if ch == "u":
                    unicode_left = 4
            elif ch == "\\":
                escape = True
            elif ch == '"':
                state = "colon" if key else "after"
            continue
        if state == "number":
            if ch in "0123456789+-.eE":
                literal += ch
                continue
            state = "after"
        if state == "literal":
            literal += ch
            if not any(word.startswith(literal) for word in _LITERALS):
                return None
            if literal in _LITERALS:
                state = "after"
            continue
        if ch in " \t\r\n":
            continue
        if state in ("value", "value_or_close"):
            if ch == "]" and state == "value_or_close":
                stack.pop()
                state = "after"
            elif ch in "{[":
                stack.append(ch)
                state = "key_or_close" if ch == "{" else "value_or_close"
            elif ch == '"':
                state, key = "string", False
            elif ch in "-0123456789":
                state, literal = "number", ch
            elif ch in "tfn":
                state, literal = "literal", ch
            else:
                return None
        elif state in ("key", "key_or_close"):
            if ch == "}" and state == "key_or_close":
                stack.pop()
                state = "after"
            elif ch == '"':
                state, key = "string", True
            else:
                return None
        elif state == "colon":
            if ch != ":":
                return None
            state = "value"
        elif state == "after":
            if not stack:
                return None
            if ch == ",":
                state = "key" if stack[-1] == "{" else "value"
            elif ch == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
            else:
                return None
    out = ""
    if state == "string":
        out += "0" * unicode_left + ("n" if escape else "") + '"' + (":0" if key else "")
    elif state == "number":
        out += "0" if literal[-1] in "+-.eE" else ""
    elif state == "literal":
        out += next(word for word in _LITERALS if word.startswith(literal))[len(literal):]
    elif state == "value" and not stack and not text.strip():
        out += "{}"
    elif state == "value":
        out += "0"
    elif state == "key":
        out += '"":0'
    elif state == "colon":
        out += ":0"
    return out + "".join("}" if c == "{" else "]" for c in reversed(stack))
