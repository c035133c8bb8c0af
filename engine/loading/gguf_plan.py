"""Where each GGUF tensor goes in the Hugging Face checkpoint, and as what: the tensor plan.

A weight keeps the file's float type (F16/BF16/F32) or its blocks (Q4_0/Q8_0 and the
ggml_quants types: the checkpoint's quantized tensor kinds, `NAME.q4_0`, `NAME.t.q4_0` for
PowerInfer's transposed down projection); q/k rows are reordered to undo convert.py's rotary
permutation; predictors stay at the file's precision. `import_output_bytes` is the size this
plan writes, from a header alone (the download's disk check).
"""

from __future__ import annotations

import math
import re

import numpy as np

from engine.errors import ModelFormatError, UserError
from engine.kernels.ggml_quants import TYPE_NAMES as BLOCK_TYPES
from engine.kernels.tensor_kinds import quant_name
from engine.loading.gguf_reader import GgufModel, GgufTensor, dequantize, unpermute

_ROWS_PER_STEP = 4096  # rows dequantized at a time: bounds the fp32 copy

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight", "ffn_down_t.weight": "mlp.down_proj.weight",
                "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                "attn_v.bias": "self_attn.v_proj.bias"}
# Architectures whose converter permutes q/k rows for ggml's interleaved rotary (convert.py's
# LlamaModel); qwen2's keeps HF's rotate_half layout (NeoX rotary in llama.cpp): copied as they are
_PERMUTED = ("llama", "bamboo")


def tensor_plan(m: GgufModel, config: dict) -> tuple[list[tuple[str, GgufTensor, str]], dict[int, dict]]:
    """(HF name, tensor, how) for every weight, and the predictors per layer."""
    plan, predictors = [], {}
    layers = config["num_hidden_layers"]
    for name, t in m.tensors.items():
        if name in _GLOBAL_NAMES:
            plan.append((_GLOBAL_NAMES[name], t, "copy"))
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or int(parts[1]) >= layers:
            if name in ("rope_freqs.weight",):
                continue  # llama.cpp's precomputed rotary factors: derived from the config again
            raise UserError(f"{m.path.name}: tensor {name} is not one Thermocline knows how to place")
        i, rest = int(parts[1]), parts[2]
        if rest in ("fc1.weight", "fc2.weight"):
            predictors.setdefault(i, {})[rest] = t
            continue
        if rest not in _LAYER_NAMES:
            raise UserError(f"{m.path.name}: tensor {name} is not one Thermocline knows how to place")
        permuted = m.arch in _PERMUTED
        if rest.endswith(".bias") and permuted and rest != "attn_v.bias":
            raise UserError(f"{m.path.name}: tensor {name} is a q/k bias of a {m.arch} file, whose rows convert.py "
                            "permutes; Thermocline reads q/k/v biases of qwen2 files")
        how = {"attn_q.weight": "unpermute_q" if permuted else "copy",
               "attn_k.weight": "unpermute_k" if permuted else "copy",
               "ffn_down_t.weight": "transpose"}.get(rest, "copy")
        plan.append((f"model.layers.{i}.{_LAYER_NAMES[rest]}", t, how))
    names = [p[0] for p in plan]
    if len(set(names)) != len(names):
        raise ModelFormatError(f"{m.path.name} holds a down projection both as ffn_down and ffn_down_t")
    return plan, predictors


def check_shapes(m: GgufModel, config: dict, plan) -> None:
    d, ff = config["hidden_size"], config["intermediate_size"]
    hd, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    want = {"q_proj": (heads * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d), "o_proj": (d, heads * hd),
            "gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff), "layernorm": (d,),
            "model.norm": (d,), "embed_tokens": (config["vocab_size"], d), "lm_head": (config["vocab_size"], d)}
    for hf, t, how in plan:
        shape = t.shape[::-1] if how == "transpose" else t.shape
        key = next(k for k in want if k in hf)
        if hf.endswith(".bias"):  # q/k/v biases: one value per output row
            want[key + ".bias"] = want[key][:1]
            key += ".bias"
        if tuple(shape) != want[key]:
            raise ModelFormatError(f"{m.path.name} is corrupt: {t.name} has shape {list(t.shape)} but the "
                                   f"metadata says {list(want[key])}")


def _safetensors_dtype(kind: str) -> str:
    return kind if kind in ("F32", "F16", "BF16") else "F32"


def _kept_as_blocks(kind: str, ndim: int, quantized: bool) -> bool:
    return quantized and kind in ("Q4_0", "Q8_0", *BLOCK_TYPES) and ndim == 2


DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
PREDICTOR_NAME = re.compile(r"^blk\.\d+\.fc[12]\.weight$")


def import_output_bytes(tensors, header_bytes: int, *, quantized: bool = True) -> int:
    """Bytes the import of a GGUF writes, from its header alone: `tensors` is (name, kind,
    shape, nbytes) per tensor. Tensor data is exact (the rules of stored_entry and
    predictor_entry: Q4_0/Q8_0/Q6_K matrices keep their blocks, F32/F16/BF16 their dtype, any
    other type - Q8_0 predictors - becomes F32); the JSON files (tokenizer,
    config, safetensors headers) are bounded by 4x the GGUF's header, which holds the vocabulary."""
    total = 4 * int(header_bytes) + 64 * 1024
    for name, kind, shape, nbytes in tensors:
        if name == "rope_freqs.weight":
            continue
        total += 160  # its safetensors header entry
        if PREDICTOR_NAME.match(name):  # predictor_entry's precision
            total += int(nbytes) if kind == "Q4_0" else DTYPE_BYTES.get(kind, 4) * math.prod(shape)
        elif _kept_as_blocks(kind, len(shape), quantized):
            total += int(nbytes)
        else:
            total += DTYPE_BYTES.get(_safetensors_dtype(kind), 4) * math.prod(shape)
    return total


def stored_entry(hf: str, t: GgufTensor, how: str, quantized: bool) -> tuple[str, str, tuple[int, ...]]:
    """(stored name, safetensors dtype, stored shape) of one weight in the checkpoint."""
    if _kept_as_blocks(t.kind, len(t.shape), quantized):
        rows = t.shape[0]
        return quant_name(hf, t.kind, transposed=how == "transpose"), "U8", (rows, t.raw.nbytes // rows)
    return hf, _safetensors_dtype(t.kind), t.shape[::-1] if how == "transpose" else t.shape


def quantized_rows(t: GgufTensor, how: str, config: dict) -> np.ndarray:
    """A Q4_0/Q8_0 tensor's rows of blocks as stored: the file's bytes, rows reordered for
    q/k (a row is self-contained, so undoing convert.py's permutation moves whole rows)."""
    rows = t.shape[0]
    raw = np.asarray(t.raw).reshape(rows, -1)
    if how in ("unpermute_q", "unpermute_k"):
        heads = config["num_attention_heads"] if how == "unpermute_q" else config["num_key_value_heads"]
        order = unpermute(np.arange(rows)[:, None], heads)[:, 0]
        raw = raw[order]
    return raw


def tensor_bytes(t: GgufTensor, how: str, config: dict):
    """The HF tensor's bytes (a numpy array), in pieces for big ones."""
    if how == "copy" and t.kind in ("F32", "F16", "BF16"):
        yield np.asarray(t.raw)
        return
    if how == "copy":
        rows = t.shape[0] if len(t.shape) > 1 else 1
        for lo in range(0, rows, _ROWS_PER_STEP):
            yield dequantize(t, lo, min(rows, lo + _ROWS_PER_STEP))
        return
    w = dequantize(t)
    if how == "transpose":
        w = np.ascontiguousarray(w.T)
    else:
        heads = config["num_attention_heads"] if how == "unpermute_q" else config["num_key_value_heads"]
        w = unpermute(w, heads)
    out = _restore_dtype(w, t.kind)
    yield out


def _restore_dtype(w: np.ndarray, kind: str) -> np.ndarray:
    """fp32 values back in the file's float type (exact: they came from it)."""
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return w


def predictor_entry(name: str, t: GgufTensor) -> tuple[str, str, tuple[int, ...]]:
    """(stored name, dtype, shape) of a predictor matrix at its file's precision: F16/BF16/F32
    as they are, Q4_0 as its blocks (PowerInfer's Q4_0 files quantize fc1/fc2 too: the int4
    tier's predictor rows are then the file's bytes), any other type as F32 (exact)."""
    if t.kind == "Q4_0":
        return quant_name(name, "Q4_0"), "U8", (t.shape[0], t.raw.nbytes // t.shape[0])
    return name, t.kind if t.kind in DTYPE_BYTES else "F32", t.shape
