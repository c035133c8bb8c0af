"""What a constrained token costs: compile time of a JSON schema and time per token mask,
for each grammar library that is installed (llguidance is the one the server uses;
outlines-core and xgrammar are measured where present, for the choice).

    python -m bench.grammar [--tokens 200] [--json]

Each library walks the same path: at every step the mask of allowed tokens is computed, and
the allowed token with the lowest id that the demo tokenizer's own greedy walk would take is
consumed (a deterministic walk through the grammar). Prints one JSON object: per library,
compile_ms and mask_ms (mean per token), and the load average beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}


def _byte_tokens(tokenizer_json: str) -> list[bytes]:
    """Each token id's bytes (byte-level BPE: GPT-2's printable stand-ins mapped back)."""
    data = json.loads(tokenizer_json)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    stand_in, n = {}, 0
    for b in range(256):
        if b in printable:
            stand_in[chr(b)] = b
        else:
            stand_in[chr(256 + n)] = b
            n += 1
    vocab = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    tokens = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = bytes(stand_in[c] for c in text) if all(c in stand_in for c in text) else text.encode()
    return tokens


def _walk(mask_fn, consume_fn, steps: int) -> tuple[float, int]:
    """Seconds per mask over a walk of at most `steps` tokens; the tokens walked."""
    spent, n = 0.0, 0
    for _ in range(steps):
        t0 = time.perf_counter()
        allowed = mask_fn()
        spent += time.perf_counter() - t0
        if allowed is None:
            break
        n += 1
        if not consume_fn(allowed):
            break
    return spent / max(n, 1), n


def _pick(allowed_ids, eos: int, step: int) -> int:
    """A token of the allowed ones, varied by step (never EOS while another is allowed)."""
    others = [i for i in allowed_ids if i != eos]
    return others[(step * 7919) % len(others)] if others else eos


def bench_llguidance(tokenizer_json: str, eos: int, steps: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp
    import numpy as np

    tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    bits = lnp.allocate_token_bitmask(1, tok.vocab_size)
    state = {"step": 0}

    def mask():
        if matcher.is_stopped():
            return None
        lnp.fill_next_token_bitmask(matcher, bits)
        return bits

    def consume(mask_bits) -> bool:
        allowed = np.flatnonzero(np.unpackbits(mask_bits[0].view(np.uint8), bitorder="little"))
        state["step"] += 1
        return matcher.consume_token(_pick(allowed.tolist(), eos, state["step"]))

    per, n = _walk(mask, consume, steps)
    return {"version": llguidance.__version__, "compile_ms": compile_ms, "mask_ms": per * 1e3, "tokens": n}


def bench_outlines_core(tokenizer_json: str, eos: int, steps: int) -> dict:
    import numpy as np
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tokens = _byte_tokens(tokenizer_json)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if i != eos and b:
            by_bytes.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, by_bytes)
    t0 = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
    compile_ms = (time.perf_counter() - t0) * 1e3
    bits = np.zeros((len(tokens) + 31) // 32, dtype=np.int32)
    state = {"step": 0}

    def mask():
        if guide.is_finished():
            return None
        guide.write_mask_into(bits.ctypes.data, bits.size, 4)
        return bits

    def consume(mask_bits) -> bool:
        allowed = np.flatnonzero(np.unpackbits(mask_bits.view(np.uint8), bitorder="little"))
        state["step"] += 1
        guide.advance(_pick(allowed.tolist(), eos, state["step"]))
        return True

    per, n = _walk(mask, consume, steps)
    return {"version": getattr(outlines_core, "__version__", "?"), "compile_ms": compile_ms, "mask_ms": per * 1e3, "tokens": n}


def bench_xgrammar(tokenizer_json: str, eos: int, steps: int) -> dict:
    import torch
    import xgrammar

    tokens = _byte_tokens(tokenizer_json)
    info = xgrammar.TokenizerInfo(tokens, vocab_type=xgrammar.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    matcher = xgrammar.GrammarMatcher(compiled)
    bits = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    state = {"step": 0}

    def mask():
        if matcher.is_terminated():
            return None
        matcher.fill_next_token_bitmask(bits)
        return bits

    def consume(mask_bits) -> bool:
        import numpy as np

        allowed = np.flatnonzero(np.unpackbits(mask_bits[0].numpy().view(np.uint8), bitorder="little"))
        state["step"] += 1
        return matcher.accept_token(_pick(allowed.tolist()[: len(tokens)], eos, state["step"]))

    del torch
    per, n = _walk(mask, consume, steps)
    return {"version": xgrammar.__version__, "compile_ms": compile_ms, "mask_ms": per * 1e3, "tokens": n}


LIBRARIES = {"llguidance": bench_llguidance, "outlines_core": bench_outlines_core, "xgrammar": bench_xgrammar}


def run(tokens: int = 200) -> dict:
    from models_registry.resolve import resolve_model

    folder = resolve_model("demo")
    tokenizer_json = (folder / "tokenizer.json").read_text(encoding="utf-8")
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    out: dict = {"model": "demo", "vocab": len(_byte_tokens(tokenizer_json)), "schema_keys": len(SCHEMA["properties"])}
    for name, fn in LIBRARIES.items():
        try:
            out[name] = fn(tokenizer_json, eos, tokens)
        except ImportError as exc:
            out[name] = {"skipped": f"not installed ({exc.name})"}
    out["loadavg"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="(the output is JSON either way)")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
