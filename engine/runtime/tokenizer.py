"""Tokenizers and chat templates.

`tokenizer.json` goes through the `tokenizers` library, a bare `tokenizer.model`
through sentencepiece (Bamboo ships only that), with the added tokens of
`added_tokens.json` / `tokenizer_config.json` (TurboSparse's ChatML markers) and the
special tokens of `special_tokens_map.json` when `tokenizer_config.json` is missing. Chat templates from `tokenizer_config.json` are rendered in a
jinja2 sandbox (they are untrusted text from the internet); base models without one
get a plain User/Assistant template.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2 import meta as jinja2_meta

from engine.runtime import chat_formats
from engine.errors import ModelFormatError, UserError
from engine.runtime.template_sandbox import OUTPUT_CAP, BoundedSandbox, TemplateLimitError

PLAIN_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        self.config = _read_json(config_path)
        if not isinstance(self.config, dict):
            raise ModelFormatError(f"{config_path} is not a JSON object")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):  # the config's own win
            if isinstance(special_map, dict) and self.config.get(key) is None and special_map.get(key) is not None:
                self.config[key] = special_map[key]
        self._hf = self._sp = None
        self._added: dict[str, int] = {}  # sentencepiece only: tokens beyond the model's pieces
        self._added_split = None
        if (model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
            except Exception as exc:  # noqa: BLE001 - the Rust library raises a bare Exception
                raise ModelFormatError(f"cannot read tokenizer.json: {exc}") from None
        elif (model_dir / "tokenizer.model").is_file():
            import sentencepiece

            self._sp = sentencepiece.SentencePieceProcessor()
            try:
                self._sp.Load(str(model_dir / "tokenizer.model"))
            except (OSError, RuntimeError) as exc:
                raise ModelFormatError(f"cannot read tokenizer.model: {exc}") from None
            self._load_added_tokens(model_dir)
        else:
            raise ModelFormatError(f"{model_dir} has neither tokenizer.json nor tokenizer.model")

        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        if self._sp is not None:  # no config naming them: the sentencepiece model's own
            if self.bos_token is None and self._sp.bos_id() >= 0:
                self.bos_token = self._sp.IdToPiece(self._sp.bos_id())
            if self.eos_token is None and self._sp.eos_id() >= 0:
                self.eos_token = self._sp.IdToPiece(self._sp.eos_id())
        self.add_bos = bool(self.config.get("add_bos_token", self._sp is not None))
        self.bos_id = self.token_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_id(self.eos_token) if self.eos_token else None
        self.special_ids = self._special_ids()
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.template_name = f"the chat template of {model_dir.name} (tokenizer_config.json)"
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"{self.template_name} is a {type(template).__name__}, not text; "
                                   "fix or remove chat_template")
        # No template of its own: the built-in format the catalogue named (engine/runtime/chat_formats.py).
        builtin = None if template else chat_formats.recorded_format(model_dir)
        if builtin:
            self.template_name = f"the built-in {builtin.name} chat format"
        template = template or (builtin.template if builtin else None)
        self.has_chat_template = bool(template)
        self.chat_format = builtin.name if builtin else ("model" if template else None)
        self.is_chat_model = builtin.is_chat if builtin else None  # None: not known
        self.stop_ids = {i for i in map(self.token_id, chat_formats.stop_tokens(template or "")) if i is not None}
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._env = env
        try:
            self._template = env.from_string(template or PLAIN_TEMPLATE)
            # Whether the template reads `tools` (Hugging Face's templates take them so): the server
            # offers tool_choice "auto" only to a template that shows the model its tools.
            self.takes_tools = "tools" in jinja2_meta.find_undeclared_variables(env.parse(template or PLAIN_TEMPLATE))
        except (TemplateError, RecursionError, MemoryError) as exc:
            raise ModelFormatError(f"{self.template_name} does not parse: {exc}") from None
        self.template_source = template or PLAIN_TEMPLATE

    def _load_added_tokens(self, model_dir: Path) -> None:
        """Tokens added beside a sentencepiece model (ids past its pieces, or replacing one)."""
        added = _read_json(model_dir / "added_tokens.json")
        decoder = self.config.get("added_tokens_decoder")
        entries = dict(added) if isinstance(added, dict) else {}
        if isinstance(decoder, dict):
            entries.update({v.get("content"): k for k, v in decoder.items() if isinstance(v, dict)})
        for text, value in entries.items():
            try:
                token_id = int(value)
            except (TypeError, ValueError):
                raise ModelFormatError(f"added token {text!r} has no integer id ({value!r})") from None
            if isinstance(text, str) and text and token_id >= 0:
                if token_id < self._sp.GetPieceSize() and self._sp.IdToPiece(token_id) == text:
                    continue  # one of the model's own pieces
                self._added[text] = token_id
        if self._added:
            self._added_ids = {i: t for t, i in self._added.items()}
            pattern = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
            self._added_split = re.compile(f"({pattern})")

    def _special_ids(self) -> set[int]:
        ids = {i for i in (self.bos_id, self.eos_id) if i is not None}
        if self._hf is not None:
            for token in self._hf.get_added_tokens_decoder().values():
                if token.special:
                    ids.add(self._hf.token_to_id(token.content))
        elif self._sp is not None:
            ids.update(i for i in range(self._sp.GetPieceSize()) if self._sp.IsControl(i))
            ids.update(self._added.values())
        return ids

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce and decode (a model's vocabulary may be larger:
        rows past this one are padding and are never sampled)."""
        if self._hf is not None:
            return self._hf.get_vocab_size()
        return max([self._sp.GetPieceSize(), *(i + 1 for i in self._added.values())])

    def token_id(self, token: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(token)
        if token in self._added:
            return self._added[token]
        pid = self._sp.PieceToId(token)
        return pid if self._sp.IdToPiece(pid) == token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf is not None:
            ids = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
            has_bos = bool(ids) and ids[0] == self.bos_id
        else:
            ids = self._sp_encode(text)
            has_bos = False
        if add_special_tokens and self.add_bos and self.bos_id is not None and not has_bos:
            ids = [self.bos_id] + ids
        return list(ids)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp_decode(list(ids))

    def _sp_encode(self, text: str) -> list[int]:
        """sentencepiece reads added tokens and `<s>`/`</s>` in text as letters; a template
        writes them as tokens, so they are cut out and mapped to their ids."""
        marks = dict(self._added)
        for token, token_id in ((self.bos_token, self.bos_id), (self.eos_token, self.eos_id)):
            if token and token_id is not None:
                marks.setdefault(token, token_id)
        present = [t for t in marks if t in text]
        if not present:
            return list(self._sp.EncodeAsIds(text))
        pattern = "|".join(re.escape(t) for t in sorted(present, key=len, reverse=True))
        ids: list[int] = []
        for part in re.split(f"({pattern})", text):  # odd parts are the marks
            if part in marks:
                ids.append(marks[part])
            elif part:
                ids += self._sp.EncodeAsIds(part)
        return ids

    def _sp_decode(self, ids: list[int]) -> str:
        if not self._added:
            return self._sp.DecodeIds(ids)
        out, run = [], []
        for i in ids:
            if i in self._added_ids:
                out += [self._sp.DecodeIds(run), self._added_ids[i]]
                run = []
            else:
                run.append(i)
        return "".join(out + [self._sp.DecodeIds(run)])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        # Bounded in time and size (engine.template_sandbox); the cap leaves room for the
        # conversation itself, which a template legitimately repeats once.
        given = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
                    for m in messages if isinstance(m, dict)) + len(str(tools or ""))
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._env.render(
                self._template, cap=OUTPUT_CAP + 2 * given,
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
            )
        except TemplateLimitError as exc:
            raise UserError(f"{self.template_name} was stopped: {exc}; the template is broken or "
                            "hostile: replace it") from None
        except TemplateError as exc:
            raise UserError(f"{self.template_name} refused this conversation: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template's own bug (a TypeError, a KeyError)
            raise UserError(f"{self.template_name} failed: {exc.__class__.__name__}: {exc}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template writes BOS itself where the model wants it.
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


def _read_json(path: Path):
    """A tokenizer side file: {} when absent, a ModelFormatError when unreadable."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from None


def _raise_template_error(message: str):
    raise TemplateError(message)


class StreamDecoder:
    """Turns token ids into text pieces that never split a UTF-8 character.

    Decodes a short window of recent ids and emits the difference, so word-leading
    spaces and multi-byte characters come out right (the offsets trick of vLLM/TGI).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete character (or a token with no text yet)
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back at the end (a dangling partial character)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
