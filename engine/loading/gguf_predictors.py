"""Activation predictors out of a PowerInfer GGUF -> our predictor sidecar.

PowerInfer's converters write each layer's predictor (`model_N.pt`: fc1 [rank, d],
fc2 [n_ff, rank]) as GGUF tensors `blk.N.fc1.weight` / `blk.N.fc2.weight` in their torch
layout (GGUF lists dims reversed; the `gguf` reader gives numpy arrays in torch order),
fp32 or fp16 (Q4_0 in its Q4_0 files), kept at that precision, and the threshold as
`powerinfer.sparse_threshold`. The file may be a sparse
local copy holding only the header and these tensors (models_registry/gguf_fetch.py);
nothing else of it is read.

`python -m engine.loading.gguf_predictors GGUF MODEL_DIR` does the import in a child process (the
models registry, which must not import torch, uses it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelFormatError, UserError
from engine.kernels.quantized import Q4Matrix
from engine.loading.predictors import PredictorSet
from engine.arch import read_config

PREDICTOR_TENSOR = re.compile(r"^blk\.(\d+)\.fc([12])(?:\.weight)?$")
THRESHOLD_KEY = "powerinfer.sparse_threshold"


def _open(path: Path):
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PWRI":  # PowerInfer's own magic over a GGUF: read a copy-on-write view
        return _pwri_reader(path)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise ModelFormatError(f"{path.name} is not a readable GGUF file: {exc}") from None


def _pwri_reader(path: Path):
    """GGUFReader over a file that starts with `PWRI`: a temporary copy of its header says GGUF."""
    import tempfile

    from gguf import GGUFReader

    # The reader checks the magic as it opens; give it a sparse sibling with the header patched,
    # and the tensors it needs copied span by span (cheap for the predictors alone).
    tmp = Path(tempfile.mkdtemp(prefix="pwri-", dir=path.parent)) / path.name
    size = path.stat().st_size
    with open(path, "rb") as src, open(tmp, "wb") as out:
        out.truncate(size)
        head = src.read(min(size, 256 << 20))
        out.write(b"GGUF" + head[4:])
    reader = GGUFReader(tmp)
    with open(path, "rb") as src, open(tmp, "r+b") as out:
        for t in reader.tensors:
            if PREDICTOR_TENSOR.match(t.name) and t.data_offset >= len(head):
                src.seek(t.data_offset)
                out.seek(t.data_offset)
                out.write(src.read(int(t.n_bytes)))
    reader = GGUFReader(tmp)
    tmp.unlink()  # the map stays valid until the reader goes
    tmp.parent.rmdir()
    return reader


def _matrix(tensor):
    """A predictor tensor at its file's precision: F32/F16 as such, Q4_0 as its 4-bit rows
    (engine.kernels.quantized.Q4Matrix: the int4 tier takes the file's bytes), any other
    type dequantized to fp32 (exact)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(tensor.data))
    if kind == GGMLQuantizationType.Q4_0 and len(tensor.shape) == 2:
        cols, rows = (int(x) for x in tensor.shape)  # GGUF order: the row length first
        return Q4Matrix(torch.from_numpy(np.array(tensor.data).reshape(rows, -1)), cols)
    try:
        return torch.from_numpy(dequantize(np.asarray(tensor.data), kind).astype(np.float32))
    except NotImplementedError:
        raise ModelFormatError(f"predictor tensor {tensor.name} has type {kind.name}, "
                               "which cannot be read here") from None


def read_gguf_predictors(path: Path):
    """The PredictorSet a PowerInfer GGUF carries (raises ModelFormatError when it has none)."""
    reader = _open(Path(path))
    layers: dict[int, dict] = {}
    for t in reader.tensors:
        m = PREDICTOR_TENSOR.match(t.name)
        if m:
            weight = _matrix(t)
            if len(weight.shape) != 2:
                raise ModelFormatError(f"{t.name} in {Path(path).name} is not a matrix")
            layers.setdefault(int(m.group(1)), {})[f"fc{m.group(2)}.weight"] = weight
    if not layers:
        raise ModelFormatError(f"{Path(path).name} holds no blk.N.fc1/fc2 predictor tensors")
    field = reader.get_field(THRESHOLD_KEY)
    threshold = float(field.parts[field.data[0]][0]) if field is not None else 0.0
    layers = dict(sorted(layers.items()))  # numeric order
    return PredictorSet._from_layers(layers, [threshold] * len(layers), "powerinfer-gguf", Path(path).name)


def import_gguf_predictors(path: Path, model_dir: Path) -> Path:
    """Predictors of a PowerInfer GGUF -> `thermocline/predictors.safetensors`, checked against the model."""
    predictors = read_gguf_predictors(path)
    if (Path(model_dir) / "config.json").is_file():
        cfg = read_config(model_dir)
        predictors.check(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)
    return predictors.save(model_dir)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m engine.loading.gguf_predictors GGUF MODEL_DIR\n")
        return 2
    try:
        print(import_gguf_predictors(Path(args[0]), Path(args[1])))
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
