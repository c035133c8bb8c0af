"""GGUF files (llama.cpp's and PowerInfer's) into a model folder the engine loads.

Read with ggml's own `gguf` package; no torch here (numpy only), so the import runs in
the model registry's command without loading the engine. What is accepted:
- PowerInfer files: the magic `PWRI` in place of `GGUF` (written over the header by
  PowerInfer's convert.py), predictors `blk.N.fc1` / `blk.N.fc2`, the down projection
  stored transposed as `blk.N.ffn_down_t`, `powerinfer.sparse_threshold`;
- plain llama.cpp files of the `llama` and `bamboo` architectures (a plain `llama` file
  without predictors is SwiGLU, as llama.cpp computes it: Llama 2/3, Mistral, SmolLM2);
- tensors in F32, F16, BF16, Q8_0, Q4_0 and the types of engine.kernels.ggml_quants (Q4_1,
  Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: kept as their blocks, decoded exactly to fp32 when read);
  other types are refused.
Written: config.json, model.safetensors in Hugging Face names and layout (F16/BF16/F32
kept as they are; Q4_0/Q8_0 and the ggml_quants types kept as the file's blocks, the checkpoint's quantized tensor
kinds of engine.loading.weights: `NAME.q4_0` / `NAME.q8_0` / `NAME.q6_k`, or `NAME.t.q4_0` for
PowerInfer's transposed down projection, so the checkpoint is about the GGUF's size and
the CPU tier's 4-bit rows are the file's bytes - except a plain file's `ffn_down`, whose
blocks run along the intermediate dimension: an int4 load requantizes its neuron rows
(engine.model.q4_ffn; the summary's `notes` say so); `quantized=False` writes them as
F32, the exact dequantized values), tokenizer.json rebuilt from the file's vocabulary, predictors
into the sidecar at the file's precision (F16 as F16, Q4_0 as its blocks).

Every size, offset and type is checked against the file before a byte is used: a
truncated or lying file is refused with one message (ModelFormatError), never a traceback.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from engine.activations import NAMES
from engine.errors import ModelFormatError, UserError
from engine.kernels.tensor_kinds import quant_name
from engine.loading.sidecar import sidecar_dir
from engine.kernels.ggml_quants import TYPE_NAMES as BLOCK_TYPES

POWERINFER_MAGIC = b"PWRI"
GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "bamboo")
ACTIVATIONS = NAMES
Progress = Callable[[float, str], None]

_ROWS_PER_STEP = 4096  # rows dequantized at a time: bounds the fp32 copy
_READS = (f"Thermocline reads F32, F16, BF16, Q8_0, Q4_0, {', '.join(BLOCK_TYPES)} tensors (convert the file to "
          "one of these with llama.cpp's llama-quantize)")


def _types():
    import gguf

    T = gguf.GGMLQuantizationType
    return {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.Q8_0: "Q8_0", T.Q4_0: "Q4_0",
            **{T[kind]: kind for kind in BLOCK_TYPES}}


@dataclass
class GgufTensor:
    name: str
    kind: str              # F32 F16 BF16 Q8_0 Q4_0 Q6_K
    shape: tuple[int, ...]  # torch order: [rows, row length]
    raw: np.ndarray        # the file's bytes of this tensor (a view of the mapped file)


@dataclass
class GgufModel:
    path: Path
    powerinfer: bool
    arch: str
    fields: dict
    tensors: dict[str, GgufTensor]


class _Refused(Exception):
    """A tensor entry of the header that we refuse (before the reader touches its data)."""

    def __init__(self, message: str, user: bool = False):
        super().__init__(message)
        self.user = user


def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """GGUFReader that also takes PowerInfer's magic (the rest of the header is GGUF's),
        and checks each tensor entry's type, shape and extent before reading its data."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if offset == 0 and bytes(self.data[:4]) == POWERINFER_MAGIC:
                return np.frombuffer(GGUF_MAGIC, dtype=np.uint32)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            supported, size = _types(), len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _Refused(f"tensor {name} has the unknown type id {int(raw_dtype[0])}") from None
                if qtype not in supported:
                    raise _Refused(f"tensor {name} is {qtype.name}; {_READS}", user=True)
                shape = [int(x) for x in dims.tolist()]
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                if not shape or any(x <= 0 for x in shape) or shape[0] % block:
                    raise _Refused(f"tensor {name} has the impossible shape {shape[::-1]} for {qtype.name}")
                nbytes = math.prod(shape) // block * block_bytes
                start = int(start_offs) + int(offset[0])
                if start + nbytes > size:
                    raise _Refused(f"tensor {name} ({qtype.name} {shape[::-1]}, {nbytes} bytes at offset "
                                   f"{start}) lies outside the {size}-byte file: it is truncated or corrupt")
            return super()._build_tensors(start_offs, fields)

    return Reader


def _field_value(field):
    """A reader field as a Python value (str, number, or list of them)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(x).decode("utf-8", errors="replace") for x in items]
        return [x.tolist()[0] if len(x) == 1 else x.tolist() for x in items]
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def read_gguf(path: str | Path) -> GgufModel:
    """Parse and check a GGUF file; ModelFormatError/UserError say what is wrong."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path} is not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (GGUF_MAGIC, POWERINFER_MAGIC):
        raise ModelFormatError(f"{path.name} is not a GGUF file (it starts with {magic!r}, not GGUF or PWRI)")
    try:
        reader = _reader_class()(path, "r")
    except _Refused as exc:
        raise (UserError if exc.user else ModelFormatError)(f"{path.name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the reader's ValueError/IndexError/struct errors on bad headers
        raise ModelFormatError(f"{path.name} is truncated or corrupt: its header cannot be read ({exc})") from None
    fields = {}
    for name, field in reader.fields.items():
        try:
            fields[name] = _field_value(field)
        except Exception:  # noqa: BLE001 - a field we cannot decode is a corrupt file
            raise ModelFormatError(f"{path.name} is corrupt: metadata field {name!r} cannot be read") from None
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        named = f"its architecture is {arch[:60]!r}" if isinstance(arch, str) and arch else \
            "it names no readable architecture"
        raise UserError(f"{path.name} is not a GGUF of a supported architecture ({named}); Thermocline imports "
                        f"GGUFs of the {' and '.join(ARCHITECTURES)} architectures (ReLU-family models)")
    supported = _types()
    tensors = {}
    for t in reader.tensors:
        kind = supported.get(t.tensor_type)
        if kind is None:
            raise UserError(f"{path.name}: tensor {t.name} is {t.tensor_type.name}; {_READS}")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        n = math.prod(shape)
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if shape[-1] % block or n <= 0:
            raise ModelFormatError(f"{path.name} is corrupt: tensor {t.name} has shape {list(shape)}, "
                                   f"rows not a whole number of {kind} blocks")
        nbytes = n // block * block_bytes
        start = int(t.data_offset)
        if start < 0 or start + nbytes > size or int(t.n_bytes) != nbytes:
            raise ModelFormatError(f"{path.name} is truncated or corrupt: tensor {t.name} ({kind} "
                                   f"{list(shape)}, {nbytes} bytes at offset {start}) lies outside the "
                                   f"{size}-byte file")
        if t.name in tensors:
            raise ModelFormatError(f"{path.name} is corrupt: tensor {t.name} appears twice")
        raw = reader.data[start:start + nbytes]
        tensors[t.name] = GgufTensor(t.name, kind, shape, raw)
    _check_overlaps(path, tensors)
    return GgufModel(path, magic == POWERINFER_MAGIC, arch, fields, tensors)


def _check_overlaps(path: Path, tensors: dict[str, GgufTensor]) -> None:
    spans = sorted((t.raw.__array_interface__["data"][0], t.raw.nbytes, t.name) for t in tensors.values())
    for (a, an, aname), (b, _, bname) in zip(spans, spans[1:]):
        if a + an > b:
            raise ModelFormatError(f"{path.name} is corrupt: tensors {aname} and {bname} overlap")


# ------------------------------------------------------------------------------- tensors
def dequantize(t: GgufTensor, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Rows lo..hi of a tensor as float32 [rows, row length] (values exact for every type)."""
    import gguf

    rows = math.prod(t.shape[:-1])
    hi = rows if hi is None else hi
    row_bytes = t.raw.nbytes // rows
    chunk = np.asarray(t.raw[lo * row_bytes:hi * row_bytes]).reshape(hi - lo, row_bytes)
    if t.kind == "F32":
        return chunk.view(np.float32).copy()
    if t.kind == "F16":
        return chunk.view(np.float16).astype(np.float32)
    if t.kind == "BF16":
        return (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    qtype = gguf.GGMLQuantizationType[t.kind]
    return gguf.quants.dequantize(chunk, qtype).reshape(hi - lo, -1).astype(np.float32)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert.py's q/k row permutation (interleaved rotary halves -> HF's halves)."""
    out, cols = w.shape
    return w.reshape(heads, out // heads // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)


# -------------------------------------------------------------------------- safetensors
class _SafetensorsWriter:
    """Writes a safetensors file tensor by tensor (the header first, from known shapes),
    so a large model never sits in memory whole; BF16 bytes are copied as they are."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        sizes = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1}
        header, offset = ({"__metadata__": metadata} if metadata else {}), 0
        for name, dtype, shape in entries:
            n = math.prod(shape) * sizes[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self.order = path, [e[0] for e in entries]
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.written = 0

    def write(self, name: str, data: np.ndarray | bytes) -> None:
        if self.order[self.written] != name:
            raise AssertionError(f"tensor {name} written out of order")
        self.f.write(data if isinstance(data, (bytes, memoryview)) else np.ascontiguousarray(data).tobytes())
        self.written += 1

    def close(self) -> None:
        self.f.close()


# ---------------------------------------------------------------------------- the model
def _hf_config(m: GgufModel, activation: str | None) -> dict:
    f, a = m.fields, m.arch

    def need(key):
        value = f.get(f"{a}.{key}")
        if value is None:
            raise ModelFormatError(f"{m.path.name} lacks the metadata {a}.{key}")
        return value

    d, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = m.tensors.get("token_embd.weight")
    if vocab is None:
        raise ModelFormatError(f"{m.path.name} has no token_embd.weight")
    if activation is None:
        if a == "bamboo":
            activation = "drelu"
        elif m.powerinfer or "blk.0.fc1.weight" in m.tensors:
            activation = "relu"  # PowerInfer's llama models are ReluLLaMA / ProSparse
        else:  # llama.cpp's `llama` computes SiLU: a ReLU Llama's plain file needs --activation relu
            activation = "silu"
    if activation not in ACTIVATIONS:
        raise UserError(f"unknown activation {activation!r}: choose one of {', '.join(ACTIVATIONS)}")
    config = {
        "architectures": ["BambooForCausalLM" if a == "bamboo" else "LlamaForCausalLM"],
        "model_type": "bamboo" if a == "bamboo" else "llama",
        # Bamboo's dReLU is spelled "relu" in its config (engine.config reads it so)
        "hidden_act": "relu" if a == "bamboo" else activation,
        "hidden_size": d,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(f"{a}.attention.head_count_kv") or heads),
        "head_dim": int(f.get(f"{a}.attention.key_length") or d // heads),
        "rms_norm_eps": float(f.get(f"{a}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(f.get(f"{a}.rope.freq_base") or 10000.0),
        "max_position_embeddings": int(f.get(f"{a}.context_length") or 2048),
        "vocab_size": vocab.shape[0],
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = f.get(f"tokenizer.ggml.{name}")
        if value is not None:
            config[key] = int(value)
    return config


_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight", "ffn_down_t.weight": "mlp.down_proj.weight"}


def _plan(m: GgufModel, config: dict) -> tuple[list[tuple[str, GgufTensor, str]], dict[int, dict]]:
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
        how = {"attn_q.weight": "unpermute_q", "attn_k.weight": "unpermute_k",
               "ffn_down_t.weight": "transpose"}.get(rest, "copy")
        plan.append((f"model.layers.{i}.{_LAYER_NAMES[rest]}", t, how))
    names = [p[0] for p in plan]
    if len(set(names)) != len(names):
        raise ModelFormatError(f"{m.path.name} holds a down projection both as ffn_down and ffn_down_t")
    return plan, predictors


def _check_shapes(m: GgufModel, config: dict, plan) -> None:
    d, ff = config["hidden_size"], config["intermediate_size"]
    hd, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    want = {"q_proj": (heads * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d), "o_proj": (d, heads * hd),
            "gate_proj": (ff, d), "up_proj": (ff, d), "down_proj": (d, ff), "layernorm": (d,),
            "model.norm": (d,), "embed_tokens": (config["vocab_size"], d), "lm_head": (config["vocab_size"], d)}
    for hf, t, how in plan:
        shape = t.shape[::-1] if how == "transpose" else t.shape
        key = next(k for k in want if k in hf)
        if tuple(shape) != want[key]:
            raise ModelFormatError(f"{m.path.name} is corrupt: {t.name} has shape {list(t.shape)} but the "
                                   f"metadata says {list(want[key])}")


def _safetensors_dtype(kind: str) -> str:
    return kind if kind in ("F32", "F16", "BF16") else "F32"


def _kept_as_blocks(kind: str, ndim: int, quantized: bool) -> bool:
    return quantized and kind in ("Q4_0", "Q8_0", *BLOCK_TYPES) and ndim == 2


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
PREDICTOR_NAME = re.compile(r"^blk\.\d+\.fc[12]\.weight$")


def import_output_bytes(tensors, header_bytes: int, *, quantized: bool = True) -> int:
    """Bytes the import of a GGUF writes, from its header alone: `tensors` is (name, kind,
    shape, nbytes) per tensor. Tensor data is exact (the rules of _stored_entry and
    _predictor_entry: Q4_0/Q8_0/Q6_K matrices keep their blocks, F32/F16/BF16 their dtype, any
    other type - Q8_0 predictors - becomes F32); the JSON files (tokenizer,
    config, safetensors headers) are bounded by 4x the GGUF's header, which holds the vocabulary."""
    total = 4 * int(header_bytes) + 64 * 1024
    for name, kind, shape, nbytes in tensors:
        if name == "rope_freqs.weight":
            continue
        total += 160  # its safetensors header entry
        if PREDICTOR_NAME.match(name):  # _predictor_entry's precision
            total += int(nbytes) if kind == "Q4_0" else _DTYPE_BYTES.get(kind, 4) * math.prod(shape)
        elif _kept_as_blocks(kind, len(shape), quantized):
            total += int(nbytes)
        else:
            total += _DTYPE_BYTES.get(_safetensors_dtype(kind), 4) * math.prod(shape)
    return total


def _stored_entry(hf: str, t: GgufTensor, how: str, quantized: bool) -> tuple[str, str, tuple[int, ...]]:
    """(stored name, safetensors dtype, stored shape) of one weight in the checkpoint."""
    if _kept_as_blocks(t.kind, len(t.shape), quantized):
        rows = t.shape[0]
        return quant_name(hf, t.kind, transposed=how == "transpose"), "U8", (rows, t.raw.nbytes // rows)
    return hf, _safetensors_dtype(t.kind), t.shape[::-1] if how == "transpose" else t.shape


def _quantized_rows(t: GgufTensor, how: str, config: dict) -> np.ndarray:
    """A Q4_0/Q8_0 tensor's rows of blocks as stored: the file's bytes, rows reordered for
    q/k (a row is self-contained, so undoing convert.py's permutation moves whole rows)."""
    rows = t.shape[0]
    raw = np.asarray(t.raw).reshape(rows, -1)
    if how in ("unpermute_q", "unpermute_k"):
        heads = config["num_attention_heads"] if how == "unpermute_q" else config["num_key_value_heads"]
        order = _unpermute(np.arange(rows)[:, None], heads)[:, 0]
        raw = raw[order]
    return raw


def _tensor_bytes(t: GgufTensor, how: str, config: dict):
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
        w = _unpermute(w, heads)
    out = _restore_dtype(w, t.kind)
    yield out


def _restore_dtype(w: np.ndarray, kind: str) -> np.ndarray:
    """fp32 values back in the file's float type (exact: they came from it)."""
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return w


def import_gguf(path: str | Path, target: Path, *, activation: str | None = None,
                progress: Progress | None = None, quantized: bool = True) -> dict:
    """Write the model of a GGUF file into the new folder `target` (removed again on failure).
    Returns a summary: architecture, powerinfer, tensor types, predictors, threshold.
    quantized: Q4_0/Q8_0/Q6_K matrices stay blocks (else they are written as F32)."""
    m = read_gguf(path)
    config = _hf_config(m, activation)
    plan, predictors = _plan(m, config)
    _check_shapes(m, config, plan)
    if predictors and set(predictors) != set(range(config["num_hidden_layers"])):
        raise ModelFormatError(f"{m.path.name} has predictors for layers {sorted(predictors)} only")
    tokenizer = _tokenizer_json(m)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=False)
    try:
        (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (target / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
        (target / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(m, tokenizer)), encoding="utf-8")
        plan.sort(key=lambda p: p[0])
        entries = [_stored_entry(hf, t, how, quantized) for hf, t, how in plan]
        writer = _SafetensorsWriter(target / "model.safetensors", entries)
        try:
            for k, ((hf, t, how), entry) in enumerate(zip(plan, entries)):
                if progress:
                    progress(k / max(1, len(plan)), f"converting {t.name}")
                pieces = [_quantized_rows(t, how, config)] if entry[1] == "U8" else _tensor_bytes(t, how, config)
                for piece in pieces:
                    writer.f.write(np.ascontiguousarray(piece).tobytes())
                writer.written += 1
        finally:
            writer.close()
        threshold = m.fields.get("powerinfer.sparse_threshold")
        if predictors:
            _write_predictors(target, predictors, config, threshold)
        if progress:
            progress(1.0, "imported")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return {"architecture": m.arch, "powerinfer": m.powerinfer,
            "tensor_types": sorted({t.kind for t in m.tensors.values()}),
            "predictors": bool(predictors), "sparse_threshold": threshold, "notes": _notes(plan, quantized)}


def _notes(plan, quantized: bool) -> list[str]:
    """What the import cannot keep as the file's bytes, one line each."""
    downs = sorted({t.kind for hf, t, how in plan if hf.endswith("mlp.down_proj.weight") and how == "copy"
                    and t.kind == "Q4_0"})
    if quantized and downs:
        return ["ffn_down's Q4_0 blocks run along the intermediate dimension, not along a neuron's row: "
                "an int4 load requantizes the down projection's neuron rows (ggml's rounding, once, at the "
                "first load); gate, up, attention and head rows stay the file's bytes (PowerInfer's "
                "ffn_down_t files keep all of them)"]
    return []


def _predictor_entry(name: str, t: GgufTensor) -> tuple[str, str, tuple[int, ...]]:
    """(stored name, dtype, shape) of a predictor matrix at its file's precision: F16/BF16/F32
    as they are, Q4_0 as its blocks (PowerInfer's Q4_0 files quantize fc1/fc2 too: the int4
    tier's predictor rows are then the file's bytes), any other type as F32 (exact)."""
    if t.kind == "Q4_0":
        return quant_name(name, "Q4_0"), "U8", (t.shape[0], t.raw.nbytes // t.shape[0])
    return name, t.kind if t.kind in _DTYPE_BYTES else "F32", t.shape


def _write_predictors(target: Path, predictors: dict[int, dict], config: dict, threshold) -> None:
    """The predictors in the engine's own file (thermocline/predictors.safetensors), at no
    more than the file's precision (`_predictor_entry`)."""
    d, ff = config["hidden_size"], config["intermediate_size"]
    entries, data = [], []
    for i in sorted(predictors):
        layer = predictors[i]
        if set(layer) != {"fc1.weight", "fc2.weight"}:
            raise ModelFormatError(f"predictor of layer {i} lacks fc1 or fc2")
        fc1, fc2 = layer["fc1.weight"], layer["fc2.weight"]
        rank = fc1.shape[0]
        if len(fc1.shape) != 2 or tuple(fc1.shape) != (rank, d) or tuple(fc2.shape) != (ff, rank):
            raise ModelFormatError(f"predictor of layer {i} has shapes {list(fc1.shape)} and {list(fc2.shape)}; "
                                   f"expected [rank, {d}] and [{ff}, rank]")
        for part, t in (("fc1", fc1), ("fc2", fc2)):
            entry = _predictor_entry(f"layers.{i}.{part}.weight", t)
            entries.append(entry)
            data.append(np.asarray(t.raw).reshape(entry[2][0], -1) if entry[1] == "U8" or entry[1] == t.kind
                        else dequantize(t))
    folder = sidecar_dir(target)
    folder.mkdir(parents=True, exist_ok=True)
    value = float(threshold) if threshold is not None else 0.0
    metadata = {"thresholds": json.dumps([value] * len(predictors)), "source": "powerinfer-gguf",
                "extra": json.dumps({})}
    writer = _SafetensorsWriter(folder / "predictors.safetensors", entries, metadata)
    try:
        for (name, _, _), array in zip(entries, data):
            writer.write(name, array)
    finally:
        writer.close()


# ---------------------------------------------------------------------------- tokenizer
def _tokenizer_json(m: GgufModel) -> dict:
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
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                 "vocab": vocab, "merges": [m_.split(" ", 1) for m_ in merges]}
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": True},
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


def _tokenizer_config(m: GgufModel, tokenizer: dict) -> dict:
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
