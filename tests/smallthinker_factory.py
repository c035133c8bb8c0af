"""Tiny random SmallThinker models and a plain fp64 reference written from the published
equations (transformers has no SmallThinker; the Hub's modeling code needs remote code).

The config starts from the exact keys of tests/data/real_configs/smallthinker-4b/config.json
(the published file, with its SOURCE note) with sizes shrunk; the weights are saved under the tensor names the published checkpoints use.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from moe_factory import CHATML, Fp64Reference, attention_tensors, build_chatml_tokenizer, draws, save_folder

REAL_CONFIG = Path(__file__).parent / "data" / "real_configs" / "smallthinker-4b" / "config.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def tiny_config(*, layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, active=2, ff=32,
                vocab=300, rope_layout=None, window_layout=None, window=6, softmax=None) -> dict:
    """The real config with sizes shrunk; every key of the real one is kept."""
    cfg = real_config()
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               num_hidden_layers=layers, moe_num_primary_experts=experts, moe_num_active_primary_experts=active,
               moe_ffn_hidden_size=ff, vocab_size=vocab, max_position_embeddings=512, rope_theta=10000.0,
               rope_layout=rope_layout or [1] * layers, sliding_window_layout=window_layout or [0] * layers,
               sliding_window_size=window, bos_token_id=0, eos_token_id=[0, 2])
    if softmax is not None:
        cfg["moe_primary_router_apply_softmax"] = softmax
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Weights large enough that routing, attention and the head all matter."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    _, w, norm = draws(seed, d)
    q_rows, kv_rows = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n, experts = cfg["moe_ffn_hidden_size"], cfg["moe_num_primary_experts"]
    t = {"model.embed_tokens.weight": w(cfg["vocab_size"], d, scale=1.0), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(attention_tensors(p, w, norm, d, q_rows, kv_rows))
        t[p + "block_sparse_moe.primary_router.weight"] = w(experts, d, scale=1.0)
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "gate.weight"] = w(n, d)
            t[q + "up.weight"] = w(n, d)
            t[q + "down.weight"] = w(d, n)
    return t


def build_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE with Qwen's special tokens and the ChatML template; the end of a
    turn is `<|im_end|>` (tokenizer config), of a text `<|endoftext|>` (config.json)."""
    build_chatml_tokenizer(out, vocab_size, SPECIALS, {
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "Qwen2Tokenizer",
    })


def save_model(out: Path, cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    return save_folder(out, cfg, random_weights(cfg, seed), dtype, build_tokenizer)


def smallthinker(out: Path, seed: int = 0, **sizes) -> Path:
    return save_model(out, tiny_config(**sizes), seed)


# ------------------------------------------------------------------ the reference
class Reference(Fp64Reference):
    """SmallThinker in plain fp64 torch, from the published equations, no cache."""

    def moe(self, i: int, router_input, h):
        cfg, w = self.cfg, self.w
        p = f"model.layers.{i}.block_sparse_moe."
        logits = router_input @ w[p + "primary_router.weight"].T
        top, chosen = torch.topk(logits, cfg["moe_num_active_primary_experts"], dim=-1)
        if cfg.get("moe_primary_router_apply_softmax", False):
            weights = torch.softmax(top, -1)
        else:
            weights = torch.sigmoid(top) / torch.sigmoid(top).sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for slot in range(chosen.shape[1]):
                e = int(chosen[t, slot])
                q = p + f"experts.{e}."
                act = (h[t] @ w[q + "up.weight"].T) * torch.relu(h[t] @ w[q + "gate.weight"].T)
                out[t] += weights[t, slot] * (act @ w[q + "down.weight"].T)
        return out, chosen

    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] (fp64)."""
        return self.final_hidden(ids) @ self.w["model.embed_tokens.weight"].T  # tied head

    def final_hidden(self, ids: list[int]) -> torch.Tensor:
        """The final norm's output [T, hidden] (fp64), the head's input."""
        cfg, w = self.cfg, self.w
        T, hd = len(ids), cfg["head_dim"]
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        pos = torch.arange(T)
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            router_input = x
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, hd).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
            if cfg["rope_layout"][i]:
                q, k = self._rope(q, pos), self._rope(k, pos)
            k = k.repeat_interleave(heads // kv, 0)
            v = v.repeat_interleave(heads // kv, 0)
            allowed = pos[None, :] <= pos[:, None]
            if cfg["sliding_window_layout"][i]:
                allowed &= pos[None, :] > pos[:, None] - cfg["sliding_window_size"]
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            scores = scores.masked_fill(~allowed, float("-inf"))
            attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(T, heads * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            moe, _ = self.moe(i, router_input, self._rms(x, w[p + "post_attention_layernorm.weight"]))
            x = x + moe
        return self._rms(x, w["model.norm.weight"])

    def reorder_bound(self, ids: list[int]) -> float:
        """How far two fp32 computations of these logits may differ when they sum in different
        orders (torch's GEMM blocking, numba's 8 or 16 SIMD lanes), all else the same.

        A dot product of n terms summed in fp32 in any order is the exact one with each term
        perturbed by at most gamma_n = n*u / (1 - n*u), u = 2**-24 (Higham, Accuracy and
        Stability, 3.1), so two orders differ by at most 2 * gamma_n * sum|a_i b_i|. n is the
        longest sum in the forward pass, and sum|a_i b_i| of the head, |norm(x)| @ |E|^T, the
        scale of the logits. Each layer's residual branches and the head add one such error
        (the RMSNorms rescale the stream, so a relative error passes on unamplified to first
        order): L + 1 of them."""
        cfg = self.cfg
        n = max(cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"], len(ids),
                cfg["moe_num_active_primary_experts"] * cfg["moe_ffn_hidden_size"])
        u = 2.0 ** -24
        gamma = n * u / (1 - n * u)
        scale = (self.final_hidden(ids).abs() @ self.w["model.embed_tokens.weight"].abs().T).max().item()
        return 2 * gamma * scale * (cfg["num_hidden_layers"] + 1)
