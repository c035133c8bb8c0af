"""GGUF files (llama.cpp's and PowerInfer's) into a model folder the engine loads.

Read with ggml's own `gguf` package; no torch here (numpy only), so the import runs in
the model registry's command without loading the engine. The jobs, one file each:
`gguf_reader` (header and tensors), `gguf_config` (config.json), `gguf_plan` (where each
tensor goes, as what), `gguf_tokenizer` (tokenizer files); this file writes the folder. What is accepted:
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
import shutil
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from engine.errors import ModelFormatError
from engine.loading.gguf_config import hf_config
from engine.loading.gguf_plan import (
    check_shapes,
    predictor_entry,
    quantized_rows,
    stored_entry,
    tensor_bytes,
    tensor_plan,
)
from engine.loading.gguf_reader import dequantize, read_gguf
from engine.loading.gguf_tokenizer import tokenizer_config, tokenizer_json
from engine.loading.sidecar import sidecar_dir

Progress = Callable[[float, str], None]


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


def import_gguf(path: str | Path, target: Path, *, activation: str | None = None,
                progress: Progress | None = None, quantized: bool = True) -> dict:
    """Write the model of a GGUF file into the new folder `target` (removed again on failure).
    Returns a summary: architecture, powerinfer, tensor types, predictors, threshold.
    quantized: Q4_0/Q8_0/Q6_K matrices stay blocks (else they are written as F32)."""
    m = read_gguf(path)
    config = hf_config(m, activation)
    plan, predictors = tensor_plan(m, config)
    check_shapes(m, config, plan)
    if predictors and set(predictors) != set(range(config["num_hidden_layers"])):
        raise ModelFormatError(f"{m.path.name} has predictors for layers {sorted(predictors)} only")
    tokenizer = tokenizer_json(m)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=False)
    try:
        (target / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (target / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(m, tokenizer)), encoding="utf-8")
        plan.sort(key=lambda p: p[0])
        entries = [stored_entry(hf, t, how, quantized) for hf, t, how in plan]
        writer = _SafetensorsWriter(target / "model.safetensors", entries)
        try:
            for k, ((hf, t, how), entry) in enumerate(zip(plan, entries)):
                if progress:
                    progress(k / max(1, len(plan)), f"converting {t.name}")
                pieces = [quantized_rows(t, how, config)] if entry[1] == "U8" else tensor_bytes(t, how, config)
                for piece in pieces:
                    writer.f.write(np.ascontiguousarray(piece).tobytes())
                writer.written += 1
        finally:
            writer.close()
        threshold = m.fields.get("powerinfer.sparse_threshold")
        # the sidecar: an imported model's loads may write their prepared files (prepared.may_write)
        sidecar_dir(target).mkdir(exist_ok=True)
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


def _write_predictors(target: Path, predictors: dict[int, dict], config: dict, threshold) -> None:
    """The predictors in the engine's own file (thermocline/predictors.safetensors), at no
    more than the file's precision (`predictor_entry`)."""
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
            entry = predictor_entry(f"layers.{i}.{part}.weight", t)
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
