"""A GGUF's vocabulary as tokenizer.json and tokenizer_config.json (the tokenizers library's)."""

from __future__ import annotations

from engine.errors import ModelFormatError, UserError
from engine.loading.gguf_reader import GgufModel


def tokenizer_json(m: GgufModel) -> dict:
    """A tokenizers-library tokenizer.json from the GGUF's vocabulary: byte-level BPE
    (`gpt2`: tokens and merges) or SentencePiece BPE (`llama`: tokens and scores, merges
    rebuilt from the scores, byte fallback)."""
    f = m.fields
    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFormatError(f"{m.path.name} has no vocabulary (tokenizer.ggml.tokens)")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(f"{m.path.name} is corrupt: {len(tokens)} tokens but {len(types)} token types")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    special = [i for i, t in enumerate(types) if t in (3, 4)]  # CONTROL, USER_DEFINED
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == 3} for i in special]
    bos = f.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None \
        and 0 <= int(bos) < len(tokens)
    # BOS added by the tokenizer, as llama.cpp does when the file asks for it
    bos_processor = {"type": "TemplateProcessing",
                     "single": [{"SpecialToken": {"id": tokens[int(bos)], "type_id": 0}},
                                {"Sequence": {"id": "A", "type_id": 0}}],
                     "pair": [{"SpecialToken": {"id": tokens[int(bos)], "type_id": 0}},
                              {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                     "special_tokens": {tokens[int(bos)]: {"id": tokens[int(bos)], "ids": [int(bos)],
                                                           "tokens": [tokens[int(bos)]]}}} if add_bos else None
    if kind == "gpt2":
        merges = f.get("tokenizer.ggml.merges") or []
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": vocab, "merges": [m_.split(" ", 1) for m_ in merges]}
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": True},
                "post_processor": bos_processor or {"type": "ByteLevel", "add_prefix_space": True,
                                                    "trim_offsets": False, "use_regex": True},
                "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                "model": model}
    if kind == "llama":
        scores = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        model = {"type": "BPE", "dropout": None, "unk_token": "<unk>" if "<unk>" in vocab else None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                 "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                 "merges": _merges_from_scores(tokens, scores, types)}
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                "normalizer": {"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "},
                                                               "content": "\u2581"}]},
                "pre_tokenizer": None, "post_processor": bos_processor,
                "decoder": {"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
                "model": model}
    raise UserError(f"{m.path.name} has a {kind!r} tokenizer; Thermocline rebuilds llama (SentencePiece) and "
                    "gpt2 (byte-level BPE) vocabularies")


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """SentencePiece BPE merges: every split of a normal token into two tokens of the
    vocabulary, ordered by the merged token's score (higher first), then by the pieces'."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    return [[left, right] for _, _, _, left, right in merges]


def tokenizer_config(m: GgufModel, tokenizer: dict) -> dict:
    f = m.fields
    tokens = f.get("tokenizer.ggml.tokens")

    def token(key):
        i = f.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
              "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
              "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", m.fields.get("tokenizer.ggml.model")
                                          == "llama"))}
    template = f.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}
