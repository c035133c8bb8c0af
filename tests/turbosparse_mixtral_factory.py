"""Tiny random TurboSparse-Mixtral models and a plain fp64 reference written from the
published equations (modeling_turbosparsemixtral.py; transformers has no class for it).

The config starts from the exact keys of tests/data/real_configs/turbosparse-mixtral/config.json
(the published file, with its SOURCE note) with sizes shrunk; the weights are saved under the
tensor names the published checkpoint uses (tensors.txt there), predictors of a different
rank per layer as the published code has (896 to 1344 at full size).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from moe_factory import CHATML, Fp64Reference, attention_tensors, build_chatml_tokenizer, draws, save_folder

REAL_DIR = Path(__file__).parent / "data" / "real_configs" / "turbosparse-mixtral"
REAL_CONFIG = REAL_DIR / "config.json"
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>", "<|im_start|>"]  # bos 1, eos 2 as config.json says


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def tiny_config(*, layers=3, hidden=64, heads=4, kv_heads=2, experts=4, active=2, ff=48, vocab=300) -> dict:
    """The real config with sizes shrunk; every key of the real one is kept."""
    cfg = real_config()
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
               num_local_experts=experts, num_experts_per_tok=active, intermediate_size=ff, vocab_size=vocab,
               max_position_embeddings=512, rope_theta=10000.0)
    return cfg


def ranks(cfg: dict) -> list[int]:
    """Predictor ranks per layer (they differ per layer, as in the published code)."""
    return [8 + 4 * (i % 3) for i in range(cfg["num_hidden_layers"])]


def random_weights(cfg: dict, seed: int, predictor_gain: float = 1.0) -> dict[str, torch.Tensor]:
    """Weights large enough that routing, attention, the predictors and the head all matter.
    The predictors see the expert's w1 rows (a predictor learns where w1 x > 0), plus noise,
    so they choose about half of the neurons and disagree with dReLU on some."""
    d = cfg["hidden_size"]
    g, w, norm = draws(seed, d)
    hd = d // cfg["num_attention_heads"]
    q_rows, kv_rows = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n, experts = cfg["intermediate_size"], cfg["num_local_experts"]
    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], d, scale=1.0), "model.norm.weight": norm(),
         "lm_head.weight": w(cfg["vocab_size"], d)}
    for i, rank in enumerate(ranks(cfg)):
        p = f"model.layers.{i}."
        t.update(attention_tensors(p, w, norm, d, q_rows, kv_rows))
        t[p + "block_sparse_moe.gate.weight"] = w(experts, d, scale=1.0)
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            w1 = w(n, d)
            t[q + "w1.weight"] = w1
            t[q + "w2.weight"] = w(d, n)
            t[q + "w3.weight"] = w(n, d)
            fc1 = w(rank, d)
            # fc2 @ relu(fc1 x) ~ w1 x where fc1 spans it: a least-squares fit, with noise
            fit = torch.linalg.lstsq(torch.relu(fc1 @ torch.randn(d, 256, generator=g)).T,
                                     (w1 @ torch.randn(d, 256, generator=g)).T).solution.T
            t[q + "predictor.fc1.weight"] = fc1
            t[q + "predictor.fc2.weight"] = predictor_gain * (fit + 0.3 * w(n, rank))
    return t


def build_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE with the Instruct model's ChatML turn tokens (`<|im_end|>` ends a turn)."""
    build_chatml_tokenizer(out, vocab_size, SPECIALS, {
        "bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML,
    })


def save_model(out: Path, cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    return save_folder(out, cfg, random_weights(cfg, seed), dtype, build_tokenizer)


def turbosparse_mixtral(out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes) -> Path:
    return save_model(out, tiny_config(**sizes), seed, dtype)


# ------------------------------------------------------------------ the reference
class Reference(Fp64Reference):
    """TurboSparse-Mixtral in plain fp64 torch, from the published equations, no cache.
    `masks=False`: the same experts without the predictors' masks (every neuron), what the
    dense mode computes."""

    def __init__(self, path: Path, masks: bool = True):
        super().__init__(path)
        self.masks = masks
        self.chosen: list[torch.Tensor] = []  # per layer: [T, k] experts of the last forward
        self.selected = 0  # neurons the predictors let through, over chosen experts (last forward)
        self.considered = 0

    def moe(self, i: int, h):
        """The sparse MoE block on the normed FFN input h [T, d]."""
        cfg, w = self.cfg, self.w
        p = f"model.layers.{i}.block_sparse_moe."
        probs = torch.softmax(h @ w[p + "gate.weight"].T, -1)  # softmax over all experts
        top, chosen = torch.topk(probs, cfg["num_experts_per_tok"], dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        self.chosen.append(chosen)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for slot in range(chosen.shape[1]):
                q = p + f"experts.{int(chosen[t, slot])}."
                act = torch.relu(h[t] @ w[q + "w1.weight"].T) * torch.relu(h[t] @ w[q + "w3.weight"].T)
                if self.masks:
                    pred = torch.sigmoid(torch.relu(h[t] @ w[q + "predictor.fc1.weight"].T)
                                         @ w[q + "predictor.fc2.weight"].T)
                    mask = torch.round(pred)  # round half to even: 0.5 -> 0
                    act = act * mask
                    self.selected += int(mask.sum())
                self.considered += act.shape[0]
                out[t] += weights[t, slot] * (act @ w[q + "w2.weight"].T)
        return out

    def final_hidden(self, ids: list[int]) -> torch.Tensor:
        """The final norm's output [T, hidden] (fp64), the head's input."""
        cfg, w = self.cfg, self.w
        self.chosen, self.selected, self.considered = [], 0, 0
        T = len(ids)
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg["hidden_size"] // heads
        pos = torch.arange(T)
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, hd).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k = k.repeat_interleave(heads // kv, 0)
            v = v.repeat_interleave(heads // kv, 0)
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            scores = scores.masked_fill(~(pos[None, :] <= pos[:, None]), float("-inf"))
            attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(T, heads * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            x = x + self.moe(i, self._rms(x, w[p + "post_attention_layernorm.weight"]))
        return self._rms(x, w["model.norm.weight"])

    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] (fp64)."""
        return self.final_hidden(ids) @ self.w["lm_head.weight"].T
