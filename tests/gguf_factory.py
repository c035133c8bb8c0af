"""GGUF files written from a tiny Hugging Face model with ggml's `gguf` package, the way
PowerInfer's convert.py lays them out: q/k rows permuted for ggml's rotary, the down
projection transposed (`ffn_down_t`), predictors `blk.N.fc1/fc2`, the magic `PWRI` (PowerInfer's post-processing
overwrites the first four bytes); and `powerinfer_gguf`, a file of predictors around random
tensors, for the predictor readers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert.py's q/k permutation (HF rotary halves -> ggml's interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def random_k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid K-quant rows [rows, row bytes] of random codes with small scales (the gguf package
    cannot quantize to K-quants): block_q4_K = fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins,
    128 of nibbles (144 bytes per 256 weights); block_q6_K = 128 + 64 bytes of codes, 16 int8
    scales, fp16 d last (210 bytes)."""
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    if kind == "Q6_K":
        blocks[:, 208:] = (rng.random(len(blocks)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:  # d and dmin: weights d * scale * q - dmin * min, centred near 0
        blocks[:, 0:2] = (rng.random(len(blocks)) * 2e-4 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (rng.random(len(blocks)) * 2e-3 + 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


# llama-quantize's Q4_K_M: Q4_K matrices, Q6_K for attn_v, ffn_down and the output head
# (llama.cpp's llama_tensor_get_type gives half the layers' ffn_down / attn_v Q6_K; all here)
Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}


def write_gguf(hf_dir: Path, out: Path, *, qtype: str = "F16", powerinfer: bool = True,
               predictors: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
               sparse_threshold: float | None = None, arch: str = "llama", q6_k: tuple[str, ...] = (),
               q4_scales: str = "reference") -> Path:
    """qtype "Q4_K_M": every matrix random K-quant blocks of llama-quantize's Q4_K_M types
    (`random_k_blocks`, `Q4_K_M`; the embeddings Q4_K too), norms F32."""
    """Write hf_dir's model (llama layout) as a GGUF. qtype: F16, BF16-less F32, Q8_0 or Q4_0 for
    the 2-D weights (norms stay F32, as llama.cpp keeps them). Tensors named in `q6_k` become
    random Q6_K blocks (llama-quantize's type for the output head of a Q4_0 file; the gguf
    package cannot quantize to it). q4_scales: "reference" (ggml's rounding) or "symmetric"
    (`symmetric_q4_0`: blocks ggml's quantizer never writes, as an imatrix file's are not)."""
    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    # transformers 5 writes rope_theta inside rope_parameters
    w.add_rope_freq_base(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_tokenizer_model("gpt2")
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])]
    w.add_token_list(tokens)
    special = {a["content"] for a in tok["added_tokens"]}
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(True)
    if sparse_threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", sparse_threshold)
    kind = gguf.GGMLQuantizationType[qtype] if qtype != "Q4_K_M" else None

    def add(name, a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype == "Q4_K_M" and a.ndim == 2:
            k = next((v for suffix, v in Q4_K_M.items() if name.endswith(suffix)), "Q4_K")
            w.add_tensor(name, random_k_blocks(k, *a.shape, seed=len(name) * 131 + a.shape[0]),
                         raw_dtype=gguf.GGMLQuantizationType[k])
        elif name in q6_k:  # block_q6_K: ql[128] qh[64] int8 scales[16], fp16 d: 210 bytes per 256 weights
            rng = np.random.default_rng(len(name))
            blocks = rng.integers(0, 256, size=(a.shape[0] * a.shape[1] // 256, 210), dtype=np.uint8)
            blocks[:, 208:] = (rng.random(len(blocks)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
            w.add_tensor(name, blocks.reshape(a.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif a.ndim == 1 or qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        elif qtype == "Q4_0" and q4_scales == "symmetric":
            w.add_tensor(name, symmetric_q4_0(a), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    for name, a in sorted(_tensors(hf_dir).items()):
        a = a.astype(np.float32)
        if name in GLOBALS:
            add(GLOBALS[name], a)
            continue
        _, _, i, rest = name.split(".", 3)
        new = LAYER[rest]
        if new == "attn_q.weight" and arch != "qwen2":  # qwen2's converter keeps HF's layout
            a = permute(a, heads)
        elif new == "attn_k.weight" and arch != "qwen2":
            a = permute(a, kv)
        elif new == "ffn_down.weight" and powerinfer:
            new, a = "ffn_down_t.weight", a.T
        add(f"blk.{i}.{new}", a)
    if predictors is not None:
        for i, (fc1, fc2) in enumerate(zip(*predictors)):
            add(f"blk.{i}.fc1.weight", fc1)
            add(f"blk.{i}.fc2.weight", fc2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if powerinfer:
        with open(out, "r+b") as f:
            f.write(b"PWRI")
    return out


def symmetric_q4_0(a: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [rows, row bytes] with the scale max|w| / 7 and codes round(w / d) + 8 in
    1..15: a valid choice (as an imatrix quantization's scales are), but not ggml's reference
    rounding (scale -max / 8, the code 0 used), so requantizing the values changes the bytes."""
    blocks = a.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / 7).astype(np.float16)
    inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(d, dtype=np.float32), where=d != 0)
    q = (np.clip(np.rint(blocks * inv), -7, 7) + 8).astype(np.uint8)
    out = np.empty((len(blocks), 18), dtype=np.uint8)
    out[:, :2] = d.view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.reshape(a.shape[0], -1)


def powerinfer_gguf(path: Path, *, layers: int, d: int, n_ff: int, rank: int = 8, vocab: int = 300,
                    threshold: float | None = 0.0, tokens: int = 4000, seed: int = 0,
                    fc1_f16: bool = True) -> dict[str, np.ndarray]:
    """Write a GGUF with a vocabulary (a header of some size), dense model tensors and per-layer
    predictors `blk.N.fc1.weight` [rank, d] / `blk.N.fc2.weight` [n_ff, rank]; return the predictors."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(n_ff)
    if threshold is not None:
        writer.add_float32("powerinfer.sparse_threshold", threshold)
    writer.add_token_list([f"tok{i}-{'x' * (i % 40)}" for i in range(tokens)])  # makes the header long
    predictors = {}
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float16))
    for i in range(layers):
        fc1 = rng.standard_normal((rank, d)).astype(np.float16 if fc1_f16 else np.float32)
        fc2 = rng.standard_normal((n_ff, rank)).astype(np.float32)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((n_ff, d)).astype(np.float16))
        writer.add_tensor(f"blk.{i}.fc1.weight", fc1)
        writer.add_tensor(f"blk.{i}.fc2.weight", fc2)
        writer.add_tensor(f"blk.{i}.ffn_down_t.weight", rng.standard_normal((n_ff, d)).astype(np.float16))
        predictors[f"layers.{i}.fc1.weight"], predictors[f"layers.{i}.fc2.weight"] = fc1, fc2
    writer.add_tensor("output.weight", rng.standard_normal((vocab, d)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(path, "r+b") as f:
        f.write(b"PWRI")
    return predictors
