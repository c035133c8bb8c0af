"""Tiny random models of every family we support, saved in Hugging Face layout.

The weights come from `transformers` (the reference implementation), so a model built
here can be loaded both by `transformers` and by our engine and the two compared.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing in the tall green trees "
    "and an old man reads his paper by the river where boats drift slowly past the mill"
).split()


def build_tokenizer(out: Path, vocab_size: int = 256) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, with BOS/EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    sentences = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["héllo wörld ✓ 日本語 🙂"]
    tok.train_from_iterator(sentences, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))


def _save(model, out: Path, dtype: torch.dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size=min(model.config.vocab_size, 300))
    return out


def llama_relu(out: Path, *, hidden=64, layers=2, heads=4, kv_heads=2, ff=160, vocab=300, seed=0,
               dtype=torch.float32, tie=False, act="relu", **extra) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      hidden_act=act, max_position_embeddings=512, tie_word_embeddings=tie,
                      bos_token_id=0, eos_token_id=1, **extra)
    return _save(LlamaForCausalLM(cfg).eval(), out, dtype)


def mistral_drelu(out: Path, *, hidden=64, layers=2, heads=4, kv_heads=1, ff=160, vocab=300, seed=1,
                  sliding_window=None) -> Path:
    """A Mistral checkpoint whose config names Bamboo's architecture (dReLU MLP)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                        hidden_act="relu", max_position_embeddings=512, sliding_window=sliding_window,
                        bos_token_id=0, eos_token_id=1)
    model = MistralForCausalLM(cfg).eval()
    _save(model, out, torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["BambooForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def drelu_reference(model) -> None:
    """Make a transformers Mistral compute Bamboo's dReLU: relu(gate) * relu(up)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(mlp)


def falcon_relu(out: Path, *, new_arch=False, multi_query=True, hidden=64, layers=2, heads=4, kv_heads=2,
                vocab=300, seed=2, parallel=True) -> Path:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    cfg = FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_kv_heads=kv_heads if new_arch else None, new_decoder_architecture=new_arch,
                       multi_query=multi_query, parallel_attn=parallel, vocab_size=vocab, activation="relu",
                       ffn_hidden_size=160, bias=False, alibi=False, bos_token_id=0, eos_token_id=1,
                       max_position_embeddings=512)
    return _save(FalconForCausalLM(cfg).eval(), out, torch.float32)


def load_reference(path: Path):
    """The same checkpoint in `transformers`, fp32, eval mode (dReLU patched in for Bamboo)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(path) / "config.json").read_text())
    bamboo = "BambooForCausalLM" in config.get("architectures", [])
    if bamboo:
        from transformers import MistralForCausalLM

        model = MistralForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        drelu_reference(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


def rewrite_safetensors_header(src: Path, dst: Path, change) -> None:
    """dst = the safetensors file src with `change(header)` applied to its JSON header, its data
    bytes as they were (a file that lies about its tensors)."""
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
