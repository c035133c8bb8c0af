"""What the MoE families' tiny models share (smallthinker_factory, turbosparse_mixtral_factory):
random tensors drawn in a fixed order, the attention tensors under the names both publish, a
ChatML byte-level BPE with a family's special tokens, the folder writer, and the plain fp64
reference's RMSNorm, RoPE and greedy loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def draws(seed: int, d: int):
    """(g, w, norm): the generator, w(*shape, scale) ~ N(0, 1/fan_in) unless scaled, norm() a
    norm weight near 1 of width d. Every tensor comes from g in the order it is asked for."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1.0 + 0.2 * torch.randn(d, generator=g)

    return g, w, norm


def attention_tensors(p: str, w, norm, d: int, q_rows: int, kv_rows: int) -> dict[str, torch.Tensor]:
    """Layer p's norms and attention projections (Llama's names), drawn in this order."""
    return {
        p + "input_layernorm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": w(q_rows, d),
        p + "self_attn.k_proj.weight": w(kv_rows, d),
        p + "self_attn.v_proj.weight": w(kv_rows, d),
        p + "self_attn.o_proj.weight": w(d, q_rows),
    }


def build_chatml_tokenizer(out: Path, vocab_size: int, specials: list[str], tokenizer_config: dict) -> None:
    """A byte-level BPE over model_factory's words with `specials` first, and the family's
    tokenizer_config.json (which names the turn's end and carries CHATML)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from model_factory import WORDS

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def save_folder(out: Path, cfg: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype, build_tokenizer) -> Path:
    """The Hugging Face folder: config.json, model.safetensors (weights in dtype), the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    build_tokenizer(out, min(cfg["vocab_size"], 300))
    return out


class Fp64Reference:
    """The parts of a family's plain fp64 reference that do not depend on the family; the
    family's class adds `forward(ids) -> logits [T, vocab]`."""

    def __init__(self, path: Path):
        self.cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}

    def _rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * weight

    def _rope(self, x, positions):
        hd = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = positions[:, None].double() * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rotated * sin

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        ids = list(ids)
        out = []
        for _ in range(steps):
            token = int(self.forward(ids)[-1].argmax())
            out.append(token)
            ids.append(token)
        return out
