"""Built-in chat formats (engine/runtime/chat_formats.py) and the stop tokens they bring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from app.cli import main
from engine.runtime.chat_formats import BASE_MODEL_NOTE, FORMATS, stop_tokens
from engine.runtime.tokenizer import Tokenizer
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401
from model_factory import WORDS, mistral_drelu

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(out: Path, *, eos: str = "</s>") -> dict[str, int]:
    """A byte-level BPE with ChatML's special tokens and NO chat_template (as TurboSparse ships)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["<用户> <AI> USER: [INST]"],
                            trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": eos,
                                                           "add_bos_token": False}))
    return {t: tok.token_to_id(t) for t in SPECIALS}


def _folder_with_format(tmp_path: Path, fmt: str | None) -> Path:
    folder = tmp_path / f"tok-{fmt}"
    folder.mkdir()
    _tokenizer(folder)
    if fmt:
        (folder / "thermocline").mkdir()
        (folder / "thermocline" / "download.json").write_text(json.dumps({"status": "ready", "chat_format": fmt}))
    return folder


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hello "},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]


@pytest.mark.parametrize("fmt, expected", [
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n hello <|im_end|>\n"
               "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"),
    ("minicpm", "<s>Be brief.<用户>hello<AI>hi<用户>and?<AI>"),
    ("vicuna", "<s>Be brief. USER:  hello  ASSISTANT: hi</s> USER: and? ASSISTANT:"),
    ("llama-2", "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhello [/INST] hi </s><s>[INST] and? [/INST]"),
    ("plain", "<s>Be brief.\n\n hello \n\nhi\n\nand?"),
])
def test_builtin_formats_render_what_their_authors_publish(tmp_path, fmt, expected):
    tok = Tokenizer(_folder_with_format(tmp_path, fmt))
    assert tok.chat_format == fmt and tok.has_chat_template
    assert tok.render_chat(MESSAGES) == expected
    assert tok.is_chat_model is FORMATS[fmt].is_chat


def test_minicpm_prompt_is_the_cards_single_turn_form(tmp_path):
    tok = Tokenizer(_folder_with_format(tmp_path, "minicpm"))
    assert tok.render_chat([{"role": "user", "content": "What is sparsity?"}]) == "<s><用户>What is sparsity?<AI>"


def test_chatml_end_of_turn_is_a_stop_token_and_a_models_own_template_wins(tmp_path):
    ids = _tokenizer(tmp_path)
    assert stop_tokens(FORMATS["chatml"].template) == ["<|im_end|>"]
    tok = Tokenizer(_folder_with_format(tmp_path, "chatml"))
    assert tok.stop_ids == {ids["<|im_end|>"]}
    # the prompt's special tokens are single ids, not letters
    prompt = tok.encode_chat([{"role": "user", "content": "the fox"}])
    assert prompt[0] == ids["<|im_start|>"] and ids["<|im_end|>"] in prompt
    own = _folder_with_format(tmp_path, "minicpm")
    config = json.loads((own / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (own / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(own)
    assert tok.chat_format == "model" and tok.render_chat([{"role": "user", "content": "x"}]) == "[x]"
    assert tok.is_chat_model is None


def test_templates_stay_sandboxed(tmp_path):
    folder = _folder_with_format(tmp_path, None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from engine.errors import UserError

    with pytest.raises(UserError):
        Tokenizer(folder).render_chat([{"role": "user", "content": "x"}])


# -- against the local Hub: a ChatML model (TurboSparse's layout) stops at <|im_end|> ------------
def _chatml_model(out: Path) -> dict[str, int]:
    """A tiny dReLU model (TurboSparse's BambooForCausalLM) whose config eos is </s> while a
    turn ends with <|im_end|>; its head is set so that <|im_end|> is the greedy token."""
    mistral_drelu(out, vocab=280)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink(missing_ok=True)
    ids = _tokenizer(out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="bamboo", eos_token_id=ids["</s>"], bos_token_id=ids["<s>"])
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, 0] = 50.0  # residual coordinate 0 stays large and positive
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][ids["<|im_end|>"], 0] = 1.0  # the only positive logit
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return ids


def test_a_chatml_model_from_the_hub_stops_at_im_end(local_hub, registry_env, tmp_path, capsys):
    src = tmp_path / "turbosparse"
    ids = _chatml_model(src)
    assert json.loads((src / "config.json").read_text())["eos_token_id"] != ids["<|im_end|>"]
    local_hub.add_repo(HubRepo("PowerInfer/TurboSparse-Mistral-Instruct",
                               {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}))
    assert main(["models", "download", "turbosparse-mistral", "--json"]) == 0
    model_dir = Path(json.loads(capsys.readouterr().out)["model_dir"])

    argv = ["generate", "--model", "turbosparse-mistral", "--prompt", "the fox", "--chat", "--temperature", "0",
            "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 0 and out["token_ids"] == [] and out["text"] == ""
    assert out["prompt_tokens"] > 4  # the ChatML frame around "the fox"

    # Without the catalogue's format (the same files used in place) nothing says a turn ends
    # at <|im_end|>: the model runs to the token limit. So the stop came from the format.
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("thermocline"))
    assert main(["generate", "--model", str(bare), "--prompt", "the fox", "--chat", "--temperature", "0",
                 "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == [ids["<|im_end|>"]] * 6


def test_base_models_say_so_in_the_cli(registry_env, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln and not ln.startswith("models folder")}
    for model_id in ("relullama-7b", "prosparse-llama-2-7b", "bamboo-base", "relufalcon-40b"):
        assert lines[model_id].endswith(BASE_MODEL_NOTE)
    assert lines["minicpm-s-1b"].endswith("chat model")
    assert list(lines)[0] == "minicpm-s-1b"


def test_terminal_chat_says_when_a_model_is_a_base_model(tmp_path, capsys, monkeypatch):
    import io

    folder = tmp_path / "base"
    _chatml_model(folder)
    (folder / "thermocline").mkdir()
    (folder / "thermocline" / "download.json").write_text(json.dumps({"status": "ready", "chat_format": "plain"}))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # the user leaves at once
    assert main(["chat", "--model", str(folder)]) == 0
    assert f"note: {BASE_MODEL_NOTE}" in capsys.readouterr().out
    (folder / "thermocline" / "download.json").write_text(json.dumps({"status": "ready", "chat_format": "chatml"}))
    assert main(["chat", "--model", str(folder)]) == 0
    assert BASE_MODEL_NOTE not in capsys.readouterr().out


def test_sentencepiece_only_tokenizer_gets_template_specials_as_single_ids(tmp_path):
    """Bamboo ships tokenizer.model only, names bos/eos in special_tokens_map.json, and its DPO
    model's format (Vicuna) writes <s> and </s> as text: they must be one id each."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([" ".join(WORDS)] * 50 + ["USER: ASSISTANT: a b c"] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}))
    (tmp_path / "thermocline").mkdir()
    (tmp_path / "thermocline" / "download.json").write_text(json.dumps({"chat_format": "vicuna"}))
    tok = Tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode_chat([{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "a dog"},
                           {"role": "user", "content": "the dog"}])
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(1) == 1
    assert tok.decode(ids).endswith("USER: the dog ASSISTANT:")
