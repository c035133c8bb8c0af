"""A GGUF's vocabulary as tokenizer.json and tokenizer_config.json (the tokenizers library's)."""

from __future__ import annotations

import logging

from engine.errors import ModelFormatError, UserError
from engine.loading.gguf_reader import GgufModel

log = logging.getLogger(__name__)


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
        pre_tokenizer, ignore_merges = byte_level_pre_tokenizer(m)
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "ignore_merges": ignore_merges, "vocab": vocab, "merges": [m_.split(" ", 1) for m_ in merges]}
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                "pre_tokenizer": pre_tokenizer,
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


# How a byte-level BPE vocabulary splits text before its merges run. A GGUF names its splitter
# in `tokenizer.ggml.pre` (llama.cpp's names; the patterns are the ones the models' own
# tokenizer.json files publish, which llama.cpp rewrites for its regex engine). Splitting with
# GPT-2's pattern where a file asks for another gives other tokens than the model was trained
# on: Qwen2 reads digits one by one, Llama 3 in threes, and both attach a leading symbol to a word.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# splitter -> (patterns applied in turn, each cutting the pieces the previous ones left; whether a
# word found whole in the vocabulary skips the merges, as llama.cpp's `ignore_merges`)
BYTE_LEVEL_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt2": ((_GPT2,), False),
    "digits+gpt2": ((r"\p{N}", _GPT2), False),  # StarCoder's and SmolLM's: every digit alone
    "llama3": ((_LLAMA3,), True),
    "llama3-merges": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False),
    "tekken": ((_TEKKEN,), True),
    "gpt-4o": ((_GPT4O,), False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False),
}
# llama.cpp's `tokenizer.ggml.pre` names -> the splitter each takes
PRE_NAMES = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
                     "mellum", "a.x-4.0", "gigachat"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    "digits+gpt2"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), "llama3-merges"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"), "qwen2"),
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4"), "gpt-4o"),
    "falcon": "falcon",
    "default": "default",
}


def byte_level_pre_tokenizer(m: GgufModel) -> tuple[dict, bool]:
    """The tokenizer.json pre_tokenizer for the splitter the GGUF names, and whether whole words
    skip the merges. A file without the field takes llama.cpp's default splitter. A name we do
    not know keeps GPT-2's split, as every file had before the names were read (DeepSeek's and
    BLOOM's files loaded that way), with a warning that some words may split differently."""
    name = m.fields.get("tokenizer.ggml.pre") or "default"
    if not isinstance(name, str) or name not in PRE_NAMES:
        log.warning("%s names the %s pre-tokenizer, which Thermocline does not know; splitting its text as "
                    "GPT-2 does, so some words may take other tokens than the model was trained on",
                    m.path.name, repr(name)[:60])
        name = "gpt-2"
    patterns, ignore_merges = BYTE_LEVEL_SPLITS[PRE_NAMES[name]]
    if patterns == (_GPT2,):  # GPT-2's own split is ByteLevel's built-in one
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, False
    splits = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in patterns]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}, ignore_merges


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
