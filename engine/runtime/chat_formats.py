"""Built-in chat formats for models whose tokenizer_config.json carries no chat_template.

Many sparse models (Bamboo, MiniCPM-S, TurboSparse, the ReLU Llamas) publish their prompt
format only in a model card. The catalogue names one of these formats; a download records
it in the model's `thermocline/download.json` (`chat_format`), and the tokenizer renders it
in the same jinja2 sandbox as a model's own template. Each is written from the format its
authors publish:
- chatml: `<|im_start|>role\\n...<|im_end|>\\n`, turns end with `<|im_end|>` (TurboSparse).
- vicuna: v1.1, `USER: ... ASSISTANT: ...</s>` (Bamboo-DPO's authors name Vicuna or ChatML).
- minicpm: `<s><用户>{prompt}<AI>` (MiniCPM-S-1B-sft's card).
- llama-2: `<s>[INST] <<SYS>>...<</SYS>> ... [/INST] ... </s>`.
- plain: a base model continues the text: the messages' contents, nothing added.

Stop tokens: a chat turn ends where its format says, which is not always the config's
eos (TurboSparse: config eos 2, turns end with `<|im_end|>`, id 32000), so the end-of-turn
tokens written in a template count as stop tokens too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BASE_MODEL_NOTE = "base model: continues text, not an assistant"
STATE_FILE = Path("thermocline") / "download.json"  # written by models_registry (state.py)

# Tokens that end a turn in the templates of the families we know.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>")


@dataclass(frozen=True)
class ChatFormat:
    name: str
    template: str
    is_chat: bool = True  # False: plain continuation for base models


_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                  "The assistant gives helpful, detailed, and polite answers to the user's questions.")

FORMATS = {
    "chatml": ChatFormat("chatml", (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )),
    "vicuna": ChatFormat("vicuna", (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
        "{% else %}" + _VICUNA_SYSTEM + "{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'user' %} USER: {{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %} ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
    )),
    "minicpm": ChatFormat("minicpm", (
        "{{ bos_token }}"
        "{% for m in messages %}"
        "{% if m['role'] == 'user' %}<用户>{{ m['content'] | trim }}<AI>"
        "{% else %}{{ m['content'] | trim }}{% endif %}"
        "{% endfor %}"
    )),
    "llama-2": ChatFormat("llama-2", (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.system = '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' %}"
        "{% elif m['role'] == 'user' %}{{ bos_token }}[INST] {{ ns.system }}{{ m['content'] | trim }} [/INST]"
        "{% set ns.system = '' %}"
        "{% else %} {{ m['content'] | trim }} {{ eos_token }}{% endif %}"
        "{% endfor %}"
    )),
    "plain": ChatFormat("plain", (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
        "{{ '\\n\\n' if not loop.last else '' }}{% endfor %}"
    ), is_chat=False),
}


def get_format(name: str | None) -> ChatFormat | None:
    return FORMATS.get(name) if name else None


def recorded_format(model_dir: Path) -> ChatFormat | None:
    """The built-in format the catalogue named for this model at download time, if any."""
    try:
        state = json.loads((Path(model_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return get_format(state.get("chat_format")) if isinstance(state, dict) else None


def stop_tokens(template: str) -> list[str]:
    """The end-of-turn tokens a template writes (as text); the generation stops at them."""
    return [t for t in END_OF_TURN_TOKENS if t in template]
